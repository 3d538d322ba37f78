"""The job's ranks changing while their processes go on (hvd_trainer.elastic): the survivors
of a failed rank shrink the world (MPI's ULFM extensions), the ranks grow it in place by new
processes that MPI starts and merges in (MPI_Comm_spawn), or leave some of themselves out.
Either way the job then starts again on the new world, as shutdown() and init() would.
"""
from typing import Dict, Optional, Sequence, Set, Tuple

from .launcher_check import launched_by_mpi
from . import runtime

__all__ = ["grow", "joined", "leave_out", "lost_peer", "shrink"]


def lost_peer(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or during, is MPI's report that a
    peer process failed (ULFM; see :func:`shrink`), or MPI knows of a failed process of the
    world: a framework may have turned MPI's error into its own (TensorFlow's graphs do)."""
    if not runtime.is_initialized() or runtime.state().backend != "mpi":
        return False
    from ..backends import mpi
    seen: Set[int] = set()
    found: Optional[BaseException] = error
    while found is not None and id(found) not in seen:
        if mpi.lost_peer(found):
            return True
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return runtime.state().world.failed_peers() > 0


def shrink() -> int:
    """Go on without the ranks whose processes failed: revoke the world, shrink it to the
    survivors (a collective of the survivors) and start the job again on them. Returns the
    new number of ranks."""
    with runtime.lock():
        survivors = runtime.state().world.shrink()
        runtime.restart_on(survivors)
    return survivors.size


def grow(command: str, args: Sequence[str],
         places: Sequence[Tuple[int, Dict[str, str]]]) -> int:
    """Grow the job in place: start ``command args`` as new ranks after ours (``places``:
    how many processes with which MPI info keys each, as MPI_Comm_spawn_multiple takes them),
    merge them in, and start the job again on every rank. A collective; returns the new
    number of ranks."""
    from ..backends import mpi_world
    with runtime.lock():
        grown = mpi_world.grow(runtime.state().world, command, args, places)
        runtime.restart_on(grown)
    return grown.size


def leave_out(leaving: Sequence[int]) -> Optional[int]:
    """Go on without the ranks ``leaving`` (their places in the world), which go on running
    until they exit: a collective of every rank. Returns the new number of ranks, or None on
    a rank that leaves (its part of the job is shut down)."""
    from ..backends import mpi_world
    with runtime.lock():
        kept = mpi_world.without(runtime.state().world, leaving)
        if kept is None:
            runtime.shutdown()
            return None
        runtime.restart_on(kept)
    return kept.size


def joined() -> bool:
    """Whether this process joined a running job (a growth in place started it): it has no
    commit of its own to offer, and takes the others' (hvd_trainer.elastic)."""
    if not launched_by_mpi():
        return False
    from ..backends import mpi_world
    return mpi_world.joined()
