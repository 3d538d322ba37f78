"""Gradient compression on the GPU: the codecs of compression.py as device kernels.

The device codecs write the NumPy codecs' wire format, so payloads decode on either side.
2-bit and 1-bit payloads and residuals equal the NumPy ones byte for byte (one kernel pass:
a thread packs one byte and updates its elements' residuals; decoding adds one element per
thread). Scaled 2-bit sums |g| in float64 on the device, so its 4-byte threshold can differ
from the NumPy one in the last bit. Top-k sends the same entries as NumPy, in another order,
selected with CuPy's argpartition (a full sort). ``Compression.fp16`` needs nothing here: it
casts CuPy arrays on the device already.
"""
import time
from importlib import resources
from typing import Dict, Hashable, Optional, Sequence, Tuple

import cupy
import cupyx
import numpy as np

from .. import compression
from ..compression import GatherCompressor
from ..collectives import ops as collective_ops
from ..collectives.feedback import decode_sum
from ..collectives.traffic import CommStats
from ..runtime.runtime import ProcessSet, global_process_set
from . import ops

_KERNELS = cupy.RawModule(code=resources.files(__package__).joinpath("compression.cu").read_text())
_THREADS = 256


def _launch(name: str, count: int, *args) -> None:
    """Run kernel ``name`` with a grid-stride loop over ``count`` items."""
    blocks = max(1, min((count + _THREADS - 1) // _THREADS, 65535))
    _KERNELS.get_function(name)((blocks,), (_THREADS,), args)


class DeviceTwoBit:
    """:class:`compression.TwoBit` on CuPy arrays (and :class:`compression.ScaledTwoBit`,
    whose 4-byte threshold header is computed on the device, without a host round trip)."""

    def __init__(self, codec: compression.TwoBit):
        self.codec = codec
        self.scaled = isinstance(codec, compression.ScaledTwoBit)
        self._thresholds: Dict[int, cupy.ndarray] = {}  # GPU id -> the threshold there

    def _threshold(self) -> cupy.ndarray:
        """The threshold as a device array on the current GPU, where the kernels read it."""
        gpu = cupy.cuda.Device().id
        if gpu not in self._thresholds:
            self._thresholds[gpu] = cupy.asarray(np.array([self.codec.threshold], np.float32))
        return self._thresholds[gpu]

    def wire_bytes(self, size: int) -> int:
        return self.codec.wire_bytes(size)

    def encode(self, grad: cupy.ndarray, residual: cupy.ndarray) -> cupy.ndarray:
        out = cupy.empty(self.wire_bytes(grad.size), np.uint8)
        threshold, codes = self._threshold(), out
        if self.scaled:
            # mean |g| in float64, times the threshold, rounded once to float32 (the header)
            threshold = out[:4].view(np.float32)
            mean = cupy.abs(grad).sum(dtype=np.float64) / max(grad.size, 1)
            threshold[...] = (mean * float(self.codec.threshold)).astype(np.float32)
            codes = out[4:]
        _launch("encode_2bit", codes.size, grad, residual, codes, np.int64(grad.size),
                np.int64(codes.size), threshold)
        return out

    def decode_add(self, payload: cupy.ndarray, out: cupy.ndarray) -> None:
        threshold, codes = self._threshold(), payload
        if self.scaled:
            threshold, codes = payload[:4].view(np.float32), payload[4:]
        _launch("decode_2bit_add", out.size, codes, threshold, out, np.int64(out.size))


class DeviceOneBit:
    """:class:`compression.OneBit` on CuPy arrays."""

    def __init__(self, codec: compression.OneBit):
        self.codec = codec

    def wire_bytes(self, size: int) -> int:
        return self.codec.wire_bytes(size)

    def encode(self, grad: cupy.ndarray, residual: cupy.ndarray) -> cupy.ndarray:
        out = cupy.empty(self.wire_bytes(grad.size), np.uint8)
        _launch("encode_1bit", out.size, grad, residual, out, np.int64(grad.size),
                np.int64(out.size), np.float32(self.codec.threshold))
        return out

    def decode_add(self, payload: cupy.ndarray, out: cupy.ndarray) -> None:
        _launch("decode_1bit_add", out.size, payload, out, np.int64(out.size))


class DeviceTopK:
    """:class:`compression.TopK` on CuPy arrays: (int32 index, float32 value) pairs."""

    def __init__(self, codec: compression.TopK):
        self.codec = codec

    def wire_bytes(self, size: int) -> int:
        return self.codec.wire_bytes(size)

    def encode(self, grad: cupy.ndarray, residual: cupy.ndarray) -> cupy.ndarray:
        k = self.codec.count(grad.size)
        residual += grad
        index = cupy.argpartition(cupy.abs(residual), grad.size - k)[grad.size - k:]
        out = cupy.empty(8 * k, np.uint8)
        out[:4 * k].view(np.int32)[...] = index.astype(np.int32)
        out[4 * k:].view(np.float32)[...] = residual[index]
        residual[index] = 0
        return out

    def decode_add(self, payload: cupy.ndarray, out: cupy.ndarray) -> None:
        k = payload.size // 8
        cupyx.scatter_add(out, payload[:4 * k].view(np.int32), payload[4 * k:].view(np.float32))


_DEVICE_CODECS = ((compression.TwoBit, DeviceTwoBit), (compression.OneBit, DeviceOneBit),
                  (compression.TopK, DeviceTopK))


def device_codec(codec: GatherCompressor):
    """The device twin of one of compression.py's codecs; TypeError for others."""
    for host_type, device_type in _DEVICE_CODECS:
        if isinstance(codec, host_type):
            return device_type(codec)
    raise TypeError(f"{type(codec).__name__} has no GPU kernels; GPU compression supports "
                    "TwoBit, ScaledTwoBit, OneBit, TopK and Compression.fp16")


class DeviceErrorFeedbackSum:
    """:class:`~hvd_trainer.collectives.feedback.ErrorFeedbackSum` with residuals, payloads and
    decoding on the GPU."""

    def __init__(self, codec: GatherCompressor):
        self.codec = device_codec(codec)
        self.residuals: Dict[Hashable, cupy.ndarray] = {}

    @ops.on_rank_device
    def sum_(self, named: Sequence[Tuple[Hashable, cupy.ndarray]], name: str, scale: float = 1.0,
             process_set: ProcessSet = global_process_set,
             stats: Optional[CommStats] = None) -> None:
        """Replace each (C-contiguous float32) tensor by the sum over ranks of what they sent,
        times ``scale``; one allgather carries every payload."""
        for key, t in named:
            if t.dtype != np.float32 or not t.flags.c_contiguous:
                raise ValueError(f"tensor {key!r} is {t.dtype} with strides {t.strides}; GPU "
                                 "compression takes C-contiguous float32 tensors")
            ops.DEVICE.check(t, f"tensor {key!r}")  # on this rank's GPU, where sum_ runs
        sizes = [self.codec.wire_bytes(t.size) for _, t in named]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        send = cupy.empty(int(offsets[-1]), np.uint8)
        tic = time.perf_counter()
        for (key, t), start, end in zip(named, offsets[:-1], offsets[1:]):
            residual = self.residuals.get(key)
            if residual is None:
                residual = self.residuals[key] = cupy.zeros(t.size, np.float32)
            send[start:end] = self.codec.encode(t.reshape(-1), residual)
        encoded = time.perf_counter()
        every = collective_ops.allgather(send, name, process_set).reshape(-1, send.size)
        gathered = time.perf_counter()
        decode_sum(self.codec, every, offsets, [t for _, t in named], scale)
        if stats is not None:
            stats.add_allgather(every.shape[0], send.size, sum(t.nbytes for _, t in named),
                                encoded - tic, time.perf_counter() - gathered)
