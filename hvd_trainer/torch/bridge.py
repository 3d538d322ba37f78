"""Moving torch.Tensor data to and from the arrays the core works on, without copies.

**CPU tensors.** A CPU tensor's memory is viewed as a NumPy array (``Tensor.numpy()`` shares
it), so an in-place collective writes straight into the tensor and a result array becomes a
tensor that adopts its memory. NumPy has no bfloat16; ``ml_dtypes`` adds it, and a bfloat16
tensor is viewed through its 16-bit pattern, which both types share. ``ml_dtypes`` is imported
when the first bfloat16 tensor arrives, so users of the other dtypes need not install it.

**CUDA tensors.** A CUDA tensor becomes a CuPy array sharing its memory (``cupy.from_dlpack``),
which the core's collectives run on (``hvd_trainer.cuda``), and a CuPy result becomes a CUDA
tensor sharing its memory (``torch.from_dlpack``). CuPy is imported only when a CUDA tensor
arrives, so CPU users need not install it. Tensors must be on the rank's GPU (its local rank,
modulo the GPUs it sees, as the core decides). bfloat16 CUDA tensors are refused: CuPy has no
bfloat16, so the core could neither reduce nor scale them (a 16-bit integer view would only
serve the collectives that move bytes, and silently wrong sums are worse than an error).

**Streams.** The core orders its GPU work by CuPy's *current stream* on the thread that runs a
collective: its kernels and NCCL run there, between the work queued on it before the
collective and the work queued after it. The rule here: a
collective on CUDA tensors takes PyTorch's current stream on the tensors' device *when it is
called*, and that stream is both PyTorch's and CuPy's current stream on the communication
thread while the collective runs (:func:`ordered`). So the collective starts after all that
PyTorch had queued on that stream, and whatever PyTorch queues there after ``synchronize()``
runs after it; the host does not wait for the GPU (host-staged transfers aside). Work on other
streams is the caller's to order (``torch.cuda.Stream.wait_stream``), as for any PyTorch op.
"""
import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator, Optional

import numpy as np
import torch

from hvd_trainer_launch import installs

# The CUDA tensor dtypes CuPy has a type for.
_CUPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.float32,
                torch.float64, torch.complex64, torch.complex128}


def cupy_module(what: str) -> Any:
    """CuPy, imported now; a TypeError naming ``what`` and the install command without it."""
    try:
        import cupy
    except ImportError as error:
        raise TypeError(f"{what}: CUDA tensors go to the GPU collectives through CuPy, which "
                        f"cannot be imported here ({error}); {installs.CUPY.command}; or pass "
                        "tensor.cpu()") from None
    return cupy


def rank_device() -> int:
    """The index of the GPU this rank works on (the core's choice: local rank modulo the
    GPUs it sees)."""
    from ..cuda.ops import device
    return device()


def check_tensor(tensor: Any, arg: str, inplace: bool = False) -> torch.Tensor:
    """Reject what the core cannot take from this adapter, naming the argument and the fix."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{arg} has layout {tensor.layout}; this collective takes dense tensors "
                        "(use tensor.to_dense(), or sparse_allreduce_async for sparse COO "
                        "tensors)")
    if tensor.device.type == "cuda":
        check_gpu(tensor, arg)
    elif tensor.device.type != "cpu":
        raise TypeError(f"{arg} is on {tensor.device}; hvd_trainer.torch takes CPU and CUDA "
                        "tensors (pass tensor.cpu() and copy the result back)")
    if inplace and not tensor.is_contiguous():
        raise ValueError(f"{arg} must be contiguous for an in-place collective; pass "
                         "tensor.contiguous() or use the out-of-place function")
    return tensor


def check_gpu(tensor: torch.Tensor, arg: str) -> None:
    """Refuse a CUDA tensor the GPU collectives cannot take: no CuPy, a dtype CuPy lacks, or
    a GPU other than the rank's."""
    cupy_module(f"{arg} is on {tensor.device}")
    if tensor.dtype == torch.bfloat16:
        raise TypeError(f"{arg} is a bfloat16 CUDA tensor, which the GPU collectives do not "
                        "take (CuPy has no bfloat16); pass tensor.float() or tensor.half() "
                        "and cast the result back, or reduce it on the CPU")
    if tensor.dtype not in _CUPY_DTYPES:
        raise TypeError(f"{arg} has dtype {tensor.dtype}, which the GPU collectives do not "
                        "take (CuPy has no such type); cast it, e.g. tensor.float()")
    mine = rank_device()
    if tensor.device.index != mine:
        raise ValueError(f"{arg} is on {tensor.device}, but this rank works on cuda:{mine} "
                         f"(its local rank modulo the visible GPUs); move it with "
                         f"tensor.to('cuda:{mine}'), or call "
                         "torch.cuda.set_device(hvd.local_rank()) before making tensors")


