"""Horovod's tensor compressors for TensorFlow: ``Compression.none`` and ``Compression.fp16``.

A compressor turns a tensor into what travels (``compress``) and back (``decompress``). The
core's identity compressor serves any tensor; fp16 casts with ``tf.cast``, which gradients
flow through, so a compressed :func:`allreduce` stays differentiable. Given to
``DistributedGradientTape`` or ``DistributedOptimizer``, fp16 becomes the core's fp16
compressor, which the gradient reducer applies to NumPy arrays.
"""
from typing import Any, Tuple

import tensorflow as tf

from ..compression import Compressor, NoneCompressor
from ..collectives.powersgd import PowerSGD

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype; other
    tensors travel unchanged."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's namespace of compressors, and ``Compression.powersgd(rank=..., ...)`` (the
    core's :class:`~hvd_trainer.collectives.powersgd.PowerSGD`, applied by the gradient reducer)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    powersgd = PowerSGD
