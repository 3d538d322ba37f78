"""NCCL communicator through CuPy's bindings: collectives on CuPy arrays that stay on the GPU.

One NCCL communicator per process set. Rank 0 of the set makes the unique id and the set's
host communicator (MPI) carries it to the others. Every collective runs on the caller's
current stream, after the work queued there (which produced the buffer) and before the work
queued after it, so later work sees the result without the host waiting; a stream of its own
would buy no overlap (the caller's stream would wait for it anyway) and cost two events, two
waits and a stream switch per call. The caller makes the communicator's GPU current (every
collective runs inside its memory's ``active()``). NCCL refuses two ranks on one GPU
("Duplicate GPU"): each rank needs a GPU of its own.

This module imports CuPy; ``hvd_trainer.cuda`` imports it only where CuPy is installed.
"""
import warnings
from itertools import accumulate
from typing import Optional, Sequence

import cupy
import numpy as np

from . import Communicator
from .host_staged import HostStagedCommunicator

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # CuPy warns when it finds no NCCL; available() tells
    from cupy.cuda import nccl


def available() -> bool:
    """Whether CuPy found an NCCL library it can call."""
    return bool(nccl.available)


_OPS, _DTYPES = {}, {}
if available():
    _OPS = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "min": nccl.NCCL_MIN,
            "max": nccl.NCCL_MAX}
    _DTYPES = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
               np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint32): nccl.NCCL_UINT32,
               np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint64): nccl.NCCL_UINT64,
               np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
               np.dtype(np.float64): nccl.NCCL_FLOAT64}


class NCCLCommunicator:
    """Collectives among the ranks of ``host`` on their GPUs, one GPU per rank.

    ``host`` is the set's host communicator: it carries the unique id, and the reductions
    NCCL has no type for (bool, complex, 16-bit integers) through host staging. Buffers are
    flat, C-contiguous CuPy arrays on ``device``.
    """

    def __init__(self, host: Communicator, device: int):
        self.rank, self.size, self.device = host.rank, host.size, device
        self._staged = HostStagedCommunicator(host)
        with cupy.cuda.Device(device):
            uid = host.broadcast_object(nccl.get_unique_id() if host.rank == 0 else None, 0)
            self._comm = nccl.NcclCommunicator(host.size, uid, host.rank)

    def allreduce(self, buf: cupy.ndarray, op: str, out: Optional[cupy.ndarray] = None) -> None:
        """Reduce ``buf`` across ranks with ``op`` ("sum", "prod", "min", "max"), in place or
        into ``out``."""
        if buf.dtype not in _DTYPES:
            self._staged.allreduce(buf, op, out)
            return
        if buf.size == 0:
            return
        send = buf.data.ptr
        self._comm.allReduce(send, send if out is None else out.data.ptr, buf.size,
                             _DTYPES[buf.dtype], _OPS[op], cupy.cuda.get_current_stream().ptr)

    def reduce_scatter(self, buf: cupy.ndarray, counts: Sequence[int], op: str) -> cupy.ndarray:
        """Reduce ``buf`` across ranks; return this rank's segment (``counts[rank]`` elements).

        NCCL scatters equal segments, so unequal ``counts`` are padded to the largest.
        """
        if buf.dtype not in _DTYPES:
            return self._staged.reduce_scatter(buf, counts, op)
        width = max(counts)
        out = cupy.empty(width, buf.dtype)
        if any(c != width for c in counts):
            padded = cupy.zeros(width * self.size, buf.dtype)
            for i, (start, count) in enumerate(zip(accumulate([0, *counts]), counts)):
                padded[i * width:i * width + count] = buf[start:start + count]
            buf = padded
        if width:
            self._comm.reduceScatter(buf.data.ptr, out.data.ptr, width, _DTYPES[buf.dtype],
                                     _OPS[op], cupy.cuda.get_current_stream().ptr)
        return out[:counts[self.rank]]

    def allgatherv(self, send: cupy.ndarray, recv: cupy.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[i]`` elements from rank i) into ``recv``.

        Any dtype travels, as bytes; unequal ``counts`` are padded to the largest.
        """
        width = max(counts) * send.itemsize
        if width == 0:
            return
        equal = all(c == counts[0] for c in counts)
        staged = send.view(np.uint8)
        if not equal:
            staged = cupy.zeros(width, np.uint8)
            staged[:send.nbytes] = send.view(np.uint8)
        gathered = recv.view(np.uint8) if equal else cupy.empty(width * self.size, np.uint8)
        self._comm.allGather(staged.data.ptr, gathered.data.ptr, width, nccl.NCCL_UINT8,
                             cupy.cuda.get_current_stream().ptr)
        if not equal:
            flat = recv.view(np.uint8)
            for i, (start, count) in enumerate(zip(accumulate([0, *counts]), counts)):
                size = count * send.itemsize
                flat[start * send.itemsize:start * send.itemsize + size] = \
                    gathered[i * width:i * width + size]

    def broadcast(self, buf: cupy.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``; any dtype, as bytes."""
        if buf.size == 0:
            return
        self._comm.bcast(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, root,
                         cupy.cuda.get_current_stream().ptr)

    def free(self) -> None:
        """Release the NCCL communicator once its queued collectives are done: they ran on
        callers' streams, so the whole GPU is waited for."""
        cupy.cuda.Device(self.device).synchronize()
        self._comm.destroy()
