"""Horovod's matching and no cascade after errors (issue 21), on 2 and 3 ranks: named
asynchronous calls pair by name, a duplicate name raises on its rank alone, and a long
sequence of good and bad calls keeps every rank in step. One job per rank count; each case
is its own result."""
import pytest

from runner import case_job, case_names

# A job that hangs ends itself, naming where it waited, instead of holding the suite.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@pytest.mark.parametrize("case", case_names("matching_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_matching_case(np_, case):
    case_job("matching_worker.py", np_, timeout=240, env=BOUNDED).check(case)
