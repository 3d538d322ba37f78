"""Collectives on picklable objects: broadcast_object, allgather_object, and the rooted
gather_object and scatter_object.

Every one pickles inside its argument checks, before the agreement, so that an object that
cannot be pickled raises on every rank instead of leaving the others in the data phase. Small
pickles travel in the agreement's carrier (broadcast_object, allgather_object).
"""
from __future__ import annotations  # the nested functions' annotations cost each call else

import pickle
from typing import Any, List, Optional, Sequence

import numpy as np

from ..coordination import agreement
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set
from .arguments import check_root


# -- objects --------------------------------------------------------------------------------
def _pickled(obj: Any, what: str = "obj") -> bytes:
    """``obj`` pickled, as a check: an object that cannot be pickled is a TypeError naming
    ``what``. Every object collective pickles inside its ``checks()``, before the agreement,
    so that such an object raises on every rank instead of leaving the others in the data
    phase."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # pickling can fail with any error type, e.g. in __reduce__
        raise TypeError(f"{what} cannot be pickled ({type(e).__name__}: {e}); pass a picklable "
                        "object") from None


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return the root rank's picklable ``obj`` on every rank (``root_rank`` is global)."""
    comm = runtime.communicator(process_set)
    call = agreement.again(comm, "broadcast_object", name)  # None: not free at once
    with agreement.collective(comm, "broadcast_object", name) if call is None else call \
            as call:
        payload = root = None
        with call.checks():
            root = check_root(root_rank, process_set)
            payload = _pickled(obj) if comm.rank == root else None
        carried = call.exchange(lambda: {"root_rank": int(root_rank)},
                                None if payload is None else np.frombuffer(payload, np.uint8),
                                None if call.error else (int(root_rank),), root)
        sent = None if carried is None else carried.of(root)
        if sent is not None:
            return obj if comm.rank == root else pickle.loads(sent)
        with call.communicate():
            payload = comm.broadcast_object(payload, root)
        return obj if comm.rank == root else pickle.loads(payload)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "allgather_object", name) as call:
        payload = None
        with call.checks():
            payload = _pickled(obj)
        carried = call.exchange(dict, None if payload is None
                                else np.frombuffer(payload, np.uint8), ())
        if carried is not None and carried.every():
            return [pickle.loads(carried.of(rank)) for rank in range(comm.size)]
        with call.communicate():
            every = comm.allgather_object(payload)
        return [pickle.loads(p) for p in every]


def _exchange_bytes(comm: Any, parts: Sequence[bytes]) -> List[bytes]:
    """Send ``parts[r]`` to rank r and return what each rank sent here, in rank order."""
    send_counts = np.array([len(p) for p in parts], np.int64)
    recv_counts = np.empty(comm.size, np.int64)
    comm.alltoallv(send_counts, [1] * comm.size, recv_counts, [1] * comm.size)
    send = np.frombuffer(b"".join(parts), np.uint8)
    recv = np.empty(int(recv_counts.sum()), np.uint8)
    comm.alltoallv(send, send_counts.tolist(), recv, recv_counts.tolist())
    bounds = np.concatenate([[0], np.cumsum(recv_counts)])
    return [recv[a:b].tobytes() for a, b in zip(bounds, bounds[1:])]


def gather_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set) -> Optional[List[Any]]:
    """Every rank's picklable ``obj`` in rank order on the root rank (a global rank), None on
    the others: unlike :func:`allgather_object`, no rank but the root receives the others'."""
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "gather_object", name) as call:
        data = b""
        with call.checks():
            root = check_root(root_rank, process_set)
            data = _pickled(obj)
        call.agree(lambda: {"root_rank": int(root_rank)})
        with call.communicate():
            got = _exchange_bytes(comm, [data if r == root else b"" for r in range(comm.size)])
        return [pickle.loads(b) for b in got] if comm.rank == root else None


def scatter_object(objs: Optional[Sequence[Any]], root_rank: int = 0, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Any:
    """Give rank r of the process set ``objs[r]`` from the root rank (a global rank; ``objs``
    is read there only and must hold one picklable object per rank)."""
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "scatter_object", name) as call:
        with call.checks():
            root = check_root(root_rank, process_set)
            if comm.rank == root and (objs is None or len(objs) != comm.size):
                raise ValueError(f"objs must hold one object per rank of the process set "
                                 f"({comm.size}) on the root rank, got "
                                 f"{None if objs is None else len(objs)}")
            parts = ([_pickled(o, f"objs[{r}]") for r, o in enumerate(objs)]
                     if comm.rank == root else [b""] * comm.size)
        call.agree(lambda: {"root_rank": int(root_rank)})
        with call.communicate():
            got = _exchange_bytes(comm, parts)
        return pickle.loads(got[root])
