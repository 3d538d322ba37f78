"""Real multi-process runs of the NumPy collectives, on 2 and 3 ranks (3 catches ring chunking
that only works for even sizes)."""
import pytest

from runner import case_job, case_names

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("case", case_names("collectives_worker.py"))
@pytest.mark.parametrize("algorithm", ["ring", "native", "auto"])
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_match_numpy(np_, algorithm, case):
    case_job("collectives_worker.py", np_, [algorithm], timeout=120).check(case)


@pytest.mark.parametrize("case", case_names("mismatch_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_disagreeing_ranks_all_raise(np_, case):
    case_job("mismatch_worker.py", np_, timeout=60).check(case)
