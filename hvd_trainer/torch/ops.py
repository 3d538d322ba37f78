"""horovod.torch's collectives on torch.Tensor (Horovod's ``horovod.torch.mpi_ops``): every
collective's public name, and those that need no module of their own (barrier, the object
collectives, join).

The machinery, handles and collective argument errors are in calls.py; each family of
collectives has its module: allreduce_ops.py (with grouped and sparse allreduce),
allgather_ops.py, broadcast_ops.py, alltoall_ops.py, reducescatter_ops.py.
"""
from typing import Any, List, Optional

from ..collectives import joined as core_join
from ..collectives import objects
from ..collectives import ops as core
from ..runtime.runtime import ProcessSet, global_process_set
from .allgather_ops import (allgather, allgather_async, grouped_allgather,
                            grouped_allgather_async)
from .allreduce_ops import (allreduce, allreduce_, allreduce_async, allreduce_async_,
                            grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                            grouped_allreduce_async_, sparse_allreduce_async)
from .alltoall_ops import alltoall, alltoall_async
from .broadcast_ops import broadcast, broadcast_, broadcast_async, broadcast_async_
from .calls import Adasum, poll, start, synchronize
from .reducescatter_ops import (grouped_reducescatter, grouped_reducescatter_async,
                                reducescatter, reducescatter_async)

__all__ = ["Adasum", "allgather", "allgather_async", "allgather_object", "allreduce",
           "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
           "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "broadcast_object", "grouped_allgather", "grouped_allgather_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
           "join", "poll", "reducescatter", "reducescatter_async", "sparse_allreduce_async",
           "synchronize"]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the process set arrives."""
    synchronize(start(core.barrier, process_set, finish=lambda _: None, process_set=process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (``root_rank`` is global)."""
    return synchronize(start(objects.broadcast_object, obj, root_rank, name, process_set,
                              finish=lambda result: result, name=name, process_set=process_set))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    return synchronize(start(objects.allgather_object, obj, name, process_set,
                              finish=lambda result: result, name=name, process_set=process_set))


def join(device: int = -1) -> int:
    """This rank has no more data: serve the other ranks' reductions with zeros until every
    rank has called join; return the global rank that joined last (of several joining
    together, the highest). See :mod:`hvd_trainer.collectives.joined` for what a joined rank serves.

    Meanwhile the other ranks' ``allreduce``, ``grouped_allreduce`` (their async forms and
    Adasum included), ``barrier`` and ``DistributedOptimizer`` steps run with zeros for this
    rank; ``Average`` divides by the full size, joined ranks included, as Horovod 0.28 does.
    Any other collective raises ``HorovodInternalError`` on every rank that called it while
    a rank is joined (Horovod refuses allgather, broadcast, alltoall and reducescatter), and
    so do calls that differ between the other ranks once each waits for its own (after a
    failure caught on some ranks only, say): this rank stays in join() until every rank has
    called it, never leaving the others waiting (see :func:`hvd_trainer.collectives.joined.join`).
    ``device`` says where Horovod makes its zeros; it is accepted and not used: a joined
    rank serves host tensors only (a collective on CUDA tensors raises while a rank is
    joined), and its zeros are host arrays.
    """
    return synchronize(start(core_join.join, finish=lambda last: last))
