"""Hierarchical allreduce and allgather: within each host through the MPI library's own
collectives on the host's shared-memory communicator, across hosts among one rank per host.

The host-local communicator is MPI's ``Split_type(COMM_TYPE_SHARED)``; the cross-host one
holds each host's first rank (local rank 0), split from the world by local rank. Both are
``MPICommunicator.local_and_cross``'s. The link then carries each host's data once, where
the flat ring passes every rank's share over it.

* allreduce: the host's buffers are gathered to its first rank (``MPI_Gather``, in pieces)
  and reduced there with NumPy's ufuncs in local rank order, as the ring reduces (16-bit
  floats added in float32 and rounded after each addition, NaN propagated by Min and Max);
  then an allreduce among the first ranks (the cross communicator's own: the ring, or MPI's,
  as ``HVD_ALLREDUCE_ALGO`` says), then ``MPI_Bcast`` within the host. Every rank receives
  its first rank's bits, so all ranks agree bit for bit. (``MPI_Reduce`` was the other way:
  MPICH 5.0.2's took 2.5x as long for 100 MiB of float32 between 2 ranks, 526 ms against
  212 ms, and its MIN and MAX do not propagate NaN as NumPy does.)
* allgatherv: ``MPI_Gatherv`` of the host's parts to its first rank, an allgatherv of the
  hosts' blocks among the first ranks, the blocks put in world rank order (where a host's
  ranks are not consecutive), and ``MPI_Bcast`` of the whole result within the host.

Hosts may run different numbers of ranks. A buffer that one MPI call could not take without
MPI-4's large counts (2 GiB and over) goes flat, as does everything but these two calls.
"""
from itertools import accumulate
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from . import REDUCE_UFUNCS, widened
from .halves import NUMPY, Kernels, is_half
from .mpi import MPICommunicator

# Bytes gathered from each rank per piece of an allreduce: the first rank's scratch holds
# local size x this many.
PIECE_BYTES = 8 << 20


def hosts_of(firsts: Sequence[int]) -> List[List[int]]:
    """The world ranks on each host, from each world rank's host's first rank (``firsts[r]``);
    hosts in the order of their first ranks, which is the cross communicator's order."""
    hosts: Dict[int, List[int]] = {}
    for rank, first in enumerate(firsts):
        hosts.setdefault(first, []).append(rank)
    return [hosts[first] for first in sorted(hosts)]


class HierarchicalCommunicator:
    """The world's communicator whose allreduce and/or allgatherv go hierarchically; every
    other collective is the world's own."""

    def __init__(self, world: MPICommunicator, local: MPICommunicator, cross: MPICommunicator,
                 hosts: List[List[int]], *, allreduce: bool, allgather: bool):
        self.world, self.local, self.cross, self.hosts = world, local, cross, hosts
        self.reduces, self.gathers = allreduce, allgather
        self.host = next(i for i, ranks in enumerate(hosts) if world.rank in ranks)
        self.consecutive = [r for ranks in hosts for r in ranks] == list(range(world.size))
        self._scratch: Optional[np.ndarray] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.world, name)

    def _flat(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` goes flat: MPI's counts could not take it (the same
        answer on every rank, as every rank's buffer has that size)."""
        return self.world.count_limit is not None and nbytes > self.world.count_limit

    # -- allreduce -------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: str, out: Optional[np.ndarray] = None,
                  kernels: Optional[Kernels] = None) -> None:
        if not self.reduces or buf.size == 0 or self._flat(buf.nbytes):
            self.world.allreduce(buf, op, out, kernels)
            return
        out = buf if out is None else out
        if self.local.size == 1:
            if out is not buf:
                out[...] = buf
        else:
            self._gather_and_reduce(buf, op, out, kernels)
        if self.local.rank == 0:
            self.cross.allreduce(out, op, None, kernels)
        self.local.broadcast(out, 0)

    def _gather_and_reduce(self, buf: np.ndarray, op: str, out: np.ndarray,
                           kernels: Optional[Kernels]) -> None:
        """Reduce the host's ``buf``s into the first rank's ``out`` with NumPy, in pieces."""
        per = max(1, PIECE_BYTES // buf.itemsize)
        ranks, first = self.local.size, self.local.rank == 0
        if first:
            add = (kernels or NUMPY).add if op == "sum" and is_half(buf.dtype) else None
            ufunc, widen = REDUCE_UFUNCS[op], widened(buf.dtype)
        for a in range(0, buf.size, per):
            b = min(a + per, buf.size)
            parts = self._rows(buf.dtype, ranks, b - a) if first else None
            self.local.comm.Gather([buf[a:b].view(np.uint8), MPI.BYTE],
                                   [parts.view(np.uint8), MPI.BYTE] if first else None, root=0)
            if not first:
                continue
            target = out[a:b]
            for rank in range(1, ranks):
                left = parts[0] if rank == 1 else target
                if add is None:
                    ufunc(left, parts[rank], out=target, dtype=widen)
                else:
                    add(left, parts[rank], target)

    def _rows(self, dtype: np.dtype, ranks: int, count: int) -> np.ndarray:
        """A reusable (ranks, count) receive buffer of ``dtype``, grown on demand."""
        nbytes = ranks * count * dtype.itemsize
        if self._scratch is None or self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes].view(dtype).reshape(ranks, count)

    # -- allgather -------------------------------------------------------------------------
    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        if not self.gathers or self._flat(recv.nbytes):
            self.world.allgatherv(send, recv, counts)
            return
        if self.local.rank == 0:
            mine = self.hosts[self.host]
            item = send.dtype.itemsize
            parts = [counts[r] * item for r in mine]
            block = np.empty(sum(parts), np.uint8)
            self.local.comm.Gatherv([send.view(np.uint8), MPI.BYTE],
                                    [block, parts, [0, *accumulate(parts[:-1])], MPI.BYTE], root=0)
            totals = [sum(counts[r] for r in ranks) * item for ranks in self.hosts]
            into = recv.view(np.uint8) if self.consecutive else np.empty(recv.nbytes, np.uint8)
            self.cross.allgatherv(block, into, totals)
            if not self.consecutive:
                self._to_rank_order(into, recv.view(np.uint8), [c * item for c in counts])
        else:
            self.local.comm.Gatherv([send.view(np.uint8), MPI.BYTE], None, root=0)
        self.local.broadcast(recv, 0)

    def _to_rank_order(self, by_host: np.ndarray, recv: np.ndarray, sizes: List[int]) -> None:
        """Copy the hosts' blocks in ``by_host`` to each rank's place in ``recv``."""
        starts = [0, *accumulate(sizes)]
        offset = 0
        for rank in (r for ranks in self.hosts for r in ranks):
            recv[starts[rank]:starts[rank + 1]] = by_host[offset:offset + sizes[rank]]
            offset += sizes[rank]


def over(world: MPICommunicator, local: MPICommunicator, cross: MPICommunicator, *,
         allreduce: bool, allgather: bool) -> Optional[HierarchicalCommunicator]:
    """A collective of the world: its hierarchical communicator, or None where the job runs
    on one host, or one rank per host, and a hierarchy would only add steps."""
    first = local.comm.bcast(world.rank, 0)
    hosts = hosts_of(world.comm.allgather(first))
    if len(hosts) in (1, world.size):
        return None
    return HierarchicalCommunicator(world, local, cross, hosts, allreduce=allreduce,
                                    allgather=allgather)
