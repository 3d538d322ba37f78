"""``cupyx`` of the stand-in: page-locked host buffers and scatter_add (see cupy/__init__.py)."""
from typing import Any, Sequence, Union

import numpy as np

from cupy._core import device_work, ndarray, shape_of
from cupy.cuda.memory import pin

__all__ = ["empty_pinned", "scatter_add"]


def empty_pinned(shape: Union[int, Sequence[int]], dtype: Any = float) -> np.ndarray:
    """A NumPy array in page-locked host memory: device copies from it read it when they
    run, not when they are enqueued."""
    shape, dtype = shape_of(shape), np.dtype(dtype)
    raw = np.empty(max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1), np.uint8)
    pin(raw)
    return raw[:int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)


def scatter_add(a: ndarray, slices: ndarray, value: ndarray) -> None:
    """Device work: ``a[slices] += value``, repeated indices adding up (NumPy's add.at)."""
    device_work(lambda: np.add.at(a._host(), slices._host(), value._host()), a, slices, value)
