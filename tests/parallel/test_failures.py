"""A rank that fails or leaves ends the whole job quickly, and the output says which rank."""
import re
import time

import pytest

from runner import run_ranks

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 3])
def test_exception_on_one_rank_ends_the_job(np_):
    start = time.monotonic()
    proc = run_ranks("failing_worker.py", np_, timeout=60, check=False)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    assert "[1]<stderr>:ZeroDivisionError: rank 1 fails at step 3" in proc.stderr
    assert "rank 1 exited with code 1 (first failure)" in proc.stderr


def test_sys_exit_with_a_code_ends_the_job_with_that_code():
    start = time.monotonic()
    proc = run_ranks("reliability_raw.py", 2, ["exit", "3"], timeout=60, check=False)
    assert time.monotonic() - start < 20
    assert proc.returncode == 3, proc.stderr
    assert "hvdrun: rank 1 exited with code 3 (first failure); ending the job" in proc.stderr


@pytest.mark.parametrize("np_", [2, 3])
def test_sys_exit_with_a_code_under_plain_mpiexec_ends_the_job_with_that_code(np_):
    # mpiexec alone does not end a job when one rank exits non-zero (MPICH's waits for the
    # others), so the rank itself must end it.
    start = time.monotonic()
    proc = run_ranks("reliability_raw.py", np_, ["exit", "3"], timeout=60, check=False, plain=True)
    assert time.monotonic() - start < 30
    assert proc.returncode == 3, proc.stderr
    assert "hvd_trainer: rank 1 called sys.exit(3); ending the job" in proc.stderr


@pytest.mark.parametrize("plain", [False, True])
def test_a_caught_sys_exit_does_not_end_the_job(plain):
    proc = run_ranks("reliability_raw.py", 2, ["caught"], timeout=60, plain=plain)
    assert "rank 1 caught sys.exit(3)" in proc.stdout
    assert "ending the job" not in proc.stderr


def test_sys_exit_0_while_others_wait_is_named_by_the_stall_inspector_and_shut_down():
    start = time.monotonic()
    proc = run_ranks("reliability_raw.py", 2, ["exit", "0"], timeout=60, check=False,
                     env={"HVD_STALL_CHECK_TIME_SECONDS": "1", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    assert time.monotonic() - start < 20
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"\[0\]<stderr>:stall: rank 0 has waited [\d.]+ s for allreduce 'after exit'; "
                     r"rank 1 has not submitted it", proc.stderr), proc.stderr
    assert "rank 0 exited with code 1 (first failure)" in proc.stderr
