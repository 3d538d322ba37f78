"""Gradient compressors: how a gradient is encoded before it travels and decoded after.

Two kinds, by transport:

- Horovod's :class:`Compressor` (``Compression.none``, ``Compression.fp16``): the payload is an
  array that can be summed where it is, so it rides the ring allreduce.
- :class:`GatherCompressor` (2-bit, 1-bit, top-k): packed payloads that cannot be summed.
  They travel by allgather with per-rank residuals (:mod:`hvd_trainer.collectives.feedback`).

PowerSGD (``Compression.powersgd(rank=...)``, :mod:`hvd_trainer.collectives.powersgd`) is neither: its
low-rank factors are summed by allreduce.

:func:`from_params` maps MXNet's ``compression_params`` onto one of these. Tensors may be NumPy
arrays or, for :class:`Compressor`, anything with ``dtype`` and ``astype`` (NDArrays), so
Horovod scripts that call ``Compression.fp16.compress`` themselves keep working.
"""
import abc
import functools
import math
import numbers
from typing import Any, Dict, Optional, Tuple, Type, Union

import numpy as np

from .collectives.powersgd import PowerSGD

__all__ = ["Compression", "Compressor", "FP16Compressor", "GatherCompressor", "NoneCompressor",
           "OneBit", "ScaledTwoBit", "TopK", "TwoBit", "from_params"]

# Encoders work through long tensors in chunks of this many elements (512 KiB of float32),
# so that each vectorised pass runs in the L2 cache instead of main memory.
_CHUNK = 1 << 17
_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")
# 2-bit packing: multiplying a word of 4 one-byte codes (each 0-3) by _GATHER puts
# c0·64 + c1·16 + c2·4 + c3 in its top byte; _PLUS and _MINUS also weigh the codes 3 and 2
# (modulo 2**32, as uint32 products wrap).
_GATHER = 64 << 24 | 16 << 16 | 4 << 8 | 1
_PLUS, _MINUS = np.uint32(3 * _GATHER % 2**32), np.uint32(2 * _GATHER % 2**32)


class Compressor:
    """Identity compression; subclasses change ``compress`` and ``decompress``."""

    @staticmethod
    def compress(tensor: np.ndarray) -> Tuple[np.ndarray, Any]:
        """Return the payload to send and what ``decompress`` needs to undo it."""
        return tensor, None

    @staticmethod
    def decompress(payload: np.ndarray, ctx: Any) -> np.ndarray:
        """Turn a (reduced) payload back into a tensor of the original dtype."""
        return payload


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16, halving float32 traffic; others unchanged."""

    @staticmethod
    def compress(tensor: np.ndarray) -> Tuple[np.ndarray, Any]:
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f" and dtype != np.float16:
            return tensor.astype(np.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(payload: np.ndarray, ctx: Any) -> np.ndarray:
        return payload if ctx is None else payload.astype(ctx)


class Compression:
    """Horovod's namespace of compressors: ``Compression.none`` and ``Compression.fp16``, and
    ``Compression.powersgd(rank=..., ...)`` (see :class:`hvd_trainer.collectives.powersgd.PowerSGD`)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    powersgd = PowerSGD


