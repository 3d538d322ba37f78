"""The timeline is valid Chrome-trace JSON whose phases nest in call order."""
import json

import numpy as np

import hvd_trainer as hvd


def test_timeline_records_phases_in_order(tmp_path):
    path = tmp_path / "trace.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(np.ones(4), name="grad.0")
    hvd.broadcast(np.ones(2), root_rank=0, name="w")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(4), name="after.stop")
    events = json.loads(path.read_text())
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert set(tracks.values()) == {"grad.0", "w"}
    spans = [(tracks[e["pid"]], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert [(t, p) for t, p, _, _ in spans] == [("grad.0", "NEGOTIATE"), ("grad.0", "ALLREDUCE"),
                                               ("w", "NEGOTIATE"), ("w", "BROADCAST")]
    for (_, _, ts, dur), (_, _, next_ts, _) in zip(spans, spans[1:]):
        assert dur >= 0 and ts + dur <= next_ts


def test_stop_without_start_is_harmless():
    hvd.stop_timeline()
