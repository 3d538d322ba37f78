"""A legacy ``dltensor`` capsule of device memory reaches CuPy through dlpack.Capsule without a
copy: the hand-off mxnet/bridge.py makes for GPU NDArrays (MXNet 1.9.1 cannot run beside the
GPU machine's NumPy 2, so CuPy's own ``toDlpack``, the same kind of capsule, stands in)."""
import pytest

from gpu import KINDS, one_rank_job


@pytest.mark.parametrize("kind", KINDS)
def test_a_cuda_capsule_gives_cupy_the_same_memory(kind):
    one_rank_job(kind).check("a_cuda_capsule_gives_cupy_the_same_memory")
