"""Fault injection on real jobs through hvdrun: mismatches, crashes, stalls, timeline, resume.

Every test bounds the job's run time and checks that the job says what went wrong on every
rank. The workers are tests/parallel/workers/reliability_raw.py (NumPy only, quick to start)
and reliability_train.py (DistributedTrainer).
"""
import json
import re
import time

import numpy as np
import pytest

from runner import run_ranks


def ended(proc, code):
    """Assert hvdrun's exit code, with the job's output on failure."""
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


# -- agreement ------------------------------------------------------------------------------
def test_agreement_flags_kinds_and_barrier_on_three_ranks():
    out = run_ranks("reliability_raw.py", 3, ["checks"], timeout=60).stdout
    assert out.count("agreement checks passed") == 3
    assert out.count("ranks disagree on kind") == 3


@pytest.mark.mpi
@pytest.mark.parametrize("case, np_, message", [
    ("dtype", 2, "MismatchError: allreduce 'grad.7': ranks disagree on dtype of tensor 0 "
                 "'grad.7' (rank 0: '<f4', rank 1: '<f8')"),
    ("root", 3, "MismatchError: broadcast 'weights': ranks disagree on root_rank "
                "(rank 0: 0, rank 1: 0, rank 2: 1)"),
])
def test_uncaught_mismatch_ends_the_job_and_every_rank_says_why(case, np_, message):
    start = time.monotonic()
    proc = run_ranks("reliability_raw.py", np_, [case], timeout=60, check=False)
    assert time.monotonic() - start < 30
    ended(proc, 1)
    for rank in range(np_):
        assert f"[{rank}]<stderr>:hvd_trainer.coordination.messages.{message}" in proc.stderr
    assert "exited with code 1 (first failure)" in proc.stderr


def test_trainer_mismatches_raise_on_every_rank_and_a_step_agrees_once():
    out = run_ranks("reliability_train.py", 2, ["mismatch"], timeout=120).stdout
    for label in ("model shapes", "tensor missing", "dtype"):
        assert out.count(f" {label}: MismatchError: ") == 2, label
    assert "rank 0: (16,), rank 1: (17,)" in out
    assert "tensor 'grad.1' is missing on rank 1" in out
    assert out.count("one agreement per step") == 2


@pytest.mark.mpi
# -- fail fast ------------------------------------------------------------------------------
def test_exception_on_rank_1_at_step_3_ends_the_trainer_job():
    start = time.monotonic()
    proc = run_ranks("reliability_train.py", 2, ["exception"], timeout=120, check=False)
    assert time.monotonic() - start < 60
    ended(proc, 1)
    assert "[1]<stderr>:RuntimeError: rank 1 fails at step 3" in proc.stderr
    assert "[1]<stderr>:hvd_trainer: uncaught RuntimeError on rank 1; ending the job" in proc.stderr
    assert "hvdrun: rank 1 exited with code 1 (first failure)" in proc.stderr


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    """An uninterrupted run, and one that checkpoints every step until rank 1 is SIGKILLed."""
    folder = tmp_path_factory.mktemp("resume")
    run_ranks("reliability_train.py", 2, ["full", str(folder)], timeout=120)
    proc = run_ranks("reliability_train.py", 2, ["crash", str(folder)], timeout=120, check=False)
    return folder, proc, time.time()


@pytest.mark.mpi
def test_kill_minus_9_of_a_rank_mid_step_ends_the_job(crash):
    _, proc, finished = crash
    ended(proc, 137)
    killed = float(re.search(r"rank 1 kills itself in step 5 at ([\d.]+)", proc.stdout)[1])
    assert finished - killed < 10
    assert "hvdrun: rank 1 exited with code 137 (first failure); ending the job" in proc.stderr


def test_resume_from_checkpoint_equals_the_uninterrupted_run_bit_for_bit(crash):
    folder, _, _ = crash
    run_ranks("reliability_train.py", 2, ["resume", str(folder)], timeout=120)
    full, resumed = np.load(folder / "full.npy"), np.load(folder / "resume.npy")
    assert full.dtype == resumed.dtype == np.float32
    assert full.tobytes() == resumed.tobytes()
    assert not list(folder.glob("checkpoint.tmp.*"))


