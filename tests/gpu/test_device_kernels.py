"""Device fusion and compression kernels against their NumPy references, on one GPU."""
import numpy as np
import pytest

from gpu import require_gpu

require_gpu()
import cupy  # noqa: E402

from hvd_trainer import compression  # noqa: E402
from hvd_trainer.cuda import fusion  # noqa: E402
from hvd_trainer.cuda.compression import device_codec  # noqa: E402

rng = np.random.default_rng(7)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "int8", "complex128"])
def test_pack_then_unpack_moves_every_element(dtype):
    shapes = [(3, 5), (0,), (1,), (1000,), (7, 11, 13)]
    host = [(rng.standard_normal(s) * 50).astype(dtype) for s in shapes]
    tensors = [cupy.asarray(h) for h in host]
    bucket = cupy.empty(sum(h.size for h in host), dtype)
    fusion.pack(tensors, bucket)
    np.testing.assert_array_equal(bucket.get(), np.concatenate([h.ravel() for h in host]))
    outs = [cupy.zeros_like(t) for t in tensors]
    fusion.unpack(bucket, outs)
    for h, o in zip(host, outs):
        np.testing.assert_array_equal(o.get(), h)


def test_scaling_rounds_like_numpy():
    f32 = rng.standard_normal(1001).astype(np.float32)
    f16 = f32.astype(np.float16)
    i32 = rng.integers(-1000, 1000, 1001).astype(np.int32)
    for host, expected in [
            (f32, f32 * np.float32(1 / 3)),
            (f16, (f16.astype(np.float32) * np.float32(1 / 3)).astype(np.float16)),
            (i32, np.trunc(i32 * (1 / 3)).astype(np.int32))]:
        flat = cupy.asarray(host)
        fusion.scale_(flat, 1 / 3)
        np.testing.assert_array_equal(flat.get(), expected)


def _steps(codec, size, steps=3):
    """Encode ``steps`` gradients with the NumPy codec and its device twin, from zero residuals.

    Yields the gradient, the device residual before the step, both payloads and residuals
    after it, and the device codec.
    """
    twin = device_codec(codec)
    host_res, dev_res = np.zeros(size, np.float32), cupy.zeros(size, cupy.float32)
    for step in range(steps):
        grad = rng.standard_normal(size).astype(np.float32)
        edge = [0.5, -0.5, 0.25, -0.25, np.float32(0.5) - np.float32(1e-7), 0, 1, -1]
        grad[:min(size, 8)] = edge[:min(size, 8)]
        before = dev_res.get()
        yield grad, before, codec.encode(grad, host_res), host_res, \
            twin.encode(cupy.asarray(grad), dev_res).get(), dev_res.get(), twin


@pytest.mark.parametrize("codec", [compression.TwoBit(0.5), compression.OneBit(0.0),
                                   compression.OneBit(0.5)], ids=["2bit", "1bit-0", "1bit-0.5"])
@pytest.mark.parametrize("size", [1, 15, 16, 100003])
def test_bit_codecs_match_numpy_byte_for_byte(codec, size):
    for grad, _, host_payload, host_res, dev_payload, dev_res, twin in _steps(codec, size):
        np.testing.assert_array_equal(dev_payload, host_payload)
        np.testing.assert_array_equal(dev_res, host_res)
        host_out, dev_out = np.ones(size, np.float32), cupy.ones(size, cupy.float32)
        codec.decode_add(host_payload, host_out)
        twin.decode_add(cupy.asarray(dev_payload), dev_out)
        np.testing.assert_array_equal(dev_out.get(), host_out)


def test_scaled_two_bit_keeps_what_it_does_not_send():
    codec = compression.ScaledTwoBit(1.0)
    for grad, old, host_payload, _, dev_payload, dev_res, twin in _steps(codec, 50001):
        threshold = dev_payload[:4].view(np.float32)[0]
        np.testing.assert_allclose(threshold, np.abs(grad).mean(), rtol=1e-5)
        sent = cupy.zeros(grad.size, cupy.float32)
        twin.decode_add(cupy.asarray(dev_payload), sent)
        np.testing.assert_allclose(sent.get() + dev_res, old + grad, atol=1e-5)
        assert set(np.unique(sent.get())) <= {-threshold, 0, threshold}


def test_top_k_sends_the_same_entries_as_numpy():
    codec = compression.TopK(0.01)
    for _, _, host_payload, host_res, dev_payload, dev_res, twin in _steps(codec, 100003):
        host_out, dev_out = np.zeros(100003, np.float32), cupy.zeros(100003, cupy.float32)
        codec.decode_add(host_payload, host_out)
        twin.decode_add(cupy.asarray(dev_payload), dev_out)
        np.testing.assert_array_equal(dev_out.get(), host_out)
        np.testing.assert_array_equal(dev_res, host_res)
