"""Device memory of the stand-in: blocks of host memory that only device work may touch.

A block's address is its device pointer, so compiled kernels dereference pointers (pointer
tables included) as a GPU would. Blocks come from a pool, as CuPy's: a freed allocation's
block keeps its contents and goes back to the pool of the stream it was allocated on, and
only allocations on that stream reuse it, so queued work on that stream that still reads
the freed memory runs before anything overwrites it. A new block is filled with 0xFF bytes
(NaN for floats), so a read of memory nothing wrote shows. Page-locked host buffers
(cupyx.empty_pinned) are registered here too: device copies read them when they run.
"""
import bisect
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["Memory", "MemoryPointer", "find", "is_pinned", "pin"]

_ALIGN, _ROUND = 256, 512
# Reentrant: a collection can run a Memory's __del__ (or a pinned buffer's callback), which
# takes it, on a thread that already holds it (any allocation under it can set one off).
_lock = threading.RLock()
_starts: List[int] = []          # block addresses, sorted
_blocks: Dict[int, "_Block"] = {}  # address -> block
_free: Dict[Tuple[int, int, int], List["_Block"]] = {}  # (device, size, stream) -> blocks
_pinned: List[Tuple[int, int, "weakref.ref"]] = []  # (start, end, buffer)


class _Block:
    __slots__ = ("buffer", "ptr", "size", "device", "owner")

    def __init__(self, size: int, device: int):
        raw = np.empty(size + _ALIGN, np.uint8)
        skip = -raw.ctypes.data % _ALIGN
        self.buffer = raw[skip:skip + size]
        self.buffer.fill(0xFF)
        self.ptr, self.size, self.device = self.buffer.ctypes.data, size, device
        self.owner: Optional["weakref.ref"] = None


class Memory:
    """One allocation on GPU ``device``; its block returns to the pool when it is freed."""

    __slots__ = ("block", "size", "stream_ptr", "__weakref__")

    def __init__(self, size: int, device: int, stream_ptr: int):
        rounded = max(_ROUND, -(-size // _ROUND) * _ROUND)
        with _lock:
            pool = _free.get((device, rounded, stream_ptr))
            block = pool.pop() if pool else None
            if block is None:
                block = _Block(rounded, device)
                bisect.insort(_starts, block.ptr)
                _blocks[block.ptr] = block
            block.owner = weakref.ref(self)
        self.block, self.size, self.stream_ptr = block, size, stream_ptr

    @property
    def ptr(self) -> int:
        return self.block.ptr

    @property
    def device_id(self) -> int:
        return self.block.device

    def __del__(self) -> None:
        # Back to the pool of the stream it was allocated on, as CuPy's pool does.
        block = self.block
        with _lock:
            block.owner = None
            _free.setdefault((block.device, block.size, self.stream_ptr), []).append(block)


class MemoryPointer:
    """An address inside an allocation, as ``ndarray.data``."""

    __slots__ = ("mem", "ptr")

    def __init__(self, mem: Memory, offset: int):
        self.mem, self.ptr = mem, mem.ptr + offset

    @property
    def device_id(self) -> int:
        return self.mem.device_id


def find(ptr: int, nbytes: int) -> Optional[Tuple[Memory, int]]:
    """The live allocation holding ``nbytes`` from device address ``ptr``, and the offset."""
    with _lock:
        at = bisect.bisect_right(_starts, ptr) - 1
        block = _blocks[_starts[at]] if at >= 0 else None
    mem = None if block is None or block.owner is None else block.owner()
    if mem is None or ptr + nbytes > block.ptr + mem.size:  # within what was asked for
        return None
    return mem, ptr - block.ptr


def pin(buffer: np.ndarray) -> None:
    """Register ``buffer`` (a 1-D uint8 array) as page-locked host memory while it lives."""
    start = buffer.ctypes.data
    entry = (start, start + buffer.nbytes, weakref.ref(buffer, lambda _: _unpin(start)))
    with _lock:
        _pinned.append(entry)


def _unpin(start: int) -> None:
    with _lock:
        _pinned[:] = [e for e in _pinned if e[0] != start]


def is_pinned(array: np.ndarray) -> bool:
    """Whether ``array``'s memory lies in a registered page-locked buffer."""
    start = array.__array_interface__["data"][0]
    with _lock:
        return any(a <= start and start + array.nbytes <= b for a, b, _ in _pinned)
