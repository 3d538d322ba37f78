"""The timeline is valid Chrome-trace JSON whose phases nest and follow call order."""
import json

import numpy as np

import hvd_trainer as hvd


def _spans(path):
    """(track name, phase, start, end) of every complete event, in start order."""
    events = json.loads(path.read_text())
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = [(tracks[e["pid"]], e["name"], e["ts"], e["ts"] + e["dur"])
             for e in events if e["ph"] == "X"]
    return sorted(spans, key=lambda s: (s[2], -s[3]))


def test_collective_phases_nest_in_call_order(tmp_path):
    path = tmp_path / "trace.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(np.ones(4), name="grad.0")
    hvd.broadcast(np.ones(2), root_rank=0, name="w")
    hvd.stop_timeline()
    spans = _spans(path)
    assert [(t, p) for t, p, _, _ in spans] == [
        ("grad.0", "NEGOTIATE"), ("grad.0", "FUSE"), ("grad.0", "COMMUNICATE"),
        ("w", "NEGOTIATE"), ("w", "COMMUNICATE")]
    negotiate, fuse, communicate, w_negotiate, w_communicate = spans
    assert all(start <= end for _, _, start, end in spans)
    assert negotiate[3] <= fuse[2]                               # one after the other
    assert fuse[2] <= communicate[2] <= communicate[3] <= fuse[3]  # COMMUNICATE inside FUSE
    assert fuse[3] <= w_negotiate[2] and w_negotiate[3] <= w_communicate[2]


def test_start_and_stop_at_run_time(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    hvd.allreduce(np.ones(2), name="before")
    hvd.start_timeline(str(first))
    hvd.allreduce(np.ones(2), name="during")
    hvd.start_timeline(str(second))  # a new start closes the running timeline
    hvd.allreduce(np.ones(2), name="later")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(2), name="after")
    assert {t for t, _, _, _ in _spans(first)} == {"during"}
    assert {t for t, _, _, _ in _spans(second)} == {"later"}


def test_stop_without_start_is_harmless():
    hvd.stop_timeline()


def test_a_timeline_that_cannot_be_written_warns_once_and_collectives_go_on(tmp_path, caplog):
    hvd.start_timeline(str(tmp_path / "missing" / "trace.json"))
    for _ in range(3):
        np.testing.assert_array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum), np.ones(3))
    hvd.stop_timeline()
    warnings = [r for r in caplog.records if "timeline" in r.getMessage()]
    assert len(warnings) == 1 and "missing" in warnings[0].getMessage()


def test_a_timeline_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "trace.json").symlink_to(victim)
    hvd.start_timeline(str(tmp_path / "trace.json"))
    hvd.allreduce(np.ones(2), name="x")
    hvd.stop_timeline()
    assert victim.read_text() == "keep"
