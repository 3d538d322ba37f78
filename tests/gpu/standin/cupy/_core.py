"""``cupy.ndarray`` of the stand-in: an array in device memory whose every operation is device
work queued on the current stream (see cuda/stream.py), computed by NumPy when it runs.

Metadata (shape, strides, views, slices) is the host's, at once, as in CuPy; values are the
device's: reading them on the host (``get``, ``item``, ``float(x)``) waits for the current
stream alone, and NumPy's implicit conversion is refused, as CuPy refuses it.
"""
import math
import numbers
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np

from .cuda.device import Device, current_id
from .cuda.memory import Memory, MemoryPointer, is_pinned
from .cuda.stream import Stream, current_ptr, enqueue, get_current_stream

__all__ = ["device_work", "empty", "ndarray", "shape_of"]

Shape = Tuple[int, ...]
_DEVICES: "dict[int, Device]" = {}  # one Device object per GPU, as ndarray.device gives


def shape_of(shape: Union[int, Sequence[int]]) -> Shape:
    """``shape`` as a tuple of ints."""
    return (int(shape),) if isinstance(shape, numbers.Integral) else tuple(int(s) for s in shape)


def _contiguous(shape: Shape, strides: Shape, itemsize: int) -> bool:
    """Whether ``shape`` and ``strides`` lay the items out back to back, last axis fastest
    (NumPy's rule: axes of one item, and empty arrays, impose nothing)."""
    if 0 in shape:
        return True
    step = itemsize
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n != 1 and stride != step:
            return False
        step *= n
    return True


def _c_strides(shape: Shape, itemsize: int) -> Shape:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def device_work(fn: Callable[[], None], *arrays: "ndarray",
                stream: Optional[Stream] = None) -> None:
    """Queue ``fn`` on ``stream`` (default: current); every array must be on the current GPU,
    as CuPy requires of its kernels' arrays."""
    here = current_id()
    for a in arrays:
        if a._mem.device_id != here:
            raise ValueError(f"Array device must be same as the current device: array device = "
                             f"{a._mem.device_id} while current = {here}")
    enqueue(fn, stream)


def _operator(ufunc: np.ufunc, inplace: bool = False,
              swap: bool = False) -> Callable[["ndarray", Any], "ndarray"]:
    """An arithmetic operator of ndarray: ``ufunc`` as device work (see ndarray._ufunc)."""
    def operator(self: "ndarray", other: Any) -> "ndarray":
        return self._ufunc(ufunc, other, inplace, swap)
    return operator


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous")

    def __init__(self, c: bool, f: bool):
        self.c_contiguous, self.f_contiguous = c, f


