"""root_rank is a global rank in a process set, and non-integer alltoall splits are refused
with an MXNetError, as in Horovod. Needs the core of issue 12 (global root_rank, splits check)."""
import pytest

from runner import case_job, case_names


@pytest.mark.parametrize("case", case_names("global_root_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_global_root_in_a_set_and_integer_splits(np_, case):
    case_job("global_root_worker.py", np_, timeout=120).check(case)
