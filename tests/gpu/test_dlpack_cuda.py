"""A legacy ``dltensor`` capsule of CUDA memory reaches CuPy through dlpack.Capsule without a
copy. MXNet 1.9.1 cannot run beside the GPU machine's NumPy 2, so PyTorch's ``to_dlpack``,
which hands out the same kind of capsule, stands in for ``NDArray.to_dlpack_for_write``."""
import numpy as np
import pytest

from gpu import require_gpu

require_gpu()
import cupy  # noqa: E402

from hvd_trainer.collectives.dlpack import CUDA, Capsule  # noqa: E402

torch = pytest.importorskip("torch", reason="PyTorch provides the CUDA DLPack capsule here")


def test_a_cuda_capsule_gives_cupy_the_same_memory():
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    torch.cuda.synchronize()  # the producer's writes are done, as MXNet's to_dlpack ensures
    x = cupy.from_dlpack(Capsule(torch.utils.dlpack.to_dlpack(t), (CUDA, t.device.index)))
    assert x.data.ptr == t.data_ptr() and x.shape == (3, 4) and x.dtype == np.float32
    x *= 2  # a write through CuPy lands in the producer's tensor
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(t.cpu().numpy(), np.arange(12).reshape(3, 4) * 2)
