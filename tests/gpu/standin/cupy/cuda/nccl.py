"""``cupy.cuda.nccl`` of the stand-in: NCCL communicators over MPI between the real MPI ranks.

``get_unique_id()`` names its maker (its rank in MPI_COMM_WORLD) and a random token;
``NcclCommunicator(n, id, rank)`` sends the maker this rank's place (host and physical GPU)
and gets back every member's world rank, or NCCL's refusal when two ranks share a GPU
("Duplicate GPU detected"), on every rank; the members then make an MPI communicator of their
own (MPI_Comm_create_group, collective over the members alone). A collective is device work
on the stream it is given: it runs when that stream runs, in stream order, on the device
memory the pointers name (which must be live allocations on the communicator's GPU, as NCCL
checks). Every rank gathers every rank's buffer and reduces in rank order, so all ranks get
the same bits, as NCCL's ring gives them.

What a device would not do: a rank's queued collectives run only when that rank's host waits
for them, so ranks that wait for them at different points among their host collectives
deadlock here where a GPU would not (on a GPU the queued work runs by itself).
"""
import os
import socket
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from .device import current_id, physical
from .memory import find
from .stream import ExternalStream

__all__ = ["NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_INT32", "NCCL_INT64",
           "NCCL_INT8", "NCCL_MAX", "NCCL_MIN", "NCCL_PROD", "NCCL_SUM", "NCCL_UINT32",
           "NCCL_UINT64", "NCCL_UINT8", "NcclCommunicator", "NcclError", "available",
           "get_unique_id"]

available = True
(NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16,
 NCCL_FLOAT32, NCCL_FLOAT64) = range(9)
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = range(4)
_DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
           np.float32, np.float64]
_REDUCE = [np.add, np.multiply, np.maximum, np.minimum]
_INVALID_ARGUMENT, _INVALID_USAGE = 4, 5
_MESSAGES = {_INVALID_ARGUMENT: "NCCL_ERROR_INVALID_ARGUMENT: invalid argument",
             _INVALID_USAGE: "NCCL_ERROR_INVALID_USAGE: invalid usage"}
_TAG_BASE, _TAGS = 1 << 14, 1 << 14  # within MPI's smallest allowed tag bound (32767)


class NcclError(RuntimeError):
    """NCCL's error: ``status`` is its ncclResult_t."""

    def __init__(self, status: int, detail: str = ""):
        super().__init__(_MESSAGES[status] + (f" ({detail})" if detail else ""))
        self.status = status


def _world() -> Any:
    from mpi4py import MPI  # imported when NCCL is used, after the program started MPI
    return MPI


def get_unique_id() -> Tuple[int, ...]:
    """128 bytes naming this process (its world rank) and a random token, as signed chars."""
    raw = np.zeros(128, np.uint8)
    raw[:4] = np.frombuffer(np.int32(_world().COMM_WORLD.Get_rank()).tobytes(), np.uint8)
    raw[4:20] = np.frombuffer(os.urandom(16), np.uint8)
    return tuple(int(b) for b in raw.view(np.int8))


