"""The CPU stand-in for CuPy and NCCL fails where a GPU program's ordering or arguments are
wrong (workers/standin_worker.py): a check of the stand-in itself, so it runs on it alone."""
import pytest

from gpu import KINDS, names, one_rank_job


@pytest.mark.parametrize("case", names("standin_worker.py"))
def test_the_standin_fails_where_a_gpu_program_is_wrong(case):
    if "standin" not in KINDS:
        pytest.skip("HVD_TEST_GPU_KINDS leaves the stand-in out")
    one_rank_job("standin").check(case)
