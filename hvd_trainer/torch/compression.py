"""Horovod's tensor compressors for torch: ``Compression.none`` and ``Compression.fp16``.

A compressor turns a tensor into what travels (``compress``) and back (``decompress``). The
core's identity compressor serves any tensor; fp16 converts with torch's differentiable
``Tensor.to``, so gradients flow through a compressed :func:`allreduce`.
"""
from typing import Any, Tuple

import torch

from ..compression import Compressor, NoneCompressor


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
    """Horovod's namespace of compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