class NcclCommunicator:
    """Rank ``rank`` of ``ndev`` ranks that share ``commId``, on the current GPU."""

    def __init__(self, ndev: int, commId: Tuple[int, ...], rank: int):
        mpi = _world()
        world = mpi.COMM_WORLD
        raw = np.array(commId, np.int8).view(np.uint8)
        maker = int(raw[:4].view(np.int32)[0])
        tag = _TAG_BASE + int.from_bytes(bytes(raw[4:8]), "little") % _TAGS
        self.device = current_id()
        place = (rank, world.Get_rank(), socket.gethostname(), physical(self.device))
        if world.Get_rank() == maker:
            places = [place] + [world.recv(source=mpi.ANY_SOURCE, tag=tag)
                                for _ in range(ndev - 1)]
            members = _members(places, ndev)
            for p in places[1:]:
                world.send(members, dest=p[1], tag=tag)
        else:
            world.send(place, dest=maker, tag=tag)
            members = world.recv(source=maker, tag=tag)
        if isinstance(members, str):
            raise NcclError(_INVALID_USAGE, members)
        self._comm = world.Create_group(world.group.Incl(members), tag)
        self.rank, self.size = rank, ndev
        self._queued: Dict[Any, int] = {}  # stream queue -> position of its last collective

    def _buffer(self, ptr: int, count: int, dtype: Any, what: str) -> Callable[[], np.ndarray]:
        """The device memory at ``ptr`` (checked now), as a NumPy view made when work runs."""
        dtype = np.dtype(dtype)
        found = find(ptr, count * dtype.itemsize)
        if found is None or found[0].device_id != self.device:
            raise NcclError(_INVALID_ARGUMENT, f"{what} {ptr:#x} is no allocation of "
                            f"{count * dtype.itemsize} bytes on the communicator's GPU "
                            f"{self.device}")
        mem, offset = found
        return lambda: np.ndarray(count, dtype, buffer=mem.block.buffer, offset=offset)

    def _enqueue(self, stream: int, work: Callable[[], None]) -> None:
        if self._comm is None:
            raise NcclError(_INVALID_ARGUMENT, "the communicator was destroyed")
        if current_id() != self.device:
            raise NcclError(_INVALID_USAGE, f"GPU {current_id()} is current, the "
                            f"communicator's is {self.device}")
        queue = ExternalStream(stream).queue()
        queue.push(work)
        self._queued[queue] = queue.queued

    def _gathered(self, send: np.ndarray) -> np.ndarray:
        """Every rank's ``send``, in rank order (rows)."""
        rows = np.empty((self.size, send.nbytes), np.uint8)
        self._comm.Allgather(send.view(np.uint8), rows)
        return rows.view(send.dtype)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        send = self._buffer(sendbuf, count, _DTYPES[datatype], "sendbuff")
        recv = self._buffer(recvbuf, count, _DTYPES[datatype], "recvbuff")
        self._enqueue(stream, lambda: _reduce(self._gathered(send()), op, recv()))

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,
                      op: int, stream: int) -> None:
        send = self._buffer(sendbuf, recvcount * self.size, _DTYPES[datatype], "sendbuff")
        recv = self._buffer(recvbuf, recvcount, _DTYPES[datatype], "recvbuff")
        mine = slice(self.rank * recvcount, (self.rank + 1) * recvcount)
        self._enqueue(stream, lambda: _reduce(self._gathered(send())[:, mine], op, recv()))

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  stream: int) -> None:
        send = self._buffer(sendbuf, count, _DTYPES[datatype], "sendbuff")
        recv = self._buffer(recvbuf, count * self.size, _DTYPES[datatype], "recvbuff")
        self._enqueue(stream, lambda: np.copyto(recv(), self._gathered(send()).reshape(-1)))

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        buf = self._buffer(buff, count, _DTYPES[datatype], "buff")
        self._enqueue(stream, lambda: self._comm.Bcast(buf().view(np.uint8), root=root))

    def destroy(self) -> None:
        """Free the communicator once its queued collectives have run (NCCL finalizes it:
        here they run now)."""
        for queue, position in self._queued.items():
            queue.run_until(position)
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


def _members(places: List[Tuple[int, int, str, int]], ndev: int) -> Any:
    """The world ranks in NCCL rank order, or why NCCL refuses the communicator."""
    ranks = sorted(p[0] for p in places)
    if ranks != list(range(ndev)):
        return f"ranks {ranks} joined a communicator of {ndev}"
    seen = {}
    for rank, _, host, gpu in sorted(places):
        if (host, gpu) in seen:
            return (f"Duplicate GPU detected : rank {rank} and rank {seen[host, gpu]} both on "
                    f"GPU {gpu} of {host}")
        seen[host, gpu] = rank
    return [world for _, world, _, _ in sorted(places)]


def _reduce(rows: np.ndarray, op: int, out: np.ndarray) -> None:
    """``out`` = the rows reduced with ``op`` in rank order, in their own type."""
    result = rows[0].copy()
    for row in rows[1:]:
        _REDUCE[op](result, row, out=result)
    np.copyto(out, result)
