"""Moving torch.Tensor data to and from the NumPy arrays the core works on, without copies.

A CPU tensor's memory is viewed as a NumPy array (``Tensor.numpy()`` shares it), so an
in-place collective writes straight into the tensor and a result array becomes a tensor that
adopts its memory. NumPy has no bfloat16; ``ml_dtypes`` adds it, and a bfloat16 tensor is
viewed through its 16-bit pattern, which both types share. Tensors on other devices are
refused: the adapter does not yet hand CUDA tensors to the core's GPU path.
"""
from typing import Any

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def check_tensor(tensor: Any, arg: str, inplace: bool = False) -> torch.Tensor:
    """Reject what the core cannot take from this adapter, naming the argument and the fix."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{arg} has layout {tensor.layout}; this collective takes dense tensors "
                        "(use tensor.to_dense(), or sparse_allreduce_async for sparse COO "
                        "tensors)")
    if tensor.device.type != "cpu":
        raise TypeError(f"{arg} is on {tensor.device}; hvd_trainer.torch takes CPU tensors only "
                        "(pass tensor.cpu() and copy the result back)")
    if inplace and not tensor.is_contiguous():
        raise ValueError(f"{arg} must be contiguous for an in-place collective; pass "
                         "tensor.contiguous() or use the out-of-place function")
    return tensor


def view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing the CPU tensor's memory (strides included); writes reach it."""
    data = tensor.detach()
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(BFLOAT16)
    return data.numpy()


def adopt(array: np.ndarray) -> torch.Tensor:
    """A tensor that takes over ``array``'s memory (the caller must not reuse the array)."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
