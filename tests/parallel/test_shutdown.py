"""shutdown() with an async collective left pending on one rank, then init() again, as
Horovod's suites do between tests (tearDown's barrier and shutdown, the next setUp's init):
every rank reaches the next barrier and the end, and the job exits 0. Under Open MPI the next
init() failed with MPI_ERR_TRUNCATE or hung, under MPICH the rank crashed at exit: the pending
call's agreement round went on on COMM_WORLD beside the next init's collectives."""
import subprocess

import pytest

from runner import run_ranks

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [3])
def test_a_call_left_pending_at_shutdown_does_not_disturb_the_next_init(np_):
    try:
        proc = run_ranks("shutdown_pending_worker.py", np_, timeout=90, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job ran past 90 s:\n{e.stdout!r}\n{e.stderr!r}")
    output = proc.stdout + proc.stderr
    for rank in range(np_):
        for step in ("first barrier", "second barrier", "end"):
            assert f"rank {rank} reached {step}" in output, output[-6000:]
    assert proc.returncode == 0, output[-6000:]
