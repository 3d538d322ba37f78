"""Moving NDArray data to and from the NumPy buffers the core works on.

CPU NDArrays are exposed without a copy: ``MXNDArrayGetData`` gives the address of the
array's memory, which NumPy wraps as a view. MXNet is asynchronous, so a view is taken only
after the engine has finished the writes (for reading) or all pending accesses (for writing)
to that array. Arrays on a GPU reach CuPy through DLPack (:func:`to_cupy`), without a copy,
where CuPy can run; otherwise they are copied through host memory.
"""
import ctypes
import math
from typing import Any

import mxnet as mx
import numpy as np


def _data_pointer(array: mx.nd.NDArray) -> int:
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(array.handle, ctypes.byref(ptr)))
    return ptr.value or 0


def _view(array: mx.nd.NDArray) -> np.ndarray:
    dtype = np.dtype(array.dtype)
    nbytes = math.prod(array.shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(array.shape, dtype)
    raw = (ctypes.c_byte * nbytes).from_address(_data_pointer(array))
    raw._owner = array  # the view keeps the NDArray, and so its memory, alive
    return np.frombuffer(raw, dtype).reshape(array.shape)


def is_host(array: mx.nd.NDArray) -> bool:
    """Whether the NDArray lives in host memory, so it can be viewed without a copy."""
    return array.context.device_type in ("cpu", "cpu_pinned", "cpu_shared")


def to_cupy(array: mx.nd.NDArray) -> Any:
    """A writable ``cupy.ndarray`` view of a GPU NDArray, through DLPack, once MXNet's pending
    accesses to it have finished. Finish the device work on it before MXNet uses it again."""
    import cupy
    from ..collectives.dlpack import CUDA, Capsule
    return cupy.from_dlpack(Capsule(array.to_dlpack_for_write(), (CUDA, array.context.device_id)))


def on_cupy_gpus(arrays: "list[mx.nd.NDArray]") -> bool:
    """Whether every array is on a GPU and CuPy can run there, so they can skip host copies."""
    from ..runtime import runtime
    return bool(arrays) and all(a.context.device_type == "gpu" for a in arrays) \
        and runtime.cuda_built()


def check_dense(array: mx.nd.NDArray, arg: str) -> mx.nd.NDArray:
    """Reject anything but a dense NDArray, naming the argument."""
    if not isinstance(array, mx.nd.NDArray):
        raise TypeError(f"{arg} must be an mxnet NDArray, got {type(array).__name__}")
    if array.stype != "default":
        raise TypeError(f"{arg} has storage type {array.stype!r}; this collective takes dense "
                        "NDArrays (use .tostype('default'))")
    return array


def read_view(array: mx.nd.NDArray) -> np.ndarray:
    """A NumPy array with the NDArray's current values: a view on CPU, a copy on GPU.

    Do not write through it; use :func:`write_view` for that.
    """
    if not is_host(array):
        return array.asnumpy()
    array.wait_to_read()
    return _view(array)


def write_view(array: mx.nd.NDArray) -> np.ndarray:
    """A writable NumPy view of a host NDArray once every pending engine access has finished."""
    if not is_host(array):
        raise ValueError(f"write_view needs a host NDArray, got one on {array.context}")
    mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(array.handle))
    return _view(array)


def assign(array: mx.nd.NDArray, values: np.ndarray) -> None:
    """Copy ``values`` into ``array`` (same shape), directly on CPU, through the engine on GPU."""
    if is_host(array):
        write_view(array)[...] = values
    else:
        array[:] = values


def like(result: mx.nd.NDArray, template: mx.nd.NDArray) -> mx.nd.NDArray:
    """``result`` as an ``mx.np.ndarray`` (sharing its memory) when ``template`` is one, so
    numpy-mode code gets numpy-mode arrays back; ``result`` itself otherwise."""
    if isinstance(template, mx.np.ndarray) and not isinstance(result, mx.np.ndarray):
        return result.as_np_ndarray()
    return result


def to_ndarray(values: np.ndarray, ctx: mx.Context) -> mx.nd.NDArray:
    """An NDArray on ``ctx`` holding ``values``, which the caller must not reuse afterwards.

    On ``cpu(0)`` the NDArray adopts the NumPy memory (no copy); elsewhere it is one copy.
    """
    if ctx == mx.cpu(0) and values.size and values.flags.c_contiguous:
        try:
            return mx.nd.from_numpy(values, zero_copy=True)
        except ValueError:  # a dtype DLPack cannot describe (int8): copy instead
            pass
    return mx.nd.array(values, ctx=ctx, dtype=values.dtype)
