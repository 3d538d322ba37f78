"""horovod.tensorflow's collectives on tf.Tensor and tf.Variable, over the core.

Each collective runs on the core's communication thread (``hvd_trainer/coordination/work_order.py``)
in the order of the calls and returns when it has finished, as Horovod's ops do. Eagerly it runs at
the call; inside a ``tf.function`` (or a TF1 graph) it is an op that runs when the graph does
(see bridge.py). Results are new tensors: on the GPU for eager GPU tensors where the core runs
the collective on GPU memory, on the host otherwise.

The differentiable collectives are ``tf.custom_gradient`` functions with Horovod's gradient
rules, documented on each. Argument errors are collective when eager: a check that fails on
one rank goes through the core's agreement (``ops.refuse``), so every rank raises it at its
call of the same collective. While a graph is being built, a bad argument raises at once (it
is the same on every rank, which builds the same graph). Errors are TensorFlow's
(errors.py).

Scaled sums of float16 (Average, pre- and postscale; allreduce and reducescatter) round as
Horovod's CPU path does, to float16 after the prescale, after each addition and after the
postscale (``arguments.ROUNDED_EACH``), which is what Horovod's TensorFlow tests compute;
the core and the other adapters round once.
"""
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import tensorflow as tf

from ..coordination import work_order
from ..collectives import arguments, objects, sparse
from ..collectives import joined as core_join
from ..collectives import memory as core_memory
from ..collectives import ops as core
from ..collectives.arguments import Average, Sum
from ..runtime.runtime import ProcessSet, global_process_set, rank
from . import bridge
from .compression import Compression
from .bridge import plain_python
from .errors import as_tensorflow_error

# Horovod's value of op=Adasum, refused here (see _reduce_op).
Adasum = 2
_SPARSE = "allreduce.indexed_slices"  # the base name of an unnamed IndexedSlices allreduce
T = TypeVar("T")


# -- running a collective -------------------------------------------------------------------
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


