"""The machinery of the TensorFlow adapter's collectives: running one on the core's
communication thread, eagerly or as an op of a graph, argument checks whose errors every rank
raises, and gradients by Horovod's rules.

Each collective runs on the core's communication thread (``hvd_trainer/coordination/work_order.py``)
in the order of the calls and returns when it has finished, as Horovod's ops do. Eagerly it runs
at the call; inside a ``tf.function`` (or a TF1 graph) it is an op that runs when the graph does
(see bridge.py). Argument errors are collective when eager: a check that fails on one rank goes
through the core's agreement (:func:`hvd_trainer.collectives.arguments.refuse`), so every rank
raises it at its call of the same collective. While a graph is being built, a bad argument
raises at once (it is the same on every rank, which builds the same graph). Errors are
TensorFlow's (errors.py).
"""
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import numpy as np
import tensorflow as tf

from ..collectives import arguments
from ..collectives.arguments import Average, Sum
from ..coordination import work_order
from ..runtime.runtime import ProcessSet
from . import bridge
from .errors import as_tensorflow_error

# Horovod's value of op=Adasum, refused here (see reduce_op).
Adasum = 2
T = TypeVar("T")


def run(work: Callable[[], T], name: Optional[str] = None,
        process_set: Optional[ProcessSet] = None, in_graph: bool = False) -> T:
    """Run ``work`` on the communication thread, in order with every other collective of
    this process, and return its result; its error is raised as TensorFlow's (errors.py).
    With ``process_set``, ``work`` is the collective ``name`` on it, its name taken now (see
    work_order.start). A graph's op passes ``in_graph``: TensorFlow runs a graph's ops on
    its own threads in any order, so a rank may wait on one op while its next is not yet
    submitted; the op waits for its match, as in Horovod, unless another rank waits
    eagerly for a call it cannot match (then both raise a mismatch)."""
    try:
        return work_order.start(work, name, process_set, in_graph).result()
    except (ValueError, TypeError, RuntimeError) as error:
        translated = as_tensorflow_error(error)
        if translated is error:
            raise
        raise translated.with_traceback(error.__traceback__) from None


def collective(work: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
                dtypes: Sequence[tf.DType], shapes: Sequence[Any], name: Optional[str],
                process_set: ProcessSet, device: bool = True) -> List[tf.Tensor]:
    """``work(*arrays)``, the collective ``name`` on ``process_set``, on the inputs' values,
    on the communication thread, now or when the graph runs (bridge.call); its arrays as
    tensors. With ``device``, ``work`` takes CuPy arrays too (eager GPU tensors')."""
    in_graph = not tf.executing_eagerly()  # while a graph or a tf.function is built
    return bridge.call(lambda *arrays: run(lambda: work(*arrays), name, process_set, in_graph),
                       inputs, dtypes, shapes, name, device)


def checked(kind: str, name: Optional[str], process_set: ProcessSet, check: Callable[[], T]) -> T:
    """Run an argument ``check``. When eager, its error is raised on every rank of the process
    set (the refusal takes the collective's place, meeting the other ranks' call of it)."""
    try:
        return check()
    except (TypeError, ValueError) as error:
        if bridge.eager():
            run(lambda: arguments.refuse(error, kind, name, process_set))
        raise


def reduce_op(op: Any, average: Optional[bool]) -> Any:
    """The core's reading of ``op``/``average`` (Horovod's rule); Adasum is refused."""
    if isinstance(op, int) and not isinstance(op, bool) and op == Adasum:
        raise ValueError("op=Adasum is not supported by hvd_trainer.tensorflow; use "
                         "op=hvd.Average or op=hvd.Sum")
    return arguments.requested_op(op, average, stacklevel=5)


def differentiable(kind: str, op: Any) -> None:
    """Refuse the gradient of collective ``kind`` with an ``op`` other than Average or Sum."""
    if op not in (Average, Sum):
        raise RuntimeError(f"{kind} with op={arguments.ReduceOp(op).name.title()} has no gradient "
                           "here; only Average and Sum are differentiable")


def with_gradient(forward: Callable[[List[tf.Tensor]], List[tf.Tensor]],
                   backward: Callable[[List[tf.Tensor], List[tf.Tensor], List[tf.Tensor]],
                                      List[Optional[tf.Tensor]]],
                   tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """``forward(tensors)`` with ``backward(inputs, outputs, output_gradients)`` as its
    gradient (missing output gradients are zeros)."""
    @tf.custom_gradient
    def function(*inputs):
        outputs = forward(list(inputs))

        def gradient(*upstream):
            given = [tf.zeros_like(o) if u is None else u for o, u in zip(outputs, upstream)]
            grads = backward(list(inputs), outputs, given)
            return grads if len(grads) > 1 else grads[0]

        return outputs, gradient

    return list(function(*tensors))


def tensor_list(tensors: Any, arg: str = "tensors") -> List[tf.Tensor]:
    """``tensors`` checked as a grouped collective's: a list (not one tensor) of tensors."""
    if isinstance(tensors, (tf.Tensor, tf.Variable)):
        raise TypeError(f"{arg} must be a list of tensors, got a single tensor; wrap it in a "
                        "list")
    return [bridge.check_tensor(t, f"{arg}[{i}]") for i, t in enumerate(tensors)]


def same_set(process_set: ProcessSet) -> ProcessSet:
    """``process_set`` if it is a ProcessSet (TypeError otherwise)."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    return process_set
