"""horovod.tensorflow's alltoall on tf.Tensor; gradients go back by an alltoall with the
received splits."""
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from ..collectives import ops as core
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .bridge import plain_python
from .calls import checked, collective, same_set, with_gradient


@plain_python
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set
             ) -> Union[tf.Tensor, Tuple[tf.Tensor, tf.Tensor]]:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank i of the set; return
    what arrives and, when ``splits`` is given, the rows received from each rank (int32), as
    Horovod does. Without ``splits`` dim 0 is divided equally. Gradients go back by an
    alltoall with the received splits."""
    tensor = checked("alltoall", name, process_set, lambda: (
        same_set(process_set), bridge.check_tensor(tensor, "tensor"))[1])
    given = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)
    name = bridge.graph_name("alltoall", name)

    def forward(inputs):
        x = inputs[0]

        def work(array: np.ndarray, send: np.ndarray) -> List[np.ndarray]:
            size = process_set.size()
            if splits is None and array.ndim and array.shape[0] % size == 0:
                send = [array.shape[0] // size] * size  # explicit, so rows come back too
            elif splits is None:
                send = None  # the core refuses, naming the rows and the ranks
            out, received = core.alltoall(array, send, name, process_set)
            return [out, received.astype(np.int32)]

        return collective(work, [x, given], [x.dtype, tf.int32],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None, tf.TensorShape([None])], name,
                           process_set, device=False)

    def backward(inputs, outputs, upstream):
        grad, _ = alltoall(upstream[0], splits=outputs[1], process_set=process_set)
        return [grad]

    output, received = with_gradient(forward, backward, [tensor])
    return output if splits is None else (output, tf.stop_gradient(received))