def _collective(work: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
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


def _reduce_op(op: Any, average: Optional[bool]) -> Any:
    """The core's reading of ``op``/``average`` (Horovod's rule); Adasum is refused."""
    if isinstance(op, int) and not isinstance(op, bool) and op == Adasum:
        raise ValueError("op=Adasum is not supported by hvd_trainer.tensorflow; use "
                         "op=hvd.Average or op=hvd.Sum")
    return arguments.requested_op(op, average, stacklevel=5)


def _differentiable(kind: str, op: Any) -> None:
    if op not in (Average, Sum):
        raise RuntimeError(f"{kind} with op={arguments.ReduceOp(op).name.title()} has no gradient "
                           "here; only Average and Sum are differentiable")


def _with_gradient(forward: Callable[[List[tf.Tensor]], List[tf.Tensor]],
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


def _tensors(tensors: Any, arg: str = "tensors") -> List[tf.Tensor]:
    if isinstance(tensors, (tf.Tensor, tf.Variable)):
        raise TypeError(f"{arg} must be a list of tensors, got a single tensor; wrap it in a "
                        "list")
    return [bridge.check_tensor(t, f"{arg}[{i}]") for i, t in enumerate(tensors)]


def _same_set(process_set: ProcessSet) -> ProcessSet:
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    return process_set


# -- allreduce ------------------------------------------------------------------------------
def _allreduce_dense(tensors: List[tf.Tensor], op: Any, prescale: float, postscale: float,
                     name: Optional[str], process_set: ProcessSet, kind: str) -> List[tf.Tensor]:
    """Reduce dense tensors (one call of ``kind``), differentiable for Average and Sum:
    Horovod's rule, the incoming gradients are reduced with the same op and scale factors."""
    name = bridge.graph_name(kind, name)

    def forward(inputs: List[tf.Tensor]) -> List[tf.Tensor]:
        def work(*arrays: np.ndarray) -> List[np.ndarray]:
            return core.reduce_group(core_memory.HOST, arrays, op, name, prescale, postscale,
                                     process_set, kind=kind, inplace=False,
                                     halves=arguments.ROUNDED_EACH)
        return _collective(work, inputs, [t.dtype for t in inputs], [t.shape for t in inputs],
                           name, process_set)

    def backward(inputs, outputs, upstream):
        _differentiable(kind, op)
        return _allreduce_dense(upstream, op, prescale, postscale, None, process_set, kind)

    return _with_gradient(forward, backward, tensors)


def _slices_op(op: Any) -> None:
    """Horovod's rule for IndexedSlices: any op but Sum and Average (Adasum too) raises
    NotImplementedError (the same on every rank, which passes the same op)."""
    if op is not None and (op not in (Average, Sum) or isinstance(op, bool)):
        raise NotImplementedError("Only Sum and Average ops are supported with "
                                  "tf.IndexedSlices")


def _allreduce_slices(slices: tf.IndexedSlices, op: Any, prescale: float, postscale: float,
                      name: Optional[str], process_set: ProcessSet) -> tf.IndexedSlices:
    """Reduce an IndexedSlices by the core's row allgather (rows with the same index summed;
    a dense allreduce where that moves fewer bytes)."""
    _slices_op(op)
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with "
                                  "tf.IndexedSlices")
    name = bridge.graph_name("allreduce", name)
    values = tf.convert_to_tensor(slices.values)
    # Without a dense_shape the table's rows are not known: the core counts them from the ids.
    rows_known = slices.dense_shape is not None
    shape = tf.cast(slices.dense_shape if rows_known else [-1], tf.int64)

    def work(rows: np.ndarray, ids: np.ndarray, shape: np.ndarray) -> List[np.ndarray]:
        mine_ids, mine_rows = sparse.merge_rows(ids, rows)
        union, summed, _ = sparse.allreduce_rows(mine_ids, mine_rows,
                                                 int(shape[0]) if rows_known else None,
                                                 name or _SPARSE, process_set=process_set)
        return [summed, union]

    out_values, out_ids = _collective(work, [values, slices.indices, shape],
                                      [values.dtype, tf.int64],
                                      [tf.TensorShape([None]).concatenate(values.shape[1:]),
                                       tf.TensorShape([None])], name, process_set,
                                      device=False)
    if op == Average:  # TensorFlow's division, as Horovod's: integers become floats
        out_values = out_values / tf.cast(process_set.size(), out_values.dtype)
    return tf.IndexedSlices(out_values, out_ids, dense_shape=slices.dense_shape)


@plain_python
def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: Optional[str] = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` (a tf.Tensor, tf.Variable or tf.IndexedSlices) across the process
    set: ``op`` (Average unless said otherwise) over every rank's ``tensor *
    prescale_factor``, times ``postscale_factor``; a new tensor.

    An IndexedSlices is reduced by the core's row allgather (Sum or Average, no scale
    factors), and the result holds each index once; its Average divides as TensorFlow's
    ``/`` does (integer values become floats), as in Horovod. ``compression`` changes what travels.
    ``device_dense``, ``device_sparse`` and ``ignore_name_scope`` are accepted for Horovod's
    sake and have no effect. Gradients flow through it (Average and Sum).
    """
    if isinstance(tensor, tf.IndexedSlices):
        _slices_op(op)
    op = checked("allreduce", name, process_set, lambda: (_same_set(process_set),
                                                          _reduce_op(op, average))[1])
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_slices(tensor, op, prescale_factor, postscale_factor, name,
                                 process_set)
    tensor = checked("allreduce", name, process_set,
                     lambda: bridge.check_tensor(tensor, "tensor"))
    compressed, ctx = compression.compress(tensor)
    reduced, = _allreduce_dense([compressed], op, prescale_factor, postscale_factor, name,
                                process_set, "allreduce")
    return compression.decompress(reduced, ctx)


@plain_python
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None) -> List[Any]:
    """:func:`allreduce` of each tensor of a list, the dense ones fused in one operation (the
    IndexedSlices each by the row allgather); new tensors in order."""
    if not tensors:
        return list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        _slices_op(op)
    op = checked("grouped_allreduce", name, process_set,
                 lambda: (_same_set(process_set), _reduce_op(op, average))[1])
    results: List[Any] = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _allreduce_slices(t, op, prescale_factor, postscale_factor,
                                           None if name is None else f"{name}.{i}",
                                           process_set)
    if dense:
        checked_tensors = checked("grouped_allreduce", name, process_set,
                                  lambda: _tensors([tensors[i] for i in dense]))
        packed = [compression.compress(t) for t in checked_tensors]
        reduced = _allreduce_dense([t for t, _ in packed], op, prescale_factor,
                                   postscale_factor, name, process_set, "grouped_allreduce")
        for i, r, (_, ctx) in zip(dense, reduced, packed):
            results[i] = compression.decompress(r, ctx)
    return results


# -- allgather ------------------------------------------------------------------------------
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
        _same_set(process_set), bridge.check_tensor(tensor, "tensor"))[1])

    name = bridge.graph_name("allgather", name)

    def forward(inputs):
        x = inputs[0]
        return _collective(lambda a: [core.allgather(a, name, process_set)], [x], [x.dtype],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None], name, process_set)

    return _with_gradient(forward, lambda inputs, outputs, upstream:
                          _gather_gradient(upstream, inputs, process_set), [tensor])[0]


@plain_python
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """:func:`allgather` each tensor of a list, agreed on in one exchange."""
    tensors = checked("grouped_allgather", name, process_set, lambda: (
        _same_set(process_set), _tensors(tensors))[1])
    if not tensors:
        return []
    name = bridge.graph_name("grouped_allgather", name)

    def forward(inputs):
        return _collective(lambda *arrays: core.grouped_allgather(list(arrays), name,
                                                                  process_set),
                           inputs, [x.dtype for x in inputs],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None for x in inputs], name, process_set)

    return _with_gradient(forward, lambda inputs, outputs, upstream:
                          _gather_gradient(upstream, inputs, process_set), tensors)


# -- broadcast ------------------------------------------------------------------------------
@plain_python
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (``root_rank`` is a global
    rank, also on a process set). Gradients, Horovod's rule: averaged across the set into the
    root; zeros on the other ranks."""
    tensor = checked("broadcast", name, process_set, lambda: (
        _same_set(process_set), bridge.check_tensor(tensor, "tensor"))[1])

    name = bridge.graph_name("broadcast", name)

    def forward(inputs):
        x = inputs[0]
        return _collective(lambda a: [core.broadcast(a, root_rank, name, process_set)], [x],
                           [x.dtype], [x.shape], name, process_set)

    def backward(inputs, outputs, upstream):
        grad = allreduce(upstream[0], op=Average, process_set=process_set)
        if rank() == root_rank:
            return [grad]
        # Zeros that depend on the allreduce: in a TF1 graph an op nothing depends on does
        # not run, and the root would wait for this rank's part forever.
        with tf.control_dependencies([grad]):
            return [tf.identity(tf.zeros_like(grad))]

    return _with_gradient(forward, backward, [tensor])[0]


def _broadcast_group(values: List[tf.Tensor], root_rank: int, name: Optional[str],
                     process_set: ProcessSet) -> List[tf.Tensor]:
    """The root's values of ``values``, broadcast one after the other in one op."""
    name = bridge.graph_name("broadcast_variables", name)

    def work(*arrays):
        names = arguments.tensor_names(name or "broadcast_variables", len(arrays))
        return [core.broadcast(a, root_rank, n, process_set) for a, n in zip(arrays, names)]

    return _collective(work, values, [v.dtype for v in values], [v.shape for v in values],
                       name, process_set)


@plain_python
def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Overwrite each variable with ``root_rank``'s value, in place; returns their new
    values."""
    variables = list(variables)
    checked("broadcast", name, process_set, lambda: [
        _same_set(process_set)] + [_variable(v, f"variables[{i}]")
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


# -- alltoall -------------------------------------------------------------------------------
@plain_python
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set
             ) -> Union[tf.Tensor, Tuple[tf.Tensor, tf.Tensor]]:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank i of the set; return
    what arrives and, when ``splits`` is given, the rows received from each rank (int32), as
    Horovod does. Without ``splits`` dim 0 is divided equally. Gradients go back by an
    alltoall with the received splits."""
    tensor = checked("alltoall", name, process_set, lambda: (
        _same_set(process_set), bridge.check_tensor(tensor, "tensor"))[1])
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

        return _collective(work, [x, given], [x.dtype, tf.int32],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None, tf.TensorShape([None])], name,
                           process_set, device=False)

    def backward(inputs, outputs, upstream):
        grad, _ = alltoall(upstream[0], splits=outputs[1], process_set=process_set)
        return [grad]

    output, received = _with_gradient(forward, backward, [tensor])
    return output if splits is None else (output, tf.stop_gradient(received))


# -- reducescatter --------------------------------------------------------------------------
def _scatter_reduce(tensors: List[tf.Tensor], op: Any, prescale: float, postscale: float,
                    name: Optional[str], process_set: ProcessSet, kind: str) -> List[tf.Tensor]:
    """Reducescatter (one call of ``kind``), differentiable: Horovod's rule, the incoming
    gradients times the scale factors (and the set's size for Sum), gathered."""
    name = bridge.graph_name(kind, name)

    def forward(inputs):
        def work(*arrays: np.ndarray) -> List[np.ndarray]:
            return core.scatter_reduce(core_memory.HOST, arrays, op, name, process_set,
                                       prescale, postscale, kind, arguments.ROUNDED_EACH)

        return _collective(work, inputs, [x.dtype for x in inputs],
                           [tf.TensorShape([None]).concatenate(x.shape[1:])
                            if x.shape.rank else None for x in inputs], name, process_set)

    def backward(inputs, outputs, upstream):
        _differentiable(kind, op)
        factor = prescale * postscale * (process_set.size() if op == Sum else 1)
        return [allgather(g * tf.cast(factor, g.dtype) if factor != 1.0 else g,
                          process_set=process_set) for g in upstream]

    return _with_gradient(forward, backward, tensors)


@plain_python
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` across the set and return this rank's rows of the result (dim 0
    split as evenly as possible, lower ranks taking one more); gradients flow through it."""
    op, tensor = checked("reducescatter", name, process_set, lambda: (
        _same_set(process_set), _reduce_op(op, None), bridge.check_tensor(tensor, "tensor"))[1:])
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
        _same_set(process_set), _reduce_op(op, None), _tensors(tensors))[1:])
    packed = [compression.compress(t) for t in tensors]
    shares = _scatter_reduce([t for t, _ in packed], op, prescale_factor, postscale_factor,
                             name, process_set, "grouped_reducescatter")
    return [compression.decompress(s, c) for s, (_, c) in zip(shares, packed)]


# -- objects and the rest -------------------------------------------------------------------
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
