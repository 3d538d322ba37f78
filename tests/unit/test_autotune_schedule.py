"""The autotuner's schedule, timing and choice with made-up launch times (no clock), its CSV
log, and a size-1 Reducer that follows the schedule from step to step. Multi-rank agreement
on the choice and training through the switches: tests/parallel/test_autotune.py."""
import csv
import logging

import numpy as np
import pytest

from hvd_trainer.training import reducer as reducer_module
from hvd_trainer.runtime import runtime
from hvd_trainer.training.autotune import Autotuner, Setting, candidates
from hvd_trainer.training.buckets import Gradient
from hvd_trainer.training.reducer import Reducer

MiB = 1 << 20
START = Setting(16 * MiB, False)
TRIED = [Setting(1 * MiB, False), Setting(1 * MiB, True), Setting(4 * MiB, False)]


def run(tuner, step_seconds):
    """Launch every tuning step, sample s's steps ``step_seconds[s]`` apart; return the times."""
    now, times = 100.0, []
    for step in range(tuner.last_step + 1):
        tuner.launched(step, now)
        times.append(now)
        now += step_seconds[step // tuner.steps_per_sample]
    return times


def test_candidates_are_every_threshold_with_every_overlap():
    assert candidates([1, 2], [False, True]) == [(1, False), (1, True), (2, False), (2, True)]


def test_schedule_warmup_samples_then_each_candidate_then_the_choice():
    tuner = Autotuner(START, TRIED, warmup_samples=2, steps_per_sample=3)
    assert tuner.last_step == 5 * 3 - 1
    want = [START] * 6 + [TRIED[0]] * 3 + [TRIED[1]] * 3 + [TRIED[2]] * 3
    assert [tuner.setting(s) for s in range(15)] == want
    assert tuner.setting(15) == START  # nothing adopted yet: the configured setting
    tuner.adopt((4 * MiB, 0))
    assert tuner.setting(15) == tuner.setting(1000) == Setting(4 * MiB, False)
    assert tuner.setting(14) == TRIED[2]  # the schedule itself does not change


def test_each_sample_is_the_mean_interval_between_its_launches():
    tuner = Autotuner(START, TRIED, warmup_samples=1, steps_per_sample=4)
    run(tuner, [0.5, 0.3, 0.1, 0.2])
    # 4 steps give 3 intervals; the interval to the next sample's first launch is not counted.
    assert tuner.means == pytest.approx([0.5, 0.3, 0.1, 0.2])
    assert tuner.best() == TRIED[1]


def test_a_faster_warmup_sample_is_never_chosen_and_ties_go_to_the_first():
    tuner = Autotuner(START, TRIED, warmup_samples=1, steps_per_sample=2)
    run(tuner, [0.01, 0.2, 0.2, 0.3])
    assert tuner.best() == TRIED[0]


def test_uneven_intervals_within_a_sample_average():
    tuner = Autotuner(START, [TRIED[0]], warmup_samples=0, steps_per_sample=3)
    tuner.launched(0, 10.0)
    tuner.launched(1, 10.5)
    tuner.launched(2, 12.0)
    assert tuner.means == pytest.approx([1.0])


def test_choosing_before_the_last_sample_or_with_short_samples_is_refused():
    tuner = Autotuner(START, TRIED, warmup_samples=0, steps_per_sample=2)
    tuner.launched(0, 0.0)
    tuner.launched(1, 1.0)
    with pytest.raises(RuntimeError, match="timed 1 of its 3 samples"):
        tuner.best()
    with pytest.raises(ValueError, match="HVD_AUTOTUNE_STEPS_PER_SAMPLE=1 must be at least 2"):
        Autotuner(START, TRIED, warmup_samples=0, steps_per_sample=1)


def test_the_log_has_one_row_per_sample_and_the_choice(tmp_path):
    path = tmp_path / "log.csv"
    tuner = Autotuner(START, TRIED, warmup_samples=1, steps_per_sample=2, log_path=str(path),
                      name="net.step")
    run(tuner, [1.0, 0.25, 0.5, 0.75])
    tuner.adopt(tuner.best())
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["reducer", "sample", "kind", "bucket_threshold", "overlap", "steps",
         "mean_seconds_per_step"],
        ["net.step", "0", "warmup", str(16 * MiB), "0", "2", "1"],
        ["net.step", "1", "candidate", str(MiB), "0", "2", "0.25"],
        ["net.step", "2", "candidate", str(MiB), "1", "2", "0.5"],
        ["net.step", "3", "candidate", str(4 * MiB), "0", "2", "0.75"],
        ["net.step", "4", "chosen", str(MiB), "0", "", ""]]


