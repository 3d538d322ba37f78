"""Tensor fusion on the GPU: pack many tensors into one device bucket in a single kernel launch.

A bucket is packed by one gather kernel and unpacked by one scatter kernel, whatever the
number of tensors: each thread finds its tensor by binary search over the members' offsets
and copies one element. Kernels move raw items of the dtype's width (1, 2, 4 or 8 bytes), so
one kernel serves every dtype. Scaling is a separate in-place pass over the bucket.
"""
from importlib import resources
from typing import Dict, NamedTuple, Sequence

import cupy
import numpy as np

from ..collectives.fusion import BufferPool

_SOURCE = resources.files(__package__).joinpath("fusion.cu").read_text()
_ITEMS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_modules: Dict[int, cupy.RawModule] = {}
_tables: Dict[tuple, "_Table"] = {}
_TABLES_KEPT = 256  # pointer tables cached (a training loop reuses the same few)
_THREADS = 256

# y = y * s, computed in float for float16/32 and in double for float64 and integers (which
# then truncate toward zero, as in ops.py). CuPy infers a type placeholder only from arrays,
# so the factor's type is spelled out, one kernel each.
_scale = {np.float32: cupy.ElementwiseKernel("float32 s", "T y", "y = (T)((float)y * s)",
                                             "hvd_scale_float"),
          np.float64: cupy.ElementwiseKernel("float64 s", "T y", "y = (T)((double)y * s)",
                                             "hvd_scale_double")}


def _kernel(direction: str, width: int) -> cupy.RawKernel:
    if width not in _modules:
        source = (_SOURCE.replace("gather_ITEM", f"gather_{width}")
                  .replace("scatter_ITEM", f"scatter_{width}").replace("ITEM", _ITEMS[width]))
        _modules[width] = cupy.RawModule(code=source)
    return _modules[width].get_function(f"{direction}_{width}")


def scale_(flat: cupy.ndarray, factor: float) -> None:
    """Multiply ``flat`` by ``factor`` in place; float16 in float32 so the factor is not
    rounded to float16."""
    if factor == 1.0 or flat.size == 0:
        return
    if flat.dtype.kind == "c":
        flat *= factor
        return
    wide = np.float64 if flat.dtype.kind in "iu" or flat.dtype == np.float64 else np.float32
    _scale[wide](wide(factor), flat)


class _Table(NamedTuple):
    """A group's device pointer table: each tensor's address, the items before each, and
    the items of them all (kept with the table, so a reused table costs no sizes)."""

    ptrs: cupy.ndarray
    starts: cupy.ndarray
    total: int


def _table(tensors: Sequence[cupy.ndarray], unit: int) -> _Table:
    key = (unit,) + tuple((t.data.ptr, t.nbytes) for t in tensors)
    held = _tables.get(key)
    if held is None:
        sizes = [t.nbytes // unit for t in tensors]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        held = _Table(cupy.asarray(np.array([t.data.ptr for t in tensors], np.uint64)),
                      cupy.asarray(starts), int(starts[-1]))
        if len(_tables) >= _TABLES_KEPT:
            _tables.pop(next(iter(_tables)))
        _tables[key] = held
    return held


def _launch(direction: str, tensors: Sequence[cupy.ndarray], flat: cupy.ndarray) -> None:
    for i, t in enumerate(tensors):
        if not t.flags.c_contiguous or t.dtype != flat.dtype:
            raise ValueError(f"tensor {i} of the bucket must be C-contiguous {flat.dtype}, "
                             f"got {t.dtype} with strides {t.strides}")
    unit = flat.itemsize if flat.itemsize in _ITEMS else 8  # complex128 moves as 2 × 8 bytes
    table = _table(tensors, unit)
    if table.total == 0:
        return
    blocks = min((table.total + _THREADS - 1) // _THREADS, 65535)
    _kernel(direction, unit)((blocks,), (_THREADS,), (table.ptrs, table.starts,
                                                      np.int32(len(tensors)), flat,
                                                      np.int64(table.total)))


def pack(tensors: Sequence[cupy.ndarray], out: cupy.ndarray, scale: float = 1.0) -> None:
    """Copy ``tensors`` back to back into the flat device buffer ``out``, times ``scale``."""
    _launch("gather", tensors, out)
    scale_(out, scale)


def unpack(flat: cupy.ndarray, outputs: Sequence[cupy.ndarray], scale: float = 1.0) -> None:
    """Scale ``flat`` in place by ``scale``, then copy consecutive slices into ``outputs``."""
    scale_(flat, scale)
    _launch("scatter", outputs, flat)


def device_pool() -> BufferPool:
    """A pool of fusion buffers in device memory."""
    return BufferPool(cupy.empty)
