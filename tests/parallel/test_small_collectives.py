"""Small collectives whose data travels in the carrier's gather after the agreement (issues 25
and 50), on 2 and 3 ranks: one exchange and one gather per call, results equal to NumPy's,
the same errors as on large data, and the slow way where one rank's data does not fit. One
job per rank count; each case is its own result."""
import pytest

from runner import case_job, case_names

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi

# A job that hangs ends itself, naming where it waited, instead of holding the suite.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@pytest.mark.parametrize("case", case_names("small_collectives_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_small_collectives_case(np_, case):
    case_job("small_collectives_worker.py", np_, timeout=300, env=BOUNDED).check(case)
