"""A CPU stand-in for CuPy, for hvd_trainer's tests only (tests/gpu puts it first on the path of
the test processes it starts; it is never installed).

It implements the part of CuPy's API that hvd_trainer and its GPU tests call, over NumPy:
device memory, streams and events modelled so that ordering mistakes fail (cuda/stream.py),
the project's CUDA C kernels built for the host (_kernels.py), DLPack capsules of device
memory (_dlpack.py), and NCCL over MPI (cuda/nccl.py). Anything else raises AttributeError,
so code that needs more of CuPy shows it at once.
"""
from typing import Any, Optional, Sequence, Union

import numpy as np
from numpy import (bool_, complex64, complex128, float16, float32, float64, int8, int16,
                   int32, int64, uint8, uint16, uint32, uint64)

from . import cuda
from ._core import device_work, empty, ndarray
from ._dlpack import from_dlpack
from ._kernels import ElementwiseKernel, RawKernel, RawModule

__version__ = "0+standin"
__all__ = ["ElementwiseKernel", "RawKernel", "RawModule", "abs", "arange", "argpartition",
           "array", "asarray", "ascontiguousarray", "bool_", "complex64", "complex128",
           "copyto", "cuda", "empty", "empty_like", "float16", "float32", "float64",
           "from_dlpack", "int8", "int16", "int32", "int64", "ndarray", "ones", "uint8",
           "uint16", "uint32", "uint64", "zeros", "zeros_like"]

Shape = Union[int, Sequence[int]]


def _filled(shape: Shape, dtype: Any, value: Any) -> ndarray:
    out = empty(shape, dtype)
    out.fill(value)
    return out


def zeros(shape: Shape, dtype: Any = float) -> ndarray:
    return _filled(shape, dtype, 0)


def ones(shape: Shape, dtype: Any = float) -> ndarray:
    return _filled(shape, dtype, 1)


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def asarray(a: Any, dtype: Any = None, order: Optional[str] = None) -> ndarray:
    """``a`` if it is an array of this dtype (and C-contiguous, with ``order="C"``); else a
    copy on the current GPU (host data is copied in on the current stream)."""
    if isinstance(a, ndarray):
        if dtype is not None and np.dtype(dtype) != a.dtype:
            a = a.astype(dtype)
        return ascontiguousarray(a) if order == "C" else a
    host = np.asarray(a, dtype)
    out = empty(host.shape, host.dtype)
    out.set(host)
    return out


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> ndarray:
    if isinstance(obj, ndarray) and copy:
        return obj.astype(obj.dtype if dtype is None else dtype)
    return asarray(obj, dtype, "C" if order == "C" else None)


def ascontiguousarray(a: ndarray, dtype: Any = None) -> ndarray:
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return a.astype(a.dtype if dtype is None else dtype)


def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> ndarray:
    return asarray(np.arange(start, stop, step, dtype))


def abs(a: ndarray) -> ndarray:  # noqa: A001 - CuPy's name
    return a.__abs__()


def argpartition(a: ndarray, kth: int) -> ndarray:
    """Device work: NumPy's argpartition of a 1-D array (CuPy's sorts fully; any order of
    each side is a valid answer)."""
    out = empty(a.shape, np.int64)
    device_work(lambda: np.copyto(out._host(), np.argpartition(a._host(), kth)), out, a)
    return out


def copyto(dst: ndarray, src: ndarray) -> None:
    dst[...] = src