class GatherCompressor(abc.ABC):
    """A compressor with error feedback whose payloads travel by allgather; subclass to add one.

    A subclass implements three methods on flat float32 arrays:

    - ``encode(grad, residual)``: add ``grad`` into ``residual`` (this rank's error-feedback
      state for the tensor, same size, starts at zero), return the payload as a 1-D ``uint8``
      array of exactly ``wire_bytes(grad.size)`` bytes, and subtract from ``residual`` what the
      payload carries, so that decoded payloads plus the residual always sum to the inputs.
    - ``decode_add(payload, out)``: add the values the payload carries to ``out``.
    - ``wire_bytes(size)``: the payload's length for a tensor of ``size`` elements.

    Only float32 tensors of at least ``min_size`` elements are compressed; the others (integer,
    float16/64, biases and other tiny tensors, whose payload would save next to nothing) are
    summed uncompressed. Pass an instance as ``DistributedTrainer(compression=...)``.
    """

    min_size = 1024

    @abc.abstractmethod
    def encode(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """The payload for ``grad``; updates ``residual`` (error feedback) in place."""

    @abc.abstractmethod
    def decode_add(self, payload: np.ndarray, out: np.ndarray) -> None:
        """Add the values ``payload`` carries to ``out``."""

    @abc.abstractmethod
    def wire_bytes(self, size: int) -> int:
        """Payload length in bytes for a tensor of ``size`` elements."""

    def decode_two(self, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
        """Make ``out`` the values ``first`` carries plus those ``second`` carries, as
        ``decode_add`` of each into zeros, in that order, gives them (every rank decodes the
        first two ranks' payloads so); a subclass may do it in one pass."""
        out[...] = 0
        self.decode_add(first, out)
        self.decode_add(second, out)

    def accepts(self, tensor: np.ndarray) -> bool:
        """Whether ``tensor`` is compressed (float32, ``min_size`` elements or more)."""
        return tensor.dtype == np.float32 and tensor.size >= self.min_size


# -- 2-bit ----------------------------------------------------------------------------------
def _two_bit_table(threshold: np.float32) -> np.ndarray:
    """Decoded values of each byte: 4 codes, the first in the top two bits; 11 → +t, 10 → −t."""
    codes = (np.arange(256)[:, None] >> np.array([6, 4, 2, 0])) & 3
    return np.select([codes == 3, codes == 2], [threshold, -threshold], 0).astype(np.float32)


def _encode_2bit(grad: np.ndarray, residual: np.ndarray, threshold: np.float32,
                 out: np.ndarray) -> None:
    """MXNet's quantize_2bit, vectorised: residual += grad; ≥ t emits +t, ≤ −t emits −t."""
    pos, neg = np.zeros(_CHUNK, bool), np.zeros(_CHUNK, bool)
    sign, step = np.empty(_CHUNK, np.int8), np.empty(_CHUNK, np.float32)
    codes, part = np.empty(_CHUNK // 4, _U32), np.empty(_CHUNK // 4, _U32)
    for start in range(0, grad.size, _CHUNK):
        r = residual[start:start + _CHUNK]
        n = r.size
        r += grad[start:start + n]
        np.greater_equal(r, threshold, out=pos[:n])
        np.less_equal(r, -threshold, out=neg[:n])
        if n < _CHUNK:  # the tail packs as zero codes
            pos[n:], neg[n:] = False, False
        np.subtract(pos[:n].view(np.int8), neg[:n].view(np.int8), out=sign[:n])
        np.multiply(sign[:n], threshold, out=step[:n])
        r -= step[:n]
        # Each uint32 holds the booleans of 4 elements, one per byte (b0..b3, little-endian).
        # Byte k of the payload is element 4k's code in bits 7-6, then 4k+1, 4k+2, 4k+3
        # (MXNet's order), with code 3 for +t, 2 for −t: c0·64 + c1·16 + c2·4 + c3, which is
        # the top byte of the word times _GATHER (no byte of the product carries into the
        # next), so the codes are 3·pos·_GATHER + 2·neg·_GATHER, shifted right by 24.
        words = (n + 3) // 4
        np.multiply(pos.view(_U32)[:words], _PLUS, out=codes[:words])
        np.multiply(neg.view(_U32)[:words], _MINUS, out=part[:words])
        codes[:words] += part[:words]
        np.right_shift(codes[:words], 24, out=codes[:words])
        np.copyto(out[start // 4:start // 4 + words], codes[:words], casting="unsafe")


def _decode_2bit_pair(first: np.ndarray, second: np.ndarray, pairs: np.ndarray,
                      out: np.ndarray) -> None:
    """``out`` = 0 + ``first``'s values + ``second``'s: one lookup per 4 elements in
    ``pairs`` (:func:`_two_bit_pairs`), indexed by the two payloads' bytes."""
    index = np.empty((min(out.size, _CHUNK) + 3) // 4, np.uint16)
    for start in range(0, out.size, _CHUNK):
        o = out[start:start + _CHUNK]
        words = (o.size + 3) // 4
        np.left_shift(first[start // 4:start // 4 + words], 8, out=index[:words],
                      dtype=np.uint16)
        index[:words] |= second[start // 4:start // 4 + words]
        o[...] = np.take(pairs, index[:words]).view(np.float32)[:o.size]


@functools.lru_cache(maxsize=8)
def _two_bit_pairs(threshold: np.float32) -> np.ndarray:
    """For each pair of payload bytes (first << 8 | second), the 4 sums 0 + a + b that two
    :func:`_decode_2bit_add` calls from zero give, in float32 as they round them; 1 MiB,
    16 bytes a row, viewed as one complex128 so that ``np.take`` moves a row as one item. Kept per
    threshold here, not on the codec, whose attributes are its settings (``vars`` of a codec
    keys its checkpointed state)."""
    table = _two_bit_table(threshold)
    sums = np.zeros((256, 256, 4), np.float32) + table[:, None, :] + table[None, :, :]
    return sums.reshape(-1).view(np.complex128)


def _decode_2bit_add(payload: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    for start in range(0, out.size, _CHUNK):
        o = out[start:start + _CHUNK]
        o += np.take(table, payload[start // 4:start // 4 + (o.size + 3) // 4],
                     axis=0).reshape(-1)[:o.size]


class TwoBit(GatherCompressor):
    """MXNet's 2-bit compression with error feedback, bit-compatible with its KVStore.

    The residual accumulates the gradient; a residual ≥ t emits +t and one ≤ −t emits −t, each
    subtracted from the residual; anything else emits 0. 16 values per 32 bits (codes 11, 10,
    00 in MXNet's layout). A NaN compares false, as in MXNet: it emits 0 and stays in the
    residual, so that element sends 0 from then on.
    """

    def __init__(self, threshold: float = 0.5):
        self.threshold = np.float32(threshold)
        self._table = _two_bit_table(self.threshold)

    def encode(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        out = np.empty(self.wire_bytes(grad.size), np.uint8)
        out[grad.size // 4:] = 0
        _encode_2bit(grad, residual, self.threshold, out)
        return out

    def decode_add(self, payload: np.ndarray, out: np.ndarray) -> None:
        _decode_2bit_add(payload, self._table, out)

    def decode_two(self, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
        """As two ``decode_add`` calls into zeros, bit for bit, in one lookup per payload byte
        in a table of every pair of bytes (built at the first call for each threshold)."""
        _decode_2bit_pair(first, second, _two_bit_pairs(self.threshold), out)

    def wire_bytes(self, size: int) -> int:
        return 4 * math.ceil(size / 16)


class ScaledTwoBit(TwoBit):
    """2-bit compression whose threshold is ``threshold`` × the tensor's mean |gradient|.

    Each rank sets its threshold per tensor and step from the gradient it is about to send, and
    sends it (4 bytes) with the codes, so the threshold follows the gradients' scale and needs
    no tuning: ``threshold`` is in units of mean |g| (default 1).
    """

    def __init__(self, threshold: float = 1.0):
        super().__init__(threshold)

    def encode(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        magnitude = np.empty(min(grad.size, _CHUNK), np.float32)
        total = sum(float(np.abs(grad[s:s + _CHUNK], out=magnitude[:grad[s:s + _CHUNK].size])
                          .sum()) for s in range(0, grad.size, _CHUNK))
        # In float64, rounded once to float32 (NumPy 2 would keep np.float32 * float in float32).
        scale = np.float32(float(self.threshold) * total / max(grad.size, 1))
        out = np.empty(self.wire_bytes(grad.size), np.uint8)
        out[:4] = np.frombuffer(scale.astype(_F32).tobytes(), np.uint8)
        codes = out[4:]
        codes[grad.size // 4:] = 0
        _encode_2bit(grad, residual, scale, codes)
        return out

    def decode_add(self, payload: np.ndarray, out: np.ndarray) -> None:
        scale = payload[:4].view(_F32)[0]
        _decode_2bit_add(payload[4:], _two_bit_table(scale), out)

    # Each payload has a scale of its own: no table of byte pairs.
    decode_two = GatherCompressor.decode_two

    def wire_bytes(self, size: int) -> int:
        return 4 + super().wire_bytes(size)


# -- 1-bit ----------------------------------------------------------------------------------
class OneBit(GatherCompressor):
    """MXNet 1.x's 1-bit compression (gradient_compression-inl.h, quantize_1bit).

    The residual accumulates the gradient; a residual > ``threshold`` emits +1 and subtracts 1,
    anything else emits −1 and adds 1. The threshold only decides the sign (any number, 0 means
    the residual's sign); the values sent are ±1 whatever the threshold, so gradients should be
    of order 1 or the learning rate scaled to match. 32 values per 32 bits, first value in the
    top bit. A NaN compares false: it emits −1 and stays in the residual.
    """

    def __init__(self, threshold: float = 0.5):
        self.threshold = np.float32(threshold)
        bits = (np.arange(256)[:, None] >> np.arange(7, -1, -1)) & 1
        self._table = np.where(bits == 1, 1.0, -1.0).astype(np.float32)

    def encode(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        out = np.zeros(self.wire_bytes(grad.size), np.uint8)
        above = np.empty(_CHUNK, bool)
        step = np.empty(_CHUNK, np.float32)
        for start in range(0, grad.size, _CHUNK):
            r = residual[start:start + _CHUNK]
            n = r.size
            r += grad[start:start + n]
            np.greater(r, self.threshold, out=above[:n])
            np.multiply(above[:n], np.float32(2), out=step[:n])
            step[:n] -= 1
            r -= step[:n]
            packed = np.packbits(above[:n])
            out[start // 8:start // 8 + packed.size] = packed
        return out

    def decode_add(self, payload: np.ndarray, out: np.ndarray) -> None:
        for start in range(0, out.size, _CHUNK):
            o = out[start:start + _CHUNK]
            o += np.take(self._table, payload[start // 8:start // 8 + (o.size + 7) // 8],
                         axis=0).reshape(-1)[:o.size]

    def wire_bytes(self, size: int) -> int:
        return 4 * math.ceil(size / 32)


# -- top-k ----------------------------------------------------------------------------------
class TopK(GatherCompressor):
    """Top-k sparsification with error feedback: send the ``ratio`` largest |residual| entries.

    The residual accumulates the gradient; the ceil(ratio × size) entries of largest magnitude
    are sent as (int32 index, float32 value) pairs and zeroed in the residual. A NaN counts as
    larger than any number, so it is sent and reaches the weights, as it would uncompressed.
    """

    # Above this size, candidates are preselected by a threshold estimated from a sample.
    _SAMPLED = 1 << 16

    def __init__(self, ratio: float):
        self.ratio = float(ratio)

    def count(self, size: int) -> int:
        """Entries sent for a tensor of ``size`` elements."""
        return min(size, max(1, math.ceil(self.ratio * size)))

    def encode(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        k = self.count(grad.size)
        index = None
        if grad.size > self._SAMPLED and 2 * k < grad.size:
            index = self._preselected(grad, residual, k)
        else:
            for start in range(0, grad.size, _CHUNK):
                r = residual[start:start + _CHUNK]
                r += grad[start:start + r.size]
        if index is None:
            index = np.argpartition(np.abs(residual), grad.size - k)[grad.size - k:]
        out = np.empty(8 * k, np.uint8)
        out[:4 * k].view(_I32)[:] = index
        out[4 * k:].view(_F32)[:] = residual[index]
        residual[index] = 0
        return out

    def _preselected(self, grad: np.ndarray, residual: np.ndarray, k: int
                     ) -> Optional[np.ndarray]:
        """Add ``grad`` into ``residual`` and return the indices of its ``k`` entries of
        largest magnitude, or None when the preselection found fewer than ``k``.

        The candidates are the entries not below a sample's quantile at twice the wanted
        fraction: about 2k, and when there are k or more, the exact top k is among them. The
        sample is taken first (|residual + grad| at a stride, the values the update gives),
        so one pass of cache-sized chunks adds, measures and preselects.
        """
        stride = grad.size // self._SAMPLED
        sample = np.abs(residual[::stride] + grad[::stride])
        q = int(sample.size * (1 - 2 * k / grad.size))
        cut = np.partition(sample, q)[q]
        magnitude = np.empty(min(grad.size, _CHUNK), np.float32)
        kept = np.empty(magnitude.size, bool)
        found = []
        for start in range(0, grad.size, _CHUNK):
            r = residual[start:start + _CHUNK]
            n = r.size
            r += grad[start:start + n]
            np.abs(r, out=magnitude[:n])
            np.less(magnitude[:n], cut, out=kept[:n])
            np.logical_not(kept[:n], out=kept[:n])  # a NaN is never below: it is kept
            hit = np.flatnonzero(kept[:n])
            if hit.size:
                found.append(hit + start)
        candidates = np.concatenate(found) if found else np.empty(0, np.intp)
        if candidates.size < k:
            return None
        pick = np.argpartition(np.abs(residual[candidates]), candidates.size - k)
        return candidates[pick[candidates.size - k:]]

    def decode_add(self, payload: np.ndarray, out: np.ndarray) -> None:
        k = payload.size // 8
        out[payload[:4 * k].view(_I32)] += payload[4 * k:].view(_F32)

    def wire_bytes(self, size: int) -> int:
        return 8 * self.count(size)


# What ``compression=`` takes: Horovod's compressors, the packed codecs, PowerSGD's settings.
AnyCompressor = Union[Type[Compressor], GatherCompressor, PowerSGD]


# -- compression_params ---------------------------------------------------------------------
_TYPES = {"fp16": (None, {}), "2bit": (TwoBit, {"threshold": 0.5}),
          "1bit": (OneBit, {"threshold": 0.5}), "topk": (TopK, {"ratio": None}),
          "scaled_2bit": (ScaledTwoBit, {"threshold": 1.0}),
          "powersgd": (PowerSGD, {"rank": 1, "start_iter": 1000, "min_compression_rate": 2.0,
                                  "use_error_feedback": True, "warm_start": True, "seed": 0})}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{what}={value!r} must be a finite number")
    return float(value)


def from_params(params: Dict[str, Any]) -> AnyCompressor:
    """The compressor for MXNet-style ``compression_params``, with every option checked.

    Types: ``fp16``; ``2bit`` and ``1bit`` (``threshold``, default 0.5 as in MXNet);
    ``scaled_2bit`` (``threshold`` in units of the tensor's mean |g|, default 1); ``topk``
    (``ratio`` in (0, 1], required). Every type but fp16 and powersgd also takes ``min_size``.
    ``powersgd`` takes :class:`~hvd_trainer.collectives.powersgd.PowerSGD`'s keyword arguments.
    """
    valid = ", ".join(repr(t) for t in _TYPES)
    if not isinstance(params, dict) or "type" not in params:
        raise ValueError(f"compression_params={params!r} must be a dict with a 'type' key, "
                         f"e.g. {{'type': '2bit', 'threshold': 0.5}}; types: {valid}")
    kind = params["type"]
    if kind not in _TYPES:
        raise ValueError(f"compression_params type {kind!r} is unknown; valid types: {valid}")
    cls, defaults = _TYPES[kind]
    allowed = set(defaults) | ({"min_size"} if cls not in (None, PowerSGD) else set())
    unknown = sorted(set(params) - allowed - {"type"})
    if unknown:
        raise ValueError(f"compression_params for {kind!r} got unknown keys {unknown}; it "
                         f"takes {sorted(allowed) or 'no options'}")
    if cls is None:
        return Compression.fp16
    if cls is PowerSGD:
        return PowerSGD(**{key: params.get(key, default) for key, default in defaults.items()})
    options = {key: params.get(key, default) for key, default in defaults.items()}
    if "ratio" in options:
        if options["ratio"] is None:
            raise ValueError("compression_params for 'topk' needs 'ratio', the fraction of "
                             "entries sent, e.g. {'type': 'topk', 'ratio': 0.01}")
        ratio = _number(options["ratio"], "ratio")
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio={ratio!r} must be in (0, 1]: the fraction of each "
                             "tensor's entries sent per step")
    if "threshold" in options:
        threshold = _number(options["threshold"], "threshold")
        if kind != "1bit" and threshold <= 0:
            raise ValueError(f"threshold={threshold!r} must be positive for {kind!r}: a "
                             "residual reaching ±threshold is sent")
    compressor = cls(**options)
    if "min_size" in params:
        min_size = params["min_size"]
        if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral) \
                or min_size < 0:
            raise ValueError(f"min_size={min_size!r} must be a non-negative integer: tensors "
                             "with fewer elements are sent uncompressed")
        compressor.min_size = int(min_size)
    return compressor
