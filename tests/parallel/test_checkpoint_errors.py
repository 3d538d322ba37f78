"""Errors of the collective checkpoint calls raise on every rank of 3, whatever their class
(issue 34): an extra= that cannot be pickled or unpickled, a device or a file cut inside its
header; the next collective works. Each case is its own result."""
import pytest

from runner import case_job, case_names

pytest.importorskip("mxnet", reason="needs MXNet: pip install -e '.[test]'")

# A job that hangs ends itself, naming where it waited, instead of holding the suite.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "30"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoint_errors")


@pytest.mark.parametrize("case", case_names("checkpoint_errors_worker.py"))
def test_checkpoint_error_raises_on_every_rank(folder, case):
    case_job("checkpoint_errors_worker.py", 3, [str(folder)], timeout=180, env=BOUNDED).check(case)
