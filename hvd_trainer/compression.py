"""Gradient compressors: how a tensor is encoded before it travels and decoded after.

A compressor turns a tensor into a payload plus a context, and the payload plus context back
into a tensor. Tensors may be NumPy arrays or anything with ``dtype`` and ``astype`` (NDArrays),
so Horovod scripts that call ``Compression.fp16.compress`` themselves keep working. Payloads that can be summed where they are (fp16) ride the ring allreduce.
"""
from typing import Any, Tuple

import numpy as np


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
    """Horovod's namespace of compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
