"""horovod.tensorflow's reducescatter and grouped_reducescatter on tf.Tensor, with Horovod's
gradient rule."""
from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..collectives import arguments
from ..collectives import memory as core_memory
from ..collectives import ops as core
from ..collectives.arguments import Average, Sum
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .allgather_ops import allgather
from .bridge import plain_python
from .calls import (checked, collective, differentiable, reduce_op, same_set, tensor_list,
                    with_gradient)
from .compression import Compression


def _scatter_reduce(tensors: List[tf.Tensor], op: Any, prescale: float, postscale: float,
                    name: Optional[str], process_set: ProcessSet, kind: str) -> List[tf.Tensor]:
    """Reducescatter (one call of ``kind``), differentiable: Horovod's rule, the incoming
    gradients times the scale factors (and the set's size for Sum), gathered."""
    name = bridge.graph_name(kind, name)

    def forward(inputs):
        def work(*arrays: np.ndarray) -> List[np.ndarray]:
            return core.scatter_reduce(core_memory.HOST, arrays, op, name, process_set,
                                       prescale, postscale, kind, arguments.ROUNDED_EACH)

        return collective(work, inputs, [x.dtype for x in inputs],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None for x in inputs], name, process_set)

    def backward(inputs, outputs, upstream):
        differentiable(kind, op)
        factor = prescale * postscale * (process_set.size() if op == Sum else 1)
        return [allgather(g * tf.cast(factor, g.dtype) if factor != 1.0 else g,
                          process_set=process_set) for g in upstream]

    return with_gradient(forward, backward, tensors)


@plain_python
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` across the set and return this rank's rows of the result (dim 0
    split as evenly as possible, lower ranks taking one more); gradients flow through it."""
    op, tensor = checked("reducescatter", name, process_set, lambda: (
        same_set(process_set), reduce_op(op, None), bridge.check_tensor(tensor, "tensor"))[1:])
    compressed, ctx = compression.compress(tensor)
    share, = _scatter_reduce([compressed], op, prescale_factor, postscale_factor, name,
                             process_set, "reducescatter")
    return compression.decompress(share, ctx)


@plain_python
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None) -> List[tf.Tensor]:
    """:func:`reducescatter` of each tensor of a list, agreed on in one exchange."""
    if not tensors:
        return list(tensors)
    op, tensors = checked("grouped_reducescatter", name, process_set, lambda: (
        same_set(process_set), reduce_op(op, None), tensor_list(tensors))[1:])
    packed = [compression.compress(t) for t in tensors]
    shares = _scatter_reduce([t for t, _ in packed], op, prescale_factor, postscale_factor,
                             name, process_set, "grouped_reducescatter")
    return [compression.decompress(s, c) for s, (_, c) in zip(shares, packed)]
