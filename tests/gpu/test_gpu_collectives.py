"""The GPU collectives in one process: NCCL at world size 1 (where CuPy has NCCL), checked
against NumPy. NCCL refuses two ranks on one GPU, so test_host_staged.py covers several ranks."""
import numpy as np
import pytest

from gpu import require_gpu

require_gpu()
import cupy  # noqa: E402

import hvd_trainer as hvd  # noqa: E402
from hvd_trainer import compression, cuda
from hvd_trainer.collectives import feedback
from hvd_trainer.runtime import runtime  # noqa: E402
from hvd_trainer.backends import nccl  # noqa: E402

rng = np.random.default_rng(3)


@pytest.fixture(autouse=True)
def small_fusion_threshold():
    hvd.init()
    held = runtime.state().fusion_threshold
    runtime.state().fusion_threshold = 4096  # several buckets from a few small tensors
    yield
    runtime.state().fusion_threshold = held


def test_the_communicator_is_nccl_when_cupy_has_it():
    assert hvd.cuda_built()
    assert hvd.nccl_built() == nccl.available()
    expected = nccl.NCCLCommunicator if nccl.available() else cuda.ops.HostStagedCommunicator
    assert type(cuda.communicator()) is expected


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max, hvd.Min, hvd.Product])
def test_grouped_allreduce_with_scaling_matches_numpy(op):
    host = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (1000,), (2,), (513,)]]
    host.append(rng.integers(-9, 9, 300).astype(np.int32))
    tensors = [cupy.asarray(h) for h in host]
    out = cuda.grouped_allreduce_(tensors, op, "g", prescale_factor=2.0, postscale_factor=0.5)
    assert all(o is t for o, t in zip(out, tensors))
    for h, t in zip(host, tensors):  # one rank: the op of one value, scaled by 2 then 0.5
        expected = (h * 2 * 0.5).astype(h.dtype)
        np.testing.assert_allclose(t.get(), expected, rtol=1e-6)


def test_out_of_place_allreduce_leaves_its_input():
    x = cupy.arange(10, dtype=cupy.float64)
    y = cuda.allreduce(x[::2], hvd.Sum)  # a strided input is copied first
    np.testing.assert_array_equal(y.get(), np.arange(0, 10, 2))
    np.testing.assert_array_equal(x.get(), np.arange(10))


def test_allgather_broadcast_reducescatter_at_world_size_one():
    x = cupy.asarray(rng.standard_normal((5, 3)).astype(np.float32))
    np.testing.assert_array_equal(cuda.allgather(x).get(), x.get())
    b = x.copy()
    cuda.broadcast_(b, 0)
    np.testing.assert_array_equal(b.get(), x.get())
    np.testing.assert_array_equal(cuda.reducescatter(x, hvd.Sum).get(), x.get())


def test_the_top_level_collectives_hand_cupy_arrays_to_the_gpu_ones():
    x = cupy.arange(6, dtype=cupy.float32)
    for result in (hvd.allreduce(x, hvd.Sum), hvd.grouped_allreduce([x], hvd.Sum)[0],
                   hvd.allgather(x), hvd.broadcast(x, 0), hvd.reducescatter(x, hvd.Sum)):
        assert isinstance(result, cupy.ndarray)
        np.testing.assert_array_equal(result.get(), np.arange(6))
    assert hvd.allreduce_(x, hvd.Sum) is x and hvd.broadcast_(x, 0) is x


def test_compressed_sum_on_the_gpu_equals_the_numpy_one():
    grads = [rng.standard_normal(n).astype(np.float32) for n in (5000, 2048)]
    host = feedback.ErrorFeedbackSum(compression.TwoBit(0.5))
    device = cuda.DeviceErrorFeedbackSum(compression.TwoBit(0.5))
    for step in range(3):
        h = [(i, g.copy()) for i, g in enumerate(grads)]
        d = [(i, cupy.asarray(g)) for i, g in enumerate(grads)]
        host.sum_(h, f"h{step}", scale=0.5)
        device.sum_(d, f"d{step}", scale=0.5)
        for (_, a), (_, b) in zip(h, d):
            np.testing.assert_array_equal(b.get(), a)


def test_fp16_compression_casts_on_the_device():
    x = cupy.asarray(rng.standard_normal(100).astype(np.float32))
    payload, ctx = compression.Compression.fp16.compress(x)
    assert isinstance(payload, cupy.ndarray) and payload.dtype == np.float16
    back = compression.Compression.fp16.decompress(payload, ctx)
    np.testing.assert_array_equal(back.get(), x.get().astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("dtype", ["bool", "complex64", "int16"])
def test_dtypes_nccl_has_no_type_for_still_reduce(dtype):
    host = (rng.standard_normal(50) > 0).astype(dtype)
    x = cupy.asarray(host)
    cuda.allreduce_(x, hvd.Sum)  # one rank: the sum is the input, whichever path it took
    np.testing.assert_array_equal(x.get(), host)


def test_wrong_arguments_name_the_fix():
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a cupy.ndarray"):
        cuda.grouped_allreduce_([cupy.ones(2), np.ones(3)])  # a list goes by its first array
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda.allreduce_(cupy.ones((4, 4))[:, 1])
    with pytest.raises(ValueError, match="float32"):
        cuda.DeviceErrorFeedbackSum(compression.TwoBit(0.5)).sum_(
            [("w", cupy.ones(2048, cupy.float16))], "half")