class FakeClock:
    """perf_counter for the reducer: each call advances by the next of ``gaps`` seconds."""

    def __init__(self, gaps):
        self.now, self.gaps = 0.0, list(gaps)

    def perf_counter(self):
        self.now += self.gaps.pop(0)
        return self.now


def test_a_reducer_follows_the_schedule_relays_its_buckets_and_keeps_the_choice(monkeypatch):
    runtime.init()
    settings = dict(runtime.state().settings, AUTOTUNE=1, AUTOTUNE_WARMUP_SAMPLES=1,
                    AUTOTUNE_STEPS_PER_SAMPLE=2, BUCKET_THRESHOLD=16 * MiB, OVERLAP=0)
    monkeypatch.setattr(runtime.state(), "settings", settings)
    reducer = Reducer()
    # One rank: only the thresholds vary (1, 4, 16, 64 MiB), after one warmup sample.
    tuner = reducer.autotuner
    assert tuner.samples == [START] + [Setting(t * MiB, False) for t in (1, 4, 16, 64)]
    # Sample k's two launches are gaps[2k + 1] apart; 4 MiB (sample 2) is the fastest.
    gaps = [0, 0.9, 1, 0.8, 1, 0.1, 1, 0.7, 1, 0.6, 1, 1, 1]
    monkeypatch.setattr(reducer_module, "time", FakeClock(gaps))
    # Two 5 MiB gradients: a bucket each at 1 and 4 MiB (each fills one), one bucket for
    # both at 16 and 64.
    size = 5 * MiB // 4
    reducer.set_gradients([Gradient(0, (size,), "<f4"), Gradient(1, (size,), "<f4")])
    layouts = []
    for step in range(tuner.last_step + 3):
        values = {}
        for bucket in reducer.buckets:  # the adapter backs each new layout
            if bucket.open is None:
                flat = np.zeros(bucket.bounds[-1], np.float32)
                bucket.open = lambda flat=flat: flat
                bucket.flat = flat
            for key, a, b in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                bucket.flat[a:b] = step + key
                values[key] = bucket.flat[a:b]
        layouts.append((reducer.bucket_threshold, len(reducer.buckets)))
        reducer.mark_all([(0, None), (1, None)])
        reducer.finish(reducer.close()[0])
        for key, value in values.items():  # a size-1 sum leaves each gradient as it was
            assert np.array_equal(value, np.full(size, step + key, np.float32))
    assert layouts == [(16 * MiB, 1)] * 2 + [(MiB, 2)] * 2 + [(4 * MiB, 2)] * 2 \
        + [(16 * MiB, 1)] * 2 + [(64 * MiB, 1)] * 2 + [(4 * MiB, 2)] * 2
    assert tuner.chosen == Setting(4 * MiB, False)


def test_a_log_in_a_missing_folder_warns_once_when_made_and_tuning_goes_on(tmp_path, caplog):
    path = tmp_path / "missing" / "log.csv"
    with caplog.at_level(logging.WARNING, logger="hvd_trainer"):
        tuner = Autotuner(START, TRIED, warmup_samples=1, steps_per_sample=2, log_path=str(path))
        warned_at_start = [r.getMessage() for r in caplog.records]
        run(tuner, [1.0, 0.25, 0.5, 0.75])
        assert tuner.adopt(tuner.best()) == TRIED[0]
    assert len(warned_at_start) == 1
    assert warned_at_start[0].startswith(f"cannot write the autotune log {str(path)!r}")
    assert len(caplog.records) == 1 and not path.exists()


def test_two_reducers_share_one_log_with_one_header(tmp_path):
    path = str(tmp_path / "log.csv")
    first = Autotuner(START, TRIED, warmup_samples=0, steps_per_sample=2, log_path=path, name="a")
    second = Autotuner(START, TRIED, warmup_samples=0, steps_per_sample=2, log_path=path, name="b")
    for tuner in (first, second):
        run(tuner, [0.5, 0.25, 0.75])
        tuner.adopt(tuner.best())
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows[0][0] == "reducer" and [row[0] for row in rows[1:]] == ["a"] * 4 + ["b"] * 4
