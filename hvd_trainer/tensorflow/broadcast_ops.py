"""horovod.tensorflow's broadcasts: of a tensor (with Horovod's gradient rule), of variables in
place, and TF1's broadcast_global_variables."""
from typing import Any, List, Optional, Sequence

import tensorflow as tf

from ..collectives import arguments
from ..collectives import ops as core
from ..collectives.arguments import Average
from ..runtime.runtime import ProcessSet, global_process_set, rank
from . import bridge
from .allreduce_ops import allreduce
from .bridge import plain_python
from .calls import checked, collective, same_set, with_gradient


@plain_python
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (``root_rank`` is a global
    rank, also on a process set). Gradients, Horovod's rule: averaged across the set into the
    root; zeros on the other ranks."""
    tensor = checked("broadcast", name, process_set, lambda: (
        same_set(process_set), bridge.check_tensor(tensor, "tensor"))[1])

    name = bridge.graph_name("broadcast", name)

    def forward(inputs):
        x = inputs[0]
        return collective(lambda a: [core.broadcast(a, root_rank, name, process_set)], [x],
                           [x.dtype], [x.shape], name, process_set)

    def backward(inputs, outputs, upstream):
        grad = allreduce(upstream[0], op=Average, process_set=process_set)
        if rank() == root_rank:
            return [grad]
        # Zeros that depend on the allreduce: in a TF1 graph an op nothing depends on does
        # not run, and the root would wait for this rank's part forever.
        with tf.control_dependencies([grad]):
            return [tf.identity(tf.zeros_like(grad))]

    return with_gradient(forward, backward, [tensor])[0]


def _broadcast_group(values: List[tf.Tensor], root_rank: int, name: Optional[str],
                     process_set: ProcessSet) -> List[tf.Tensor]:
    """The root's values of ``values``, broadcast one after the other in one op."""
    name = bridge.graph_name("broadcast_variables", name)

    def work(*arrays):
        names = arguments.tensor_names(name or "broadcast_variables", len(arrays))
        return [core.broadcast(a, root_rank, n, process_set) for a, n in zip(arrays, names)]

    return collective(work, values, [v.dtype for v in values], [v.shape for v in values],
                       name, process_set)


@plain_python
def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Overwrite each variable with ``root_rank``'s value, in place; returns their new
    values."""
    variables = list(variables)
    checked("broadcast", name, process_set, lambda: [
        same_set(process_set)] + [_variable(v, f"variables[{i}]")
                                   for i, v in enumerate(variables)])
    if not variables:
        return []
    received = _broadcast_group([tf.convert_to_tensor(v) for v in variables], root_rank, name,
                                process_set)
    assigns = [v.assign(r) for v, r in zip(variables, received)]
    if bridge.eager():
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies(assigns):
        return [tf.identity(v) for v in variables]


def _variable(value: Any, arg: str) -> Any:
    """A tf.Variable or a Keras variable (anything with ``assign`` that reads as a tensor)."""
    if not (isinstance(value, tf.Variable) or hasattr(value, "assign")):
        raise TypeError(f"{arg} must be a tf.Variable or a Keras variable, got "
                        f"{type(value).__name__}")
    return value


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """TF1: an op that overwrites every global variable of the graph with ``root_rank``'s
    value. TensorFlow 2 has no global variables: eagerly this raises RuntimeError, as
    Horovod's does."""
    if bridge.eager():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution "
                           "(TensorFlow 2 has no global variables); call "
                           "hvd.broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@plain_python
def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Optional[tf.Operation]:
    """Overwrite each variable with ``root_rank``'s value on every rank of the set (do it
    after the variables are created, so that every rank starts from the same values). In a
    TF1 graph, returns the op that does it."""
    if not process_set.included():
        return None
    values = broadcast_(variables, root_rank, None, process_set)
    return None if bridge.eager() else tf.group(*values)
