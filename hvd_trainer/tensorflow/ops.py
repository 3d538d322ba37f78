"""horovod.tensorflow's collectives on tf.Tensor and tf.Variable (Horovod's
``horovod.tensorflow.mpi_ops``): every collective's public name, and the object collectives and
join, which need no module of their own.

How a collective runs (eagerly or in a graph), and its argument errors, are in calls.py; each
family of collectives has its module: allreduce_ops.py, allgather_ops.py, broadcast_ops.py,
alltoall_ops.py, reducescatter_ops.py. The differentiable collectives are
``tf.custom_gradient`` functions with Horovod's gradient rules, documented on each. Results
are new tensors: on the GPU for eager GPU tensors where the core runs the collective on GPU
memory, on the host otherwise.

Scaled sums of float16 (Average, pre- and postscale; allreduce and reducescatter) round as
Horovod's CPU path does, to float16 after the prescale, after each addition and after the
postscale (``arguments.ROUNDED_EACH``), which is what Horovod's TensorFlow tests compute;
the core and the other adapters round once.
"""
from typing import Any, Callable, List, Optional

import tensorflow as tf

from ..collectives import joined as core_join
from ..collectives import objects
from ..runtime.runtime import ProcessSet, global_process_set
from .allgather_ops import allgather, grouped_allgather
from .allreduce_ops import allreduce, grouped_allreduce
from .alltoall_ops import alltoall
from .broadcast_ops import (broadcast, broadcast_, broadcast_global_variables,
                            broadcast_variables)
from .calls import Adasum, run
from .reducescatter_ops import grouped_reducescatter, reducescatter

__all__ = ["Adasum", "allgather", "allgather_object", "allreduce", "alltoall", "broadcast",
           "broadcast_", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "join", "reducescatter"]


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (``root_rank`` is global).
    ``session`` is accepted for Horovod's sake: objects travel at the call, in Python."""
    return run(lambda: objects.broadcast_object(obj, root_rank, name, process_set))


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument as :func:`broadcast_object` does."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    return run(lambda: objects.allgather_object(obj, name, process_set))


def join() -> tf.Tensor:
    """This rank has no more data: serve the other ranks' reductions with zeros until every
    rank has joined; returns the global rank that joined last (see
    :mod:`hvd_trainer.collectives.joined`). Eager only."""
    return tf.constant(run(core_join.join), tf.int32)
