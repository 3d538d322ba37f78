"""Horovod's tensor compressors for torch: ``Compression.none`` and ``Compression.fp16``.

A compressor turns a tensor into what travels (``compress``) and back (``decompress``). The
core's identity compressor serves any tensor; fp16 converts with torch's differentiable
``Tensor.to``, so gradients flow through a compressed :func:`allreduce`.

:data:`KERNELS` are torch's vectorised casts and 16-bit sums, which this adapter hands down
to the core for fp16 compression and the ring's float16 and bfloat16 sums.
"""
from typing import Any, Tuple

import numpy as np
import torch

from ..backends import halves
from ..compression import Compressor, NoneCompressor
from ..collectives.powersgd import PowerSGD
from . import bridge

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Kernels(halves.Kernels):
    """torch's CPU kernels (vectorised, each 16-bit sum computed in float32 and rounded once),
    run on tensors sharing the arrays' memory; read-only arrays, which torch cannot share,
    take NumPy's."""

    def narrow(self, src: np.ndarray, dst: np.ndarray) -> None:
        if not src.flags.writeable:
            return super().narrow(src, dst)
        bridge.adopt(dst).copy_(bridge.adopt(src))

    def widen(self, src: np.ndarray, dst: np.ndarray) -> None:
        if not src.flags.writeable:
            return super().widen(src, dst)
        bridge.adopt(dst).copy_(bridge.adopt(src))

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        if not (a.flags.writeable and b.flags.writeable):
            return super().add(a, b, out)
        torch.add(bridge.adopt(a), bridge.adopt(b), out=bridge.adopt(out))


KERNELS = Kernels()


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (float32 sums at each step of the ring) and
    come back in their own dtype; other tensors travel unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's namespace of compressors, and ``Compression.powersgd(rank=..., ...)`` (the
    core's :class:`~hvd_trainer.collectives.powersgd.PowerSGD`, applied by the gradient reducer)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    powersgd = PowerSGD
