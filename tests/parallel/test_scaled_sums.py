"""Scaled sums round as Horovod's tests expect: float16 sums are summed and scaled in float32
and rounded once, after a prescale rounded to float16; float32 ones are scaled by the factor
rounded to float32 (Horovod's test_mxnet1.py and test_torch.py compare with zero tolerance on
up to 3 ranks); Average with a rank joined scales its sum by 1/size rounded to the dtype,
as Horovod does. One job per rank count; each case its own result."""
import pytest

from runner import case_job, case_names

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("case", case_names("scaled_sum_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_scaled_sum_matches_numpy(np_, case):
    case_job("scaled_sum_worker.py", np_, timeout=120).check(case)
