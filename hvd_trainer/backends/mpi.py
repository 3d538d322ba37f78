"""MPI communicator over mpi4py's buffer API, with a ring allreduce written here.

Two allreduce algorithms:

* ``ring``: reduce-scatter then allgather over ``Sendrecv`` with the left and right
  neighbours. The buffer is cut into ``size`` chunks whose lengths differ by at most one
  element, so every count (zero, fewer elements than ranks, odd) and every world size works.
  It reduces any NumPy dtype with a ufunc, including float16 and bfloat16, which MPI cannot
  sum: each hop adds in float32 and rounds once to the 16-bit type.
* ``native``: the MPI library's ``MPI_Allreduce``, for dtypes and ops MPI defines.

Float Min and Max: MPI's MIN and MAX keep whichever operand a comparison favours, and the
ranks combine operands in different orders, so a NaN on one rank, or -0 on one and +0 on
another, left ranks with different results. The ring (NumPy's ufuncs, each chunk reduced once)
propagates NaN as np.minimum/np.maximum do and gives every rank the same bits; a native
reduction first checks each rank's input for NaN and -0 (one pass) and agrees on it in a
one-byte allreduce, then leaves such buffers to the ring (benchmarks/min_max.py).

``auto`` uses native below ``ring_threshold`` bytes and the ring at or above it; the default
threshold comes from ``benchmarks/allreduce.py`` (see benchmarks/README.md). Buffers travel as
raw bytes except in native reductions, so MPI never needs to know a dtype it lacks.

Messages of any size: MPI counts and displacements are C ints (below 2 GiB of bytes) unless
the library has MPI-4's large counts. Without them, point-to-point messages, broadcasts and
native reductions go in pieces under the limit, and gathers and all-to-alls whose counts or
displacements exceed it are done as broadcasts or pairwise exchanges of such pieces (an
all-to-all takes one more small allreduce there, as each rank knows only its own counts).
"""
import atexit
import os
import pickle
import threading
import weakref
from itertools import accumulate
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from hvd_trainer_launch.rank.segments import Segments

from . import REDUCE_UFUNCS, split_evenly, widened
from .halves import NUMPY, Kernels, is_half

if not MPI.Is_initialized():
    # mpi4py was first imported with its rc.initialize off (hvdrun's launcher module reads
    # the MPI library's version so, without starting MPI, and hvd_trainer.run imports it in
    # the driver): start MPI as mpi4py would have, and end it at exit.
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())

_MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD, "bor": MPI.BOR}
# Dtypes whose reductions MPI defines for every op in _MPI_OPS (complex lacks min/max).
_NATIVE_KINDS = {"i", "u", "f"}
ALGORITHMS = ("ring", "native", "auto")
# Tag of the mailbox (post / collect_posts); the ring uses tags 0 and 1, pairwise exchanges 2.
_POST_TAG = 7331


# Largest count or displacement an MPI call takes without MPI-4 large counts.
_INT_LIMIT = 2**31 - 1


def nan_or_negative_zero(buf: np.ndarray) -> bool:
    """Whether the float array ``buf`` holds a NaN or a -0 (two passes: max, then the bits)."""
    sign_bit = np.array(1 << (8 * buf.itemsize - 1)).astype(f"u{buf.itemsize}")
    return bool(np.isnan(buf.max()) or (buf.view(sign_bit.dtype) == sign_bit).any())


def _bytes(buf: np.ndarray) -> list:
    return [buf.view(np.uint8), MPI.BYTE]


def _pieces(count: int, limit: int) -> List[Tuple[int, int]]:
    """(start, end) ranges of at most ``limit`` covering ``count`` (one empty range for 0)."""
    return [(a, min(a + limit, count)) for a in range(0, count, limit)] or [(0, 0)]


class _Pending:
    """An mpi4py request behind the backends' Request protocol."""

    def __init__(self, request: Optional["MPI.Request"]):
        self._request = request

    def test(self) -> bool:
        return self._request is None or self._request.Test()


