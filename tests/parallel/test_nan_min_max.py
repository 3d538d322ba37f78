"""Min and Max with NaN, ±inf and signed zeros on 2 and 3 ranks, through the ring and through
MPI_Allreduce (native), against NumPy, every rank holding the same bits."""
import pytest

from runner import case_job, case_names

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("case", case_names("nan_min_max_worker.py"))
@pytest.mark.parametrize("algorithm", ["ring", "native"])
@pytest.mark.parametrize("np_", [2, 3])
def test_nan_and_inf_in_min_max_match_numpy_on_every_rank(np_, algorithm, case):
    case_job("nan_min_max_worker.py", np_, [algorithm], timeout=180).check(case)
