"""Device fusion and compression kernels against their NumPy references, and a legacy DLPack
capsule of device memory into CuPy, on one GPU."""
import functools

from gpu_common import place_gpus, run_cases

place_gpus()
import cupy  # noqa: E402
import numpy as np  # noqa: E402

from hvd_trainer import compression  # noqa: E402
from hvd_trainer.collectives.dlpack import CUDA, Capsule  # noqa: E402
from hvd_trainer.cuda import fusion  # noqa: E402
from hvd_trainer.cuda.compression import device_codec  # noqa: E402

rng = np.random.default_rng(7)
PACK = {"pack_unpack_float32": "float32", "pack_unpack_float16": "float16",
        "pack_unpack_float64": "float64", "pack_unpack_int32": "int32",
        "pack_unpack_int8": "int8", "pack_unpack_complex128": "complex128"}
CODECS = {"2bit": compression.TwoBit(0.5), "1bit_0": compression.OneBit(0.0),
          "1bit_0.5": compression.OneBit(0.5)}
BIT_CODECS = {"2bit_1": ("2bit", 1), "2bit_15": ("2bit", 15), "2bit_16": ("2bit", 16),
              "2bit_100003": ("2bit", 100003), "1bit_0_1": ("1bit_0", 1),
              "1bit_0_15": ("1bit_0", 15), "1bit_0_16": ("1bit_0", 16),
              "1bit_0_100003": ("1bit_0", 100003), "1bit_0.5_1": ("1bit_0.5", 1),
              "1bit_0.5_15": ("1bit_0.5", 15), "1bit_0.5_16": ("1bit_0.5", 16),
              "1bit_0.5_100003": ("1bit_0.5", 100003)}

def pack_then_unpack_moves_every_element(dtype: str) -> None:
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


def scaling_rounds_like_numpy() -> None:
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
    for _ in range(steps):
        grad = rng.standard_normal(size).astype(np.float32)
        edge = [0.5, -0.5, 0.25, -0.25, np.float32(0.5) - np.float32(1e-7), 0, 1, -1]
        grad[:min(size, 8)] = edge[:min(size, 8)]
        before = dev_res.get()
        yield grad, before, codec.encode(grad, host_res), host_res, \
            twin.encode(cupy.asarray(grad), dev_res).get(), dev_res.get(), twin


def bit_codecs_match_numpy_byte_for_byte(name: str) -> None:
    label, size = BIT_CODECS[name]
    codec = CODECS[label]
    for grad, _, host_payload, host_res, dev_payload, dev_res, twin in _steps(codec, size):
        np.testing.assert_array_equal(dev_payload, host_payload)
        np.testing.assert_array_equal(dev_res, host_res)
        host_out, dev_out = np.ones(size, np.float32), cupy.ones(size, cupy.float32)
        codec.decode_add(host_payload, host_out)
        twin.decode_add(cupy.asarray(dev_payload), dev_out)
        np.testing.assert_array_equal(dev_out.get(), host_out)


def scaled_two_bit_keeps_what_it_does_not_send() -> None:
    codec = compression.ScaledTwoBit(1.0)
    for grad, old, _, _, dev_payload, dev_res, twin in _steps(codec, 50001):
        threshold = dev_payload[:4].view(np.float32)[0]
        np.testing.assert_allclose(threshold, np.abs(grad).mean(), rtol=1e-5)
        sent = cupy.zeros(grad.size, cupy.float32)
        twin.decode_add(cupy.asarray(dev_payload), sent)
        np.testing.assert_allclose(sent.get() + dev_res, old + grad, atol=1e-5)
        assert set(np.unique(sent.get())) <= {-threshold, 0, threshold}


def top_k_sends_the_same_entries_as_numpy() -> None:
    codec = compression.TopK(0.01)
    for _, _, host_payload, host_res, dev_payload, dev_res, twin in _steps(codec, 100003):
        host_out, dev_out = np.zeros(100003, np.float32), cupy.zeros(100003, cupy.float32)
        codec.decode_add(host_payload, host_out)
        twin.decode_add(cupy.asarray(dev_payload), dev_out)
        np.testing.assert_array_equal(dev_out.get(), host_out)
        np.testing.assert_array_equal(dev_res, host_res)


def a_cuda_capsule_gives_cupy_the_same_memory() -> None:
    """The hand-off mxnet/bridge.py makes: a bare ``dltensor`` capsule of device memory (here
    CuPy's own ``toDlpack``, the kind MXNet's ``to_dlpack_for_write`` gives) through
    dlpack.Capsule into ``cupy.from_dlpack``, without a copy."""
    producer = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    cupy.cuda.get_current_stream().synchronize()  # the producer's writes are done, as MXNet's
    x = cupy.from_dlpack(Capsule(producer.toDlpack(), (CUDA, producer.device.id)))
    assert x.data.ptr == producer.data.ptr and x.shape == (3, 4) and x.dtype == np.float32
    x *= 2  # a write through the consumer lands in the producer's memory
    np.testing.assert_array_equal(producer.get(), np.arange(12).reshape(3, 4) * 2)


run_cases({**{name: functools.partial(pack_then_unpack_moves_every_element, PACK[name])
              for name in PACK},
           "scaling_rounds_like_numpy": scaling_rounds_like_numpy,
           **{name: functools.partial(bit_codecs_match_numpy_byte_for_byte, name)
              for name in BIT_CODECS},
           "scaled_two_bit_keeps_what_it_does_not_send": scaled_two_bit_keeps_what_it_does_not_send,
           "top_k_sends_the_same_entries_as_numpy": top_k_sends_the_same_entries_as_numpy,
           "a_cuda_capsule_gives_cupy_the_same_memory": a_cuda_capsule_gives_cupy_the_same_memory},
          rank=0)