# -- stall inspector ------------------------------------------------------------------------
def test_stall_warning_names_the_late_rank_on_every_waiting_rank():
    proc = run_ranks("reliability_raw.py", 3, ["stall"], timeout=60,
                     env={"HVD_STALL_CHECK_TIME_SECONDS": "1"})
    for rank in (0, 2):
        assert re.search(rf"\[{rank}\]<stderr>:stall: rank {rank} has waited [\d.]+ s for "
                         r"allreduce 'late'; rank 1 has not submitted it", proc.stderr), proc.stderr
    assert "[1]<stderr>:stall" not in proc.stderr
    assert proc.stdout.count("stall over") == 3


@pytest.mark.mpi
def test_stall_shutdown_ends_the_job():
    start = time.monotonic()
    proc = run_ranks("reliability_raw.py", 3, ["hang"], timeout=60, check=False,
                     env={"HVD_STALL_CHECK_TIME_SECONDS": "1", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    assert time.monotonic() - start < 30
    ended(proc, 1)
    # The first waiting rank to reach the shutdown time ends the job; the other may be killed
    # before it logs, so one rank's report is what the job is sure to leave.
    assert re.search(r"\[[02]\]<stderr>:hvd_trainer: stalled for", proc.stderr), proc.stderr
    assert re.search(r"\[[02]\]<stderr>:stall: .*rank 1 has not submitted it", proc.stderr)
    assert "[1]<stderr>:hvd_trainer: stalled for" not in proc.stderr


# -- timeline -------------------------------------------------------------------------------
# An fp16 step: the step's agreement, then its one bucket through the fp16 hook, the update.
STEP_PHASES = ["NEGOTIATE", "WAIT_FOR_GRADIENT", "COMPRESS", "FUSE", "DECODE", "UPDATE"]


def steps_of(path):
    """The trace's complete events as (track, phase, start, end), split into training steps."""
    events = json.loads(path.read_text())
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = sorted(((tracks[e["pid"]], e["name"], e["ts"], e["ts"] + e["dur"])
                    for e in events if e["ph"] == "X"), key=lambda s: (s[2], -s[3]))
    steps, current = [], []
    for span in spans:
        if not span[0].startswith("param."):  # the trainer's initial weight broadcast
            current.append(span)
        if span[:2] == ("step", "UPDATE"):
            steps.append(current)
            current = []
    assert not current, f"events after the last update: {current}"
    return steps


def check_step(spans):
    """Phases in order without overlap; COMMUNICATE inside FUSE; the bucket's (covered)
    NEGOTIATE between COMPRESS and FUSE."""
    group = [s for s in spans if s[0] == "bucket.0"]
    main = [s for s in spans if s not in group
            or s[1] in ("WAIT_FOR_GRADIENT", "COMPRESS", "FUSE", "DECODE")]
    assert [s[1] for s in main] == STEP_PHASES, [s[:2] for s in main]
    for earlier, later in zip(main, main[1:]):
        assert earlier[2] <= earlier[3] <= later[2] + 1e-2, (earlier, later)
    fuse = next(s for s in group if s[1] == "FUSE")
    inner = [s for s in group if s[1] == "COMMUNICATE"]
    assert inner and all(fuse[2] <= s[2] <= s[3] <= fuse[3] + 1e-2 for s in inner)
    assert [s[1] for s in group] == ["WAIT_FOR_GRADIENT", "COMPRESS", "NEGOTIATE", "FUSE",
                                     "COMMUNICATE", "DECODE"]


def test_timeline_phases_nest_in_order_and_start_stop_at_run_time(tmp_path):
    trace = tmp_path / "trace.json"
    # HVD_TIMELINE is what hvdrun --timeline-filename sets (test_hvdrun.py checks that).
    proc = run_ranks("reliability_train.py", 2, ["timeline", str(tmp_path)], timeout=120,
                     env={"HVD_TIMELINE": str(trace)})
    assert proc.stdout.count("timeline steps done") == 2
    first, late = steps_of(trace), steps_of(tmp_path / "late.json")
    assert (len(first), len(late)) == (3, 2)
    for spans in first + late:
        check_step(spans)
