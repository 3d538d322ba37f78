"""Which communicator moves a collective's data: the world's hierarchical one
(backends/hierarchical.py) for the global process set when ``HVD_HIERARCHICAL_ALLREDUCE`` or
``HVD_HIERARCHICAL_ALLGATHER`` (hvdrun's ``--hierarchical-allreduce``,
``--hierarchical-allgather``) asks for it, else the process set's own.

Hierarchical only where it can pay: on MPI, with several hosts of which at least one runs
more than one rank. One host, one rank per host, a process set other than the global one,
and GPU buffers (``hvd_trainer.cuda``) stay flat, with no error; the ranks decide alike, as
the settings are rank 0's and the layout is gathered from every rank.
"""
import logging
from typing import Any, Dict

from ..backends import Communicator
from ..runtime import runtime
from ..runtime.runtime import ProcessSet

log = logging.getLogger("hvd_trainer")

# The world's communicator -> its hierarchical one, while the job runs on that world.
_hierarchical: Dict[Communicator, Communicator] = {}


def _plan(state: Any) -> None:
    """At init, on every rank: build the world's hierarchical communicator if it is asked for
    and can pay (a collective of the world, so every rank takes part)."""
    reduces = bool(state.settings["HIERARCHICAL_ALLREDUCE"])
    gathers = bool(state.settings["HIERARCHICAL_ALLGATHER"])
    if state.backend != "mpi" or not (reduces or gathers):
        return
    from ..backends import hierarchical
    comm = hierarchical.over(state.world, state.local, state.cross, allreduce=reduces,
                             allgather=gathers)
    if comm is None:
        log.info("hierarchical allreduce/allgather asked for, but the job runs on one host or "
                 "one rank per host: both stay flat")
        return
    _hierarchical[state.world] = comm
    log.debug("hierarchical %s over %d hosts of %s ranks",
              " and ".join(n for n, on in (("allreduce", reduces), ("allgather", gathers)) if on),
              len(comm.hosts), "/".join(str(len(ranks)) for ranks in comm.hosts))


def _forget(comm: Communicator) -> bool:
    """At shutdown: drop the hierarchy of a world that ends (never busy itself)."""
    _hierarchical.pop(comm, None)
    return False


runtime.at_start(_plan)
runtime.at_leave(_forget)


def mover(process_set: ProcessSet) -> Communicator:
    """The communicator that moves the data of ``process_set``'s host collectives."""
    comm = runtime.communicator(process_set)
    return _hierarchical.get(comm, comm)


def active() -> bool:
    """Whether this job's world allreduce or allgather runs hierarchically."""
    return runtime.state().world in _hierarchical
