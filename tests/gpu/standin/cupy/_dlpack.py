"""DLPack of the stand-in: ``dltensor`` capsules of device memory, made and consumed as a GPU
framework makes and consumes them (PyTorch's ``to_dlpack``, TensorFlow's, MXNet's).

A capsule this module makes says kDLCUDA and points into the stand-in's device memory; one it
consumes must say kDLCUDA (or CUDA-managed) and point into a live allocation on that GPU, so
a host copy handed over as device memory is refused instead of read. Consuming renames the
capsule ``used_dltensor`` (it can be consumed once) and calls its deleter when the array that
took it over is gone. A capsule that is never consumed keeps its memory (it has no destructor).
"""
import ctypes
import weakref
from typing import Any, Dict

import numpy as np

from ._core import ndarray
from .cuda.device import check
from .cuda.memory import find

__all__ = ["from_dlpack", "to_capsule"]

CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                     ("deleter", _Deleter)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype, _api.PyCapsule_New.argtypes = \
    ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype, _api.PyCapsule_IsValid.argtypes = \
    ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype, _api.PyCapsule_GetPointer.argtypes = \
    ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype, _api.PyCapsule_SetName.argtypes = \
    ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]

_exported: Dict[int, Any] = {}  # manager_ctx -> what the capsule's tensor needs alive


@_Deleter
def _delete(managed: Any) -> None:
    _exported.pop(managed.contents.manager_ctx, None)


def to_capsule(array: ndarray) -> Any:
    """A ``dltensor`` capsule of ``array``'s device memory (kDLCUDA on its GPU)."""
    if array.dtype.kind not in _CODES:
        raise TypeError(f"DLPack has no type for {array.dtype}")
    shape = (ctypes.c_int64 * array.ndim)(*array.shape)
    strides = (ctypes.c_int64 * array.ndim)(*[s // array.itemsize for s in array.strides])
    managed = _Managed()
    managed.dl_tensor = _Tensor(array.data.ptr, _Device(CUDA, array.device.id), array.ndim,
                                _DataType(_CODES[array.dtype.kind], array.itemsize * 8, 1),
                                shape, strides, 0)
    key = id(managed)
    managed.manager_ctx, managed.deleter = key, _delete
    _exported[key] = (managed, shape, strides, array)
    return _api.PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)


def from_dlpack(obj: Any) -> ndarray:
    """An array taking over the device memory of ``obj`` (anything with ``__dlpack__``)."""
    capsule = obj.__dlpack__() if hasattr(obj, "__dlpack__") else obj
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise ValueError("not a dltensor capsule, or one that was consumed already")
    managed = _Managed.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor"))
    tensor = managed.dl_tensor
    if tensor.device.device_type not in (CUDA, CUDA_MANAGED):
        raise ValueError(f"the DLPack tensor is on device type {tensor.device.device_type}, "
                         "not a GPU (kDLCUDA): CuPy takes device memory only")
    kinds = {code: kind for kind, code in _CODES.items()}
    dtype = np.dtype(f"{kinds[tensor.dtype.code]}{tensor.dtype.bits // 8}"
                     if tensor.dtype.code != 6 else "bool")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = None if not tensor.strides else \
        tuple(tensor.strides[i] * dtype.itemsize for i in range(tensor.ndim))
    ptr = (tensor.data or 0) + tensor.byte_offset
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = find(ptr, nbytes)
    check(tensor.device.device_id)
    if found is None or found[0].device_id != tensor.device.device_id:
        raise ValueError(f"the DLPack tensor's memory ({ptr:#x}, {nbytes} bytes) is no "
                         f"allocation of the stand-in on GPU {tensor.device.device_id}: "
                         "host memory, or another GPU's, handed over as device memory")
    _api.PyCapsule_SetName(capsule, b"used_dltensor")
    array = ndarray._over(found[0], found[1], shape, dtype, strides)
    deleter = managed.deleter
    weakref.finalize(array, deleter, ctypes.pointer(managed))
    return array
