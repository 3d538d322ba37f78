"""GPU collectives without NCCL: copy through pinned host memory and run the host communicator.

The fallback when CuPy has no NCCL, or when ranks share a GPU (NCCL refuses that). Each
collective copies the device buffer into a page-locked host buffer (one DMA, no pageable
bounce), runs the MPI collective there, and copies the result back. Host buffers persist
per (slot, dtype) and grow to the largest size asked for.

This module imports CuPy; ``hvd_trainer.cuda`` imports it only where CuPy is installed.
"""
from typing import Dict, Optional, Sequence, Tuple

import cupy
import cupyx
import numpy as np

from . import Communicator


class HostStagedCommunicator:
    """Collectives on CuPy arrays carried out by a host :class:`Communicator` on NumPy copies."""

    def __init__(self, host: Communicator):
        self.host = host
        self.rank, self.size = host.rank, host.size
        self._pinned: Dict[Tuple[str, np.dtype], np.ndarray] = {}

    def _pinned_buffer(self, slot: str, dtype: np.dtype, count: int) -> np.ndarray:
        held = self._pinned.get((slot, dtype))
        if held is None or held.size < count:
            held = cupyx.empty_pinned(max(count, 1), dtype)
            self._pinned[(slot, dtype)] = held
        return held[:count]

    def _to_host(self, buf: cupy.ndarray, slot: str) -> np.ndarray:
        host = self._pinned_buffer(slot, buf.dtype, buf.size)
        buf.get(out=host)  # waits for the current stream, so the producer has finished
        return host

    @staticmethod
    def _to_device(host: np.ndarray, buf: cupy.ndarray) -> None:
        # The copy from pinned memory is asynchronous; wait for it, so that the next
        # collective cannot overwrite the host buffer while the copy still reads it.
        buf.set(host)
        cupy.cuda.get_current_stream().synchronize()

    def allreduce(self, buf: cupy.ndarray, op: str, out: Optional[cupy.ndarray] = None) -> None:
        """Reduce ``buf`` across ranks with ``op``, in place or into ``out``."""
        if buf.size == 0:
            return
        host = self._to_host(buf, "send")
        self.host.allreduce(host, op)
        self._to_device(host, buf if out is None else out)

    def reduce_scatter(self, buf: cupy.ndarray, counts: Sequence[int], op: str) -> cupy.ndarray:
        """Reduce ``buf`` across ranks; return this rank's segment (``counts[rank]`` elements)."""
        mine = self.host.reduce_scatter(self._to_host(buf, "send"), counts, op)
        out = cupy.empty(mine.size, mine.dtype)
        self._to_device(np.ascontiguousarray(mine), out)
        return out

    def allgatherv(self, send: cupy.ndarray, recv: cupy.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[i]`` elements from rank i) into ``recv``."""
        gathered = self._pinned_buffer("recv", recv.dtype, recv.size)
        self.host.allgatherv(self._to_host(send, "send"), gathered, counts)
        self._to_device(gathered, recv)

    def broadcast(self, buf: cupy.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``."""
        if buf.size == 0:
            return
        host = self._to_host(buf, "send")
        self.host.broadcast(host, root)
        self._to_device(host, buf)

    def free(self) -> None:
        """Drop the pinned buffers; the host communicator belongs to the process set."""
        self._pinned.clear()