class _Persistent:
    """A persistent mpi4py request behind the backends' Request protocol: its ``test`` is
    the request's own (every agreement polls one)."""

    __slots__ = ("test",)

    def __init__(self, request: "MPI.Prequest"):
        self.test = request.Test


class MPICommunicator:
    """Collectives over one mpi4py communicator."""

    def __init__(self, comm: "MPI.Comm", algorithm: str = "auto", ring_threshold: int = 1 << 20,
                 aborts: Optional["MPI.Comm"] = None):
        self.comm = comm
        # What abort() aborts: the launcher takes the exit code from an abort of COMM_WORLD
        # (MPICH's mpiexec did not always from one of its duplicate).
        self._aborts = comm if aborts is None else aborts
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.configure(algorithm, ring_threshold)
        # Largest count per MPI call, in the call's datatype (None: MPI-4 large counts).
        self.count_limit: Optional[int] = None if MPI.Get_version() >= (4, 0) else _INT_LIMIT
        self._scratch: Dict[np.dtype, np.ndarray] = {}
        self._posting: List["MPI.Request"] = []  # mailbox sends not yet known to be complete
        self._mailbox = threading.Lock()  # the stall watchdog posts from its own thread
        self._persistent: List["MPI.Prequest"] = []  # freed before the communicator
        _live.add(self)

    def configure(self, algorithm: str, ring_threshold: int) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"allreduce algorithm {algorithm!r} is unknown; use one of {ALGORITHMS} "
                             f"(HVD_ALLREDUCE_ALGO)")
        self.algorithm = algorithm
        self.ring_threshold = ring_threshold

    def _fits(self, *counts: int) -> bool:
        """Whether one MPI call may take these counts and displacements."""
        return self.count_limit is None or max(counts, default=0) <= self.count_limit

    def _sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int,
                  tag: int) -> None:
        """``MPI_Sendrecv`` of raw bytes, in pieces where the counts are too large."""
        send, recv = send.view(np.uint8), recv.view(np.uint8)
        if self._fits(send.size, recv.size):
            self.comm.Sendrecv([send, MPI.BYTE], dest, tag, [recv, MPI.BYTE], source, tag)
            return
        # A message of n bytes is always cut into the same pieces, by its sender and by its
        # receiver (who knows n), whatever else either of them sends or receives: the send
        # and the receive may need different numbers of pieces.
        limit = self.count_limit
        requests = [self.comm.Irecv([recv[a:b], MPI.BYTE], source, tag)
                    for a, b in _pieces(recv.size, limit)]
        requests += [self.comm.Isend([send[a:b], MPI.BYTE], dest, tag)
                     for a, b in _pieces(send.size, limit)]
        MPI.Request.Waitall(requests)

    # -- allreduce -------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: str, out: Optional[np.ndarray] = None,
                  kernels: Optional[Kernels] = None) -> None:
        out = buf if out is None else out
        if self.size == 1 or buf.size == 0:
            if out is not buf:
                out[...] = buf
            return
        if self._use_native(buf, op) and not self._order_matters(buf, op):
            for a, b in _pieces(buf.size, self.count_limit or buf.size):
                send = MPI.IN_PLACE if out is buf else buf[a:b]
                self.comm.Allreduce(send, out[a:b], _MPI_OPS[op])
        else:
            self.ring_allreduce(buf, op, out, kernels)

    def repeated_allgather(self, send: np.ndarray,
                           recv: np.ndarray) -> Callable[[], Any]:
        """A persistent ``MPI_Allgather_init`` request where the library has MPI-4's persistent
        collectives (starting it costs a fraction of an ``MPI_Iallgather`` call: 0.8 against
        2.4 µs for 4 KiB on 2 ranks, MPICH 5.0.2, 2026-12-06), else ``MPI_Iallgather`` each
        time."""
        comm = self.comm  # not self: the caller keeps the function in a weak mapping of it
        if MPI.Get_version() < (4, 0) or not hasattr(comm, "Allgather_init"):
            return lambda: _Pending(comm.Iallgather(send, recv))
        return self._repeated(comm.Allgather_init(send, recv))

    def repeated_allreduce(self, send: np.ndarray, recv: np.ndarray,
                           op: str) -> Callable[[], Any]:
        """A persistent ``MPI_Allreduce_init`` request where the library has MPI-4's
        persistent collectives (0.7 µs for 72 bytes on 2 ranks, against 3.1 µs for mpi4py's
        ``Allreduce``), else ``MPI_Iallreduce`` each time."""
        comm, mpi_op = self.comm, _MPI_OPS[op]
        if MPI.Get_version() < (4, 0) or not hasattr(comm, "Allreduce_init"):
            return lambda: _Pending(comm.Iallreduce(send, recv, mpi_op))
        return self._repeated(comm.Allreduce_init(send, recv, mpi_op))

    def _repeated(self, request: "MPI.Prequest") -> Callable[[], "_Persistent"]:
        """A function that starts the persistent ``request`` and returns it to poll; the
        request is freed with the communicator (see :meth:`free_requests`)."""
        self._persistent.append(request)
        pending = _Persistent(request)
        begin = request.Start

        def start() -> _Persistent:
            begin()
            return pending
        return start

    def _use_native(self, buf: np.ndarray, op: str) -> bool:
        if buf.dtype.kind not in _NATIVE_KINDS or buf.dtype == np.float16:
            return False
        if self.algorithm == "auto":
            return buf.nbytes < self.ring_threshold
        return self.algorithm == "native"

    def _order_matters(self, buf: np.ndarray, op: str) -> bool:
        """Whether some rank's float Min/Max input holds a NaN or a -0, whose result MPI's
        MIN/MAX would make depend on the order of operands (agreed in one small allreduce)."""
        if buf.dtype.kind != "f" or op not in ("min", "max"):
            return False
        flag = np.array([nan_or_negative_zero(buf)], np.uint8)
        self.comm.Allreduce(MPI.IN_PLACE, flag, MPI.MAX)
        return bool(flag[0])

    def ring_allreduce(self, buf: np.ndarray, op: str, out: Optional[np.ndarray] = None,
                       kernels: Optional[Kernels] = None) -> None:
        """Reduce-scatter then allgather around the ring; ``buf`` is flat and contiguous.

        With ``out`` the result goes there and ``buf`` is only read: no copy of it first.
        16-bit float sums run on ``kernels`` (NumPy's when None).
        """
        out = buf if out is None else out
        bounds = split_evenly(buf.size, self.size)
        self._ring_reduce_scatter(buf, bounds, op, out, kernels)
        self._ring_allgather(out, bounds)

    def _ring_reduce_scatter(self, buf: np.ndarray, bounds: List[int], op: str,
                             out: np.ndarray, kernels: Optional[Kernels]) -> None:
        # After step s, rank r holds chunk (r - s - 2) mod p reduced over s + 2 ranks, so after
        # p - 1 steps it holds chunk r reduced over all ranks. Each chunk is received at most
        # once, so a partial sum is read from ``out`` only after it was written there.
        p, r = self.size, self.rank
        right, left = (r + 1) % p, (r - 1) % p
        ufunc = REDUCE_UFUNCS[op]
        widen = widened(buf.dtype)
        add = (kernels or NUMPY).add if op == "sum" and is_half(buf.dtype) else None
        scratch = self._scratch_for(buf.dtype, max(b - a for a, b in zip(bounds, bounds[1:])))
        for step in range(p - 1):
            send_c, recv_c = (r - step - 1) % p, (r - step - 2) % p
            source = buf if step == 0 else out
            send = source[bounds[send_c]:bounds[send_c + 1]]
            chunk = slice(bounds[recv_c], bounds[recv_c + 1])
            incoming = scratch[: chunk.stop - chunk.start]
            self._sendrecv(send, right, incoming, left, 0)
            if add is None:
                ufunc(buf[chunk], incoming, out=out[chunk], dtype=widen)
            else:
                add(buf[chunk], incoming, out[chunk])

    def _ring_allgather(self, buf: np.ndarray, bounds: List[int]) -> None:
        p, r = self.size, self.rank
        right, left = (r + 1) % p, (r - 1) % p
        for step in range(p - 1):
            send_c, recv_c = (r - step) % p, (r - step - 1) % p
            self._sendrecv(buf[bounds[send_c]:bounds[send_c + 1]], right,
                           buf[bounds[recv_c]:bounds[recv_c + 1]], left, 1)

    def _scratch_for(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable receive buffer, grown on demand, so steady state allocates nothing."""
        held = self._scratch.get(dtype)
        if held is None or held.size < count:
            held = np.empty(count, dtype)
            self._scratch[dtype] = held
        return held[:count]

    # -- other collectives -----------------------------------------------------------------
    def reduce_scatter(self, buf: np.ndarray, counts: Sequence[int], op: str,
                       kernels: Optional[Kernels] = None) -> np.ndarray:
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        if self.size > 1:
            # The ring's first phase leaves each rank's own chunk fully reduced.
            self._ring_reduce_scatter(buf, bounds, op, buf, kernels)
        return buf[bounds[self.rank]:bounds[self.rank + 1]]

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        item = send.dtype.itemsize
        byte_counts = [c * item for c in counts]
        displs = [0, *accumulate(byte_counts[:-1])]
        if self._fits(*byte_counts, *displs):
            self.comm.Allgatherv(_bytes(send),
                                 [recv.view(np.uint8), byte_counts, displs, MPI.BYTE])
            return
        # Too large for int counts: each rank's part is broadcast from it, in pieces.
        for root, (start, count) in enumerate(zip(displs, byte_counts)):
            part = recv.view(np.uint8)[start:start + count]
            if root == self.rank:
                part[...] = send.view(np.uint8)
            self.broadcast(part, root)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.size > 1 and buf.size:
            raw = buf.view(np.uint8)
            for a, b in _pieces(raw.size, self.count_limit or raw.size):
                self.comm.Bcast([raw[a:b], MPI.BYTE], root)

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int],
                  recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        item = send.dtype.itemsize
        sc = [c * item for c in send_counts]
        rc = [c * item for c in recv_counts]
        sd = [0, *accumulate(sc[:-1])]
        rd = [0, *accumulate(rc[:-1])]
        fits = self._fits(*sc, *rc, *sd, *rd)
        if self.count_limit is not None:
            # Each rank knows only its own counts, so the ranks choose the path together:
            # one rank in MPI_Alltoallv and another in pairwise exchanges would hang.
            over = np.array([not fits], np.int8)
            self.comm.Allreduce(MPI.IN_PLACE, over, MPI.MAX)
            fits = not over[0]
        if fits:
            self.comm.Alltoallv([send.view(np.uint8), sc, sd, MPI.BYTE],
                                [recv.view(np.uint8), rc, rd, MPI.BYTE])
            return
        # Too large for int counts: pairwise exchanges, each in pieces.
        out, into = send.view(np.uint8), recv.view(np.uint8)
        for shift in range(self.size):
            dest, source = (self.rank + shift) % self.size, (self.rank - shift) % self.size
            self._sendrecv(out[sd[dest]:sd[dest] + sc[dest]], dest,
                           into[rd[source]:rd[source] + rc[source]], source, 2)

    def post(self, dest: int, message: Any) -> None:
        with self._mailbox:
            self._posting = [r for r in self._posting if not r.Test()]
            self._posting.append(self.comm.isend(message, dest, _POST_TAG))

    def collect_posts(self) -> List[Tuple[int, Any]]:
        if not self.comm.Iprobe(MPI.ANY_SOURCE, _POST_TAG):  # the common case, at once
            return []
        status = MPI.Status()
        arrived = []
        with self._mailbox:
            while self.comm.Iprobe(MPI.ANY_SOURCE, _POST_TAG, status):
                source = status.Get_source()
                arrived.append((source, self.comm.recv(source=source, tag=_POST_TAG)))
        return arrived

    def allgather_object(self, obj: Any) -> List[Any]:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        counts = self.comm.allgather(data.size)
        out = np.empty(sum(counts), np.uint8)
        self.allgatherv(data, out, counts)
        bounds = np.cumsum([0] + counts)
        return [pickle.loads(out[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        length = self.comm.bcast(len(data), root)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root else np.empty(length, np.uint8)
        self.broadcast(buf, root)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def split(self, ranks: Sequence[int]) -> Optional["MPICommunicator"]:
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else MPI.UNDEFINED, sorted(ranks).index(self.rank) if member else 0)
        if sub == MPI.COMM_NULL:
            return None
        return self._child(sub)

    def local_and_cross(self) -> Tuple["MPICommunicator", "MPICommunicator"]:
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        cross = self.comm.Split(local.Get_rank(), self.rank)
        return self._child(local), self._child(cross)

    def _child(self, comm: "MPI.Comm") -> "MPICommunicator":
        child = MPICommunicator(comm, self.algorithm, self.ring_threshold)
        child.count_limit = self.count_limit
        return child

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int) -> None:
        # No rank of an aborted job finalizes, and outside hvdrun (whose rank relays remove
        # them) MPICH's shared-memory file stays in /dev/shm: this rank removes the MPI files
        # it uses first; the other ranks keep their mappings until the abort ends them.
        Segments(os.getpid()).remove()
        self._aborts.Abort(code)

    def free(self) -> None:
        self.free_requests()
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.comm.Free()

    def leave(self) -> None:
        """Drop this communicator without freeing it or its requests: one may stay active
        (a round of this rank alone), and MPI forbids freeing an active collective request."""
        _live.discard(self)
        self._persistent.clear()

    def failed_peers(self) -> int:
        """How many of this communicator's processes MPI knows to have failed (ULFM; 0 where
        the library tracks no failures). Local: it asks, and waits for nobody."""
        try:
            group = self.comm.Get_failed()
        except (NotImplementedError, MPI.Exception):
            return 0
        try:
            return group.Get_size()
        finally:
            group.Free()

    def shrink(self) -> "MPICommunicator":
        """The surviving ranks of this communicator after a process failed (MPI's ULFM
        extensions): it is revoked first, so that the survivors' calls on it fail too and
        bring every survivor to the shrink, a collective of theirs."""
        self.comm.Revoke()
        survivors = self._child(self.comm.Shrink())
        survivors._aborts = self._aborts
        return survivors

    def free_requests(self) -> None:
        """Free the persistent requests (MPICH complains of any left at MPI_Finalize)."""
        for request in self._persistent:
            request.Free()
        self._persistent.clear()


# Communicators whose persistent requests go before MPI_Finalize (mpi4py's, which runs after
# every atexit function).
_live: "weakref.WeakSet[MPICommunicator]" = weakref.WeakSet()


@atexit.register
def _free_requests() -> None:
    for comm in list(_live):
        comm.free_requests()


# ULFM's error classes: a peer process failed, or a peer revoked the communicator after one
# did. Absent (never matched) where mpi4py's library lacks the extensions.
_LOST_PEER = {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                              "ERR_REVOKED") if hasattr(MPI, name)}


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is MPI's report of a failed peer process (see ``shrink``)."""
    return isinstance(error, MPI.Exception) and error.Get_error_class() in _LOST_PEER


def threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def library_version() -> str:
    """The MPI library's own version line, for diagnostics."""
    return MPI.Get_library_version().splitlines()[0].strip()
