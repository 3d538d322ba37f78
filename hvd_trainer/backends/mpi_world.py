"""The job's processes under MPI: COMM_WORLD, or the world that growing or shrinking the job
in place made (hvd_trainer.runtime.membership), from which every later init's world is made.

A growth starts new processes with MPI_Comm_spawn_multiple and merges them in after the
running ranks; a new process merges with them at its first :func:`world`. A removal splits
the ranks that leave out of the world.
"""
from typing import Dict, Optional, Sequence, Tuple

from mpi4py import MPI

from .mpi import MPICommunicator

__all__ = ["grow", "joined", "without", "world"]

# The job's processes: COMM_WORLD, or, in a process that a growth in place started or once
# this process grew or shrank the job, the communicator made then.
_base: Optional["MPI.Intracomm"] = None
_joined = False  # a growth in place started this process (it had a parent)


def world() -> MPICommunicator:
    """The communicator of every process of the job: a duplicate of COMM_WORLD (or of the
    job as grown or shrunk in place) for each init, so that a round a rank left unfinished at
    shutdown (see :meth:`MPICommunicator.leave`) never meets the next init's collectives. A
    process that a growth in place started joins the job's ranks here, after theirs."""
    global _base, _joined
    if _base is None:
        parent = MPI.Comm.Get_parent()
        _joined = parent != MPI.COMM_NULL
        _base = parent.Merge(high=True) if _joined else MPI.COMM_WORLD
        if _joined:
            # Kept, it would hold Open MPI's MPI_Finalize here until parents long gone
            # disconnected from it.
            parent.Free()
    return MPICommunicator(_base.Dup(), aborts=MPI.COMM_WORLD)


def joined() -> bool:
    """Whether a growth in place started this process (MPI_Comm_spawn: it has a parent)."""
    return _joined if _base is not None else MPI.Comm.Get_parent() != MPI.COMM_NULL


def grow(comm: MPICommunicator, command: str, args: Sequence[str],
         places: Sequence[Tuple[int, Dict[str, str]]]) -> MPICommunicator:
    """``comm``'s ranks followed by new processes: MPI_Comm_spawn_multiple of ``command
    args``, ``places`` each (processes, info keys), merged in after ``comm``'s ranks. A
    collective of ``comm``; it returns once every new process has joined (at its first
    :func:`world`). The world from now on."""
    global _base
    infos = []
    for _, keys in places:
        info = MPI.Info.Create()
        for key, value in keys.items():
            info.Set(key, value)
        infos.append(info)
    try:
        inter = comm.comm.Spawn_multiple([command] * len(places), [list(args)] * len(places),
                                         [procs for procs, _ in places], infos, root=0)
    finally:
        for info in infos:
            info.Free()
    _base = inter.Merge(high=False)
    inter.Free()
    return world()


def without(comm: MPICommunicator, leaving: Sequence[int]) -> Optional[MPICommunicator]:
    """``comm`` without its ranks ``leaving``: a collective of all its ranks; for the others
    the world from now on, None on a rank that leaves."""
    global _base
    kept = comm.comm.Split(MPI.UNDEFINED if comm.rank in leaving else 0, comm.rank)
    if kept == MPI.COMM_NULL:
        return None
    _base = kept
    return world()
