"""Device fusion and compression kernels against their NumPy references, on one GPU: the
stand-in runs the same CUDA C built for the host (workers/kernels_worker.py)."""
import pytest

from gpu import KINDS, names, one_rank_job

CASES = [c for c in names("kernels_worker.py") if c != "a_cuda_capsule_gives_cupy_the_same_memory"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_match_numpy(kind, case):
    one_rank_job(kind).check(case)