def is_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes to the GPU collectives."""
    return tensor.device.type == "cuda"


def view(tensor: torch.Tensor) -> Any:
    """A NumPy array (CPU) or CuPy array (CUDA) sharing the tensor's memory, strides
    included; writes reach it."""
    data = tensor.detach()
    if data.device.type == "cuda":
        cupy = cupy_module(f"a tensor on {data.device}")
        with _cupy_current(cupy, torch.cuda.current_stream(data.device)):
            return cupy.from_dlpack(data)  # same stream on both sides: nothing to wait for
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(bfloat16())
    return data.numpy()


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 NumPy dtype, imported now; a TypeError naming the install command
    without it."""
    try:
        import ml_dtypes
    except ImportError as error:
        raise TypeError(f"a bfloat16 tensor reaches NumPy as ml_dtypes' bfloat16, and ml_dtypes "
                        f"cannot be imported here ({error}); pip install ml_dtypes, or pass "
                        "tensor.float()") from None
    return np.dtype(ml_dtypes.bfloat16)


def adopt(array: Any) -> torch.Tensor:
    """A tensor that takes over ``array``'s memory (the caller must not reuse the array):
    a CPU tensor for a NumPy array, a CUDA tensor for a CuPy one."""
    if isinstance(array, np.ndarray):
        if array.dtype.name == "bfloat16":  # ml_dtypes' (imported by whoever made it)
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def host_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array of the tensor's values for the host-only collectives: its own memory
    for a CPU tensor, a copy (after its stream's queued work) for a CUDA one."""
    return view(tensor.detach().cpu() if tensor.device.type == "cuda" else tensor)


def on_device(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host result as a tensor on ``like``'s device (adopted on the CPU, copied to a GPU)."""
    result = adopt(array)
    return result.to(like.device) if like.device.type == "cuda" else result


def write_back(array: np.ndarray, tensor: torch.Tensor) -> torch.Tensor:
    """Make ``tensor`` hold a host-only collective's in-place result ``array`` (which is the
    tensor's own memory on the CPU, a copy for a CUDA tensor); returns ``tensor``."""
    if tensor.device.type == "cuda":
        tensor.copy_(adopt(array))
    return tensor


def ordered(tensor: torch.Tensor,
            gpu_core: bool = True) -> Optional[Callable[[], ContextManager[None]]]:
    """For a CUDA tensor, a context in which a collective on it runs in order with PyTorch's
    current stream, taken now (see the module docstring); None for a CPU tensor. Without
    ``gpu_core`` (work that copies through host memory and never reaches CuPy) only PyTorch's
    stream is made current."""
    if tensor.device.type != "cuda":
        return None
    return functools.partial(on_stream, torch.cuda.current_stream(tensor.device), gpu_core)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream, gpu_core: bool = True) -> Iterator[None]:
    """``stream`` current in PyTorch and (with ``gpu_core``) in CuPy, on its device: the core's
    GPU work inside runs in order on it."""
    with torch.cuda.stream(stream):
        if not gpu_core:
            yield
            return
        cupy = cupy_module(f"a collective on cuda:{stream.device_index}")
        with _cupy_current(cupy, stream):
            yield


@contextlib.contextmanager
def _cupy_current(cupy: Any, stream: torch.cuda.Stream) -> Iterator[None]:
    """``stream``'s device and ``stream`` itself current in CuPy."""
    with cupy.cuda.Device(stream.device_index):
        if stream.cuda_stream == 0:  # the legacy default stream, which both call null
            current = cupy.cuda.Stream.null
        else:
            current = cupy.cuda.ExternalStream(stream.cuda_stream, stream.device_index)
        with current:
            yield
