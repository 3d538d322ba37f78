"""horovod.tensorflow's allgather and grouped_allgather on tf.Tensor, with Horovod's gradient
rule."""
from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from ..collectives import ops as core
from ..collectives.arguments import Average
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .allreduce_ops import allreduce
from .bridge import plain_python
from .calls import checked, collective, same_set, tensor_list, with_gradient


def _rows_before(rows: tf.Tensor, process_set: ProcessSet) -> Tuple[tf.Tensor, tf.Tensor]:
    """Where this rank's rows start in a gathered tensor, and how many it has (collective)."""
    every = allgather(tf.reshape(tf.cast(rows, tf.int64), [1]), process_set=process_set)
    return tf.reduce_sum(every[:process_set.rank()]), tf.cast(rows, tf.int64)


def _gather_gradient(upstream: List[tf.Tensor], inputs: List[tf.Tensor],
                     process_set: ProcessSet) -> List[tf.Tensor]:
    """Horovod's allgather gradient: the incoming gradients are averaged across the set and
    each rank takes back the rows it contributed."""
    grads = [allreduce(g, op=Average, process_set=process_set) for g in upstream]
    result = []
    for grad, x in zip(grads, inputs):
        start, rows = _rows_before(tf.shape(x)[0], process_set)
        result.append(grad[start:start + rows])
    return result


@plain_python
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (which may differ per rank);
    gradients flow through it (see :func:`_gather_gradient`)."""
    tensor = checked("allgather", name, process_set, lambda: (
        same_set(process_set), bridge.check_tensor(tensor, "tensor"))[1])

    name = bridge.graph_name("allgather", name)

    def forward(inputs):
        x = inputs[0]
        return collective(lambda a: [core.allgather(a, name, process_set)], [x], [x.dtype],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None], name, process_set)

    return with_gradient(forward, lambda inputs, outputs, upstream:
                          _gather_gradient(upstream, inputs, process_set), [tensor])[0]


@plain_python
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """:func:`allgather` each tensor of a list, agreed on in one exchange."""
    tensors = checked("grouped_allgather", name, process_set, lambda: (
        same_set(process_set), tensor_list(tensors))[1])
    if not tensors:
        return []
    name = bridge.graph_name("grouped_allgather", name)

    def forward(inputs):
        return collective(lambda *arrays: core.grouped_allgather(list(arrays), name,
                                                                  process_set),
                           inputs, [x.dtype for x in inputs],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None for x in inputs], name, process_set)

    return with_gradient(forward, lambda inputs, outputs, upstream:
                          _gather_gradient(upstream, inputs, process_set), tensors)
