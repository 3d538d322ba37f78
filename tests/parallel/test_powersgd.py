"""PowerSGD in the core's reducer on NumPy gradients (workers/powersgd_cases.py): the sums
against an independent NumPy model and exact resume on 2 and 3 ranks, digits convergence on 3
(a training-level case)."""
import pytest

from runner import case_job, case_names

ON_TWO = ["factors_match_numpy_model", "resume_keeps_state"]
JOBS = [(2, case) for case in ON_TWO] + [(3, case) for case in case_names("powersgd_cases.py")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("powersgd")


# Marked mpi: the factors' sums are small, below the ring's threshold, so MPI's own
# Allreduce makes them; CI's Open MPI pass runs the 3-rank job too.
@pytest.mark.mpi
@pytest.mark.parametrize("np_,case", JOBS)
def test_powersgd_cases(np_, folder, case):
    where = folder / str(np_)
    where.mkdir(exist_ok=True)
    selected = ON_TWO if np_ == 2 else []
    case_job("powersgd_cases.py", np_, [str(where), *selected], timeout=120).check(case)
