"""DistributedTrainer / DistributedOptimizer on a process set: members train together, the
rank outside the set trains alone, as in Horovod."""
import pytest

from runner import case_job, case_names

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("process_sets")


@pytest.mark.parametrize("case", case_names("process_set_trainer.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_trainer_on_a_subset(np_, folder, case):
    where = folder / str(np_)
    where.mkdir(exist_ok=True)
    case_job("process_set_trainer.py", np_, [str(where)], timeout=180).check(case)