class ndarray:
    """An array in the stand-in's device memory."""

    __slots__ = ("_mem", "_offset", "shape", "dtype", "strides", "size", "_flags",
                 "__weakref__")

    def __init__(self, shape: Union[int, Sequence[int]], dtype: Any = float):
        shape, dtype = shape_of(shape), np.dtype(dtype)
        device = current_id()
        self._set(Memory(math.prod(shape) * dtype.itemsize, device, current_ptr(device)), 0,
                  shape, dtype, _c_strides(shape, dtype.itemsize))

    def _set(self, mem: Memory, offset: int, shape: Shape, dtype: np.dtype,
             strides: Shape) -> "ndarray":
        self._mem, self._offset, self.shape, self.dtype, self.strides = \
            mem, offset, shape, dtype, strides
        self.size = math.prod(shape)
        self._flags = None
        return self

    @classmethod
    def _over(cls, mem: Memory, offset: int, shape: Shape, dtype: np.dtype,
              strides: Optional[Shape] = None) -> "ndarray":
        """An array over existing memory (a view)."""
        return cls.__new__(cls)._set(mem, offset, shape, dtype,
                                     _c_strides(shape, dtype.itemsize) if strides is None
                                     else strides)

    # -- metadata ------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._mem, self._offset)

    @property
    def device(self) -> Device:
        return _DEVICES.get(self._mem.device_id) or _DEVICES.setdefault(
            self._mem.device_id, Device(self._mem.device_id))

    @property
    def flags(self) -> _Flags:
        if self._flags is None:
            itemsize = self.dtype.itemsize
            self._flags = _Flags(_contiguous(self.shape, self.strides, itemsize),
                                 _contiguous(self.shape[::-1], self.strides[::-1], itemsize))
        return self._flags

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def _host(self) -> np.ndarray:
        """The NumPy view of this array's memory: for device work and metadata only."""
        return np.ndarray(self.shape, self.dtype, buffer=self._mem.block.buffer,
                          offset=self._offset, strides=self.strides)

    def _derived(self, view: np.ndarray) -> Optional["ndarray"]:
        """``view`` (NumPy's view of our memory) as an array, or None if NumPy copied."""
        start = view.__array_interface__["data"][0]
        mem = self._mem
        if view.size and not mem.ptr <= start < mem.ptr + mem.block.size:
            return None
        return ndarray._over(mem, start - mem.ptr, view.shape, view.dtype, view.strides)

    # -- views -----------------------------------------------------------------------------
    def reshape(self, *shape: Any, order: str = "C") -> "ndarray":
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        view = self._host().view()
        try:
            view.shape = shape  # refuses instead of copying where no view exists
        except AttributeError:
            return self.copy().reshape(*shape)
        return self._derived(view)

    def view(self, dtype: Any) -> "ndarray":
        return self._derived(self._host().view(dtype))

    def __getitem__(self, key: Any) -> "ndarray":
        if isinstance(key, ndarray):
            return _take(self, key)
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis not in key:
            key = key + (Ellipsis,)  # a 0-d view where NumPy would read a scalar
        return self._derived(self._host()[key])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    # -- device work -------------------------------------------------------------------------
    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, ndarray):
            if not np.isscalar(value):
                raise NotImplementedError("the stand-in sets an index array's items to a scalar")
            device_work(lambda: self._host().__setitem__(key._host(), value), self, key)
            return
        _assign(self[key], value)

    def fill(self, value: Any) -> None:
        _assign(self, value)

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None,
               copy: bool = True) -> "ndarray":
        dtype = np.dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        out = ndarray(self.shape, dtype)
        _assign(out, self)
        return out

    def copy(self, order: str = "C") -> "ndarray":
        return self.astype(self.dtype)

    def sum(self, axis: Any = None, dtype: Any = None) -> "ndarray":
        if axis is not None:
            raise NotImplementedError("the stand-in sums whole arrays (axis=None)")
        out = ndarray((), np.zeros(1, self.dtype).sum(dtype=dtype).dtype)
        device_work(lambda: np.sum(self._host(), dtype=dtype, out=out._host()), self, out)
        return out

    def _ufunc(self, ufunc: np.ufunc, other: Any, inplace: bool = False,
               swap: bool = False) -> "ndarray":
        operands = (other, self) if swap else (self, other)
        samples = [_sample(x) for x in operands]
        if inplace:
            ufunc(*samples, out=samples[0])  # raises where NumPy would not cast back
            out = self
        else:
            shape = np.broadcast_shapes(*(x.shape for x in operands if isinstance(x, ndarray)))
            out = ndarray(shape, ufunc(*samples).dtype)
        arrays = [x for x in operands if isinstance(x, ndarray)]
        device_work(lambda: ufunc(*[x._host() if isinstance(x, ndarray) else x
                                    for x in operands], out=out._host()), out, *arrays)
        return out

    __add__, __radd__ = _operator(np.add), _operator(np.add, swap=True)
    __sub__, __rsub__ = _operator(np.subtract), _operator(np.subtract, swap=True)
    __mul__, __rmul__ = _operator(np.multiply), _operator(np.multiply, swap=True)
    __truediv__ = _operator(np.true_divide)
    __rtruediv__ = _operator(np.true_divide, swap=True)
    __iadd__, __isub__ = _operator(np.add, inplace=True), _operator(np.subtract, inplace=True)
    __imul__ = _operator(np.multiply, inplace=True)
    __itruediv__ = _operator(np.true_divide, inplace=True)

    def __neg__(self) -> "ndarray":
        return self._ufunc(np.multiply, -1)

    def __abs__(self) -> "ndarray":
        return _unary(np.absolute, self)

    # -- to and from the host ------------------------------------------------------------------
    def get(self, stream: Optional[Stream] = None, order: str = "C",
            out: Optional[np.ndarray] = None, blocking: bool = True) -> np.ndarray:
        """Copy to host memory, in ``stream``'s order (default: current). A copy into pageable
        memory, or a blocking one, waits for the stream."""
        stream = get_current_stream() if stream is None else stream
        out = np.empty(self.shape, self.dtype) if out is None else out
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"out is {out.dtype} {out.shape}, the array {self.dtype} {self.shape}")
        device_work(lambda: np.copyto(out, self._host()), self, stream=stream)
        if blocking or not is_pinned(out):
            stream.synchronize()
        return out

    def set(self, arr: np.ndarray, stream: Optional[Stream] = None) -> None:
        """Copy host ``arr`` in, in ``stream``'s order: pageable memory is read now (CUDA
        stages it before the call returns), page-locked memory when the copy runs."""
        arr = np.asarray(arr)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"arr is {arr.dtype} {arr.shape}, the array {self.dtype} {self.shape}")
        source = arr if is_pinned(arr) else arr.copy()
        device_work(lambda: np.copyto(self._host(), source), self, stream=stream)

    def item(self) -> Any:
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().reshape(()).item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __repr__(self) -> str:
        return f"array({self.get()!r}, device={self._mem.device_id})"

    def toDlpack(self) -> Any:
        from ._dlpack import to_capsule
        return to_capsule(self)

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self.toDlpack()

    def __dlpack_device__(self) -> Tuple[int, int]:
        return 2, self._mem.device_id  # kDLCUDA


def _sample(x: Any) -> Any:
    """A stand-in for ``x`` that types a NumPy operation: one element of its dtype."""
    return np.zeros(1, x.dtype) if isinstance(x, ndarray) else x


def _assign(target: ndarray, value: Any) -> None:
    """Device work: ``target[...] = value`` (a scalar, or an array broadcast to it)."""
    if isinstance(value, ndarray):
        if np.broadcast_shapes(value.shape, target.shape) != target.shape:
            raise ValueError(f"could not broadcast {value.shape} into {target.shape}")
        device_work(lambda: np.copyto(target._host(), value._host(), casting="unsafe"),
                    target, value)
    elif isinstance(value, np.ndarray):
        raise TypeError("the stand-in assigns scalars and cupy arrays; pass cupy.asarray(...)")
    else:
        device_work(lambda: target._host().__setitem__(Ellipsis, value), target)


def _take(a: ndarray, index: ndarray) -> ndarray:
    """Device work: ``a[index]`` for an integer index array (along the first axis)."""
    out = ndarray(index.shape + a.shape[1:], a.dtype)
    device_work(lambda: np.take(a._host(), index._host(), axis=0, out=out._host()),
                out, a, index)
    return out


def _unary(ufunc: np.ufunc, a: ndarray) -> ndarray:
    out = ndarray(a.shape, ufunc(np.zeros(1, a.dtype)).dtype)
    device_work(lambda: ufunc(a._host(), out=out._host()), out, a)
    return out


def empty(shape: Union[int, Sequence[int]], dtype: Any = float, order: str = "C") -> ndarray:
    """An uninitialised array on the current GPU."""
    return ndarray(shape, dtype)
