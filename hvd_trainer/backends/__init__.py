"""Communicators: the byte-moving layer under the collectives.

Every backend implements :class:`Communicator` on flat, C-contiguous NumPy buffers. Backends
know nothing about tensor names, scaling or frameworks; ``ops.py`` builds on them.
"""
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

# Reduction operators a communicator understands, mapped to the NumPy ufunc that applies them.
# "bor" (bitwise or) is for integer buffers only; the agreement ors flags with it.
REDUCE_UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply,
                 "bor": np.bitwise_or}


def split_evenly(count: int, parts: int) -> List[int]:
    """Offsets cutting ``count`` items into ``parts`` consecutive runs whose lengths differ by
    at most one, the first runs taking the extra items: the one split used everywhere (ring
    chunks, reducescatter rows as Horovod splits them, gradient groups)."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def widened(dtype: np.dtype) -> Optional[type]:
    """float32 for the 16-bit floats, which are reduced and scaled in float32 (rounded once per
    step); None for any other dtype. bfloat16 is ml_dtypes' NumPy dtype (the PyTorch adapter's),
    recognised by its name so that the core does not import ml_dtypes."""
    found = _widened.get(dtype, False)
    if found is False:  # dtype.name costs microseconds: every small collective asks
        found = _widened[dtype] = (np.float32 if dtype == np.float16 or dtype.name == "bfloat16"
                                   else None)
    return found


_widened: Dict[np.dtype, Optional[type]] = {}


class Request(Protocol):
    """A collective in progress, started without waiting."""

    def test(self) -> bool:
        """Whether it has completed; its buffer may be read or reused only after True."""


class Communicator(Protocol):
    """A group of ranks that can run collectives on flat NumPy buffers in place."""

    rank: int
    size: int

    def configure(self, algorithm: str, ring_threshold: int) -> None:
        """Use these agreed settings: allreduce algorithm (ring, native, auto) and the size
        in bytes from which ``auto`` takes the ring."""

    def allreduce(self, buf: np.ndarray, op: str, out: Optional[np.ndarray] = None,
                  kernels: Any = None) -> None:
        """Reduce ``buf`` elementwise across ranks with ``op`` (a REDUCE_UFUNCS key), in place,
        or into ``out`` (same size and dtype), leaving ``buf`` as it was. Host backends sum
        16-bit floats with ``kernels`` (a ``halves.Kernels``; NumPy's when omitted)."""

    def reduce_scatter(self, buf: np.ndarray, counts: Sequence[int], op: str,
                       kernels: Any = None) -> np.ndarray:
        """Reduce ``buf`` across ranks; return this rank's segment (``counts[rank]`` elements);
        ``kernels`` as in :meth:`allreduce`."""

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[i]`` elements from rank i) into ``recv``."""

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``."""

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int],
                  recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        """Send ``send_counts[i]`` consecutive elements to rank i; receive likewise into ``recv``."""

    def repeated_allgather(self, send: np.ndarray, recv: np.ndarray) -> Callable[[], Request]:
        """An allgather of every rank's ``send`` (the same size on every rank, a dtype MPI
        knows) into ``recv``, in rank order, made again and again on the same buffers: each
        call of the returned function begins one and returns at once; poll its request."""

    def repeated_allreduce(self, send: np.ndarray, recv: np.ndarray,
                           op: str) -> Callable[[], Request]:
        """An allreduce of every rank's ``send`` (an integer dtype MPI knows, the same size on
        every rank) into ``recv`` with ``op`` (a REDUCE_UFUNCS key), made again and again on
        the same buffers, as :meth:`repeated_allgather`."""

    def post(self, dest: int, message: Any) -> None:
        """Send a small picklable message to rank ``dest``'s mailbox without waiting for it.

        The mailbox is a side channel that never mixes with collectives; the stall inspector
        uses it to learn where waiting ranks are.
        """

    def collect_posts(self) -> List[Tuple[int, Any]]:
        """The messages that have arrived in this rank's mailbox, as (sender, message), oldest first."""

    def allgather_object(self, obj: Any) -> List[Any]:
        """Gather one picklable object from every rank, in rank order."""

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return root's picklable object on every rank."""

    def split(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """Collective over all ranks: a communicator of ``ranks`` (None on ranks outside it)."""

    def local_and_cross(self) -> "tuple[Communicator, Communicator]":
        """Ranks sharing this host, and ranks with the same local rank across hosts."""

    def barrier(self) -> None:
        """Wait until every rank has arrived."""

    def abort(self, code: int) -> None:
        """End every rank of the job with exit status ``code``."""

    def free(self) -> None:
        """Release the communicator's resources; it may not be used afterwards."""

    def leave(self) -> None:
        """Stop using the communicator without freeing it: an operation of this rank alone
        may stay active on it (see scheduler.Schedule.abandon)."""
