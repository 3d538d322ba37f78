"""Every rank agrees: one rank's bad argument, setting, name or thread never desynchronises
or silently hangs the job (issue 12), on 2 and 3 ranks.

Each job is bounded in time, and its stall shutdown ends a hang with a non-zero exit (and
every rank with it, where the runner's timeout would leave ranks behind), so a hang fails
the test instead of holding the suite.
"""
import json
import re
import time

import pytest

from runner import case_job, case_names, run_ranks

# A job that hangs ends itself (and says where it waited) rather than waiting for the timeout.
# 45 s is far longer than any wait of these jobs, even on 2 loaded cores.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "45"}


@pytest.mark.parametrize("case", case_names("bad_argument_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_a_bad_argument_on_one_rank_raises_on_every_rank_and_the_next_call_works(np_, case):
    case_job("bad_argument_worker.py", np_, timeout=120, env=BOUNDED).check(case)


def per_rank_env(np_):
    """Rank 0 a small fusion threshold, rank 1 the ring, the last rank a small ring threshold:
    each alone made ranks move different bytes (truncated messages or a hang)."""
    env = {0: {"HVD_FUSION_THRESHOLD": "1000"}, 1: {"HVD_ALLREDUCE_ALGO": "ring"}}
    env.setdefault(np_ - 1, {})["HVD_RING_THRESHOLD"] = "100"
    return json.dumps(env)


@pytest.mark.parametrize("np_", [2, 3])
def test_wire_settings_that_differ_per_rank_are_rank_0s(np_):
    proc = run_ranks("env_worker.py", np_, [per_rank_env(np_)], timeout=120, env=BOUNDED)
    assert proc.stdout.count("allreduces with per-rank settings match NumPy") == np_
    assert ("[1]<stderr>:HVD_ALLREDUCE_ALGO is 'ring' on rank 1 but None on rank 0; every "
            "rank uses rank 0's value") in proc.stderr
    assert "[1]<stderr>:HVD_FUSION_THRESHOLD is None on rank 1 but '1000' on rank 0" in proc.stderr


@pytest.mark.parametrize("np_, variable, value, words", [
    (2, "HVD_FUSION_THRESHOLD", "64MB", "is not a number"),
    (3, "HVD_ALLREDUCE_ALGO", "fastest", "is not an allreduce algorithm"),
    (3, "HVD_RING_THRESHOLD", "-1", "is negative"),
])
def test_a_malformed_wire_setting_on_one_rank_fails_init_on_every_rank(np_, variable, value,
                                                                       words):
    bad = np_ - 1
    proc = run_ranks("env_worker.py", np_, [json.dumps({bad: {variable: value}})], timeout=60,
                     env=BOUNDED)
    for rank in range(np_):
        assert (f"rank {rank}: init raised ValueError: rank {bad}: {variable}={value!r} "
                f"{words}") in proc.stdout, proc.stdout


@pytest.mark.parametrize("case", case_names("process_set_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_process_sets_agree_on_registration_names_and_root_ranks(np_, case):
    case_job("process_set_worker.py", np_, timeout=120, env=BOUNDED).check(case)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("threads_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_from_two_threads_match_numpy(np_, case):
    case_job("threads_worker.py", np_, timeout=120, env=BOUNDED).check(case)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("count_limit_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_messages_over_the_count_limit_go_in_pieces(np_, case):
    env = dict(BOUNDED, HVD_ALLREDUCE_ALGO="auto", HVD_RING_THRESHOLD="20000")
    case_job("count_limit_worker.py", np_, timeout=120, env=env).check(case)


def test_a_stall_in_the_data_phase_names_the_late_rank():
    proc = run_ranks("data_phase_stall_worker.py", 3, ["stall"], timeout=60,
                     env={"HVD_STALL_CHECK_TIME_SECONDS": "1"})
    for rank in (0, 2):
        assert re.search(rf"\[{rank}\]<stderr>:stall: rank {rank} has waited [\d.]+ s for the "
                         r"data phase of allreduce 'late data'; rank 1 has not submitted it",
                         proc.stderr), proc.stderr
    assert "[1]<stderr>:stall" not in proc.stderr
    assert proc.stdout.count("stall over") == 3


def test_stall_shutdown_ends_a_job_stuck_in_the_data_phase():
    start = time.monotonic()
    proc = run_ranks("data_phase_stall_worker.py", 2, ["hang"], timeout=60, check=False,
                     env={"HVD_STALL_CHECK_TIME_SECONDS": "1",
                          "HVD_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "[0]<stderr>:hvd_trainer: stalled for" in proc.stderr
    assert re.search(r"\[0\]<stderr>:stall: rank 0 has waited [\d.]+ s for the data phase of "
                     r"allreduce 'late data'; rank 1 has not submitted it", proc.stderr)
