"""Reducing a step's gradients across ranks: the reduction that ``DistributedGradientTape``
(tape.py) and the Keras ``DistributedOptimizer`` share.

A step's gradients go to the core's :class:`~hvd_trainer.training.array_reducer.ArrayReducer` in one
call: dense ones as arrays (copied into buckets), ``tf.IndexedSlices`` as row-sparse
``(ids, rows)`` (summed by the core's row allgather, or by a dense allreduce where that moves
fewer bytes), missing ones (None) as zeros from this rank. The reduced gradients are
Average (the sum times ``gradient_predivide_factor / size`` after ``1 / factor`` before) or
Sum. Eagerly this happens at the call; in a ``tf.function`` it is one op (bridge.py).

What comes back: a dense gradient stays dense and an IndexedSlices stays an IndexedSlices
(with each touched index once); the ranks agree on one form per variable, so a rank whose
gradient had the other form gets the agreed sum in its own form. A gradient missing on this
rank comes back as the others' sum when eager, and as None in a graph (where a missing
gradient is a property of the graph, the same on every rank).
"""
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import compression as core_compression
from ..training.array_reducer import ArrayReducer
from ..collectives.arguments import Average, Sum
from ..training.buckets import check_settings
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .compression import Compression, FP16Compressor
from .errors import raises_tensorflow_errors
from .ops import Adasum

# One reducer per prefix, settings and set of gradient shapes: tapes are made anew each step.
_reducers: Dict[Tuple[Any, ...], ArrayReducer] = {}


def check_reduction(op: Any, gradient_predivide_factor: float, num_groups: int) -> None:
    """Refuse what DistributedGradientTape and DistributedOptimizer do not take."""
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by hvd_trainer.tensorflow; use "
                         "op=hvd.Average or op=hvd.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"op={op!r}: gradients are reduced with op=hvd.Average or op=hvd.Sum")
    if op != Average and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average; pass "
                         "gradient_predivide_factor=1.0 with op=hvd.Sum")
    check_settings(gradient_predivide_factor, num_groups)


class Reduction:
    """How a tape or optimizer reduces its gradients (Horovod's keyword arguments)."""

    def __init__(self, prefix: str, compression: Any = Compression.none,
                 sparse_as_dense: bool = False, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set):
        check_reduction(op, gradient_predivide_factor, num_groups)
        self.prefix = prefix
        self.compression = (core_compression.Compression.fp16 if compression is FP16Compressor
                            else compression)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.op = op
        self.predivide = float(gradient_predivide_factor)
        self.num_groups = int(num_groups)
        self.process_set = process_set

    def _reducer(self, shapes: List[Tuple[int, ...]], dtypes: List[np.dtype]) -> ArrayReducer:
        key = (self.prefix, self.compression, self.sparse_as_dense, self.predivide,
               self.num_groups, self.process_set.process_set_id, tuple(shapes),
               tuple(d.str for d in dtypes))
        reducer = _reducers.get(key)
        if reducer is None:
            reducer = _reducers[key] = ArrayReducer(
                shapes, dtypes, prefix=self.prefix, compression=self.compression,
                gradient_predivide_factor=self.predivide, num_groups=self.num_groups,
                sparse_as_dense=self.sparse_as_dense, process_set=self.process_set)
        return reducer

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """``grads`` (of ``variables``, in order) reduced across the process set; unchanged on
        a rank outside it or in a set of one."""
        grads = [tf.convert_to_tensor(g) if self.sparse_as_dense
                 and isinstance(g, tf.IndexedSlices) else g for g in grads]
        if not self.process_set.included() or self.process_set.size() == 1 or not grads:
            return list(grads)
        shapes, dtypes = zip(*(_described(g, v, i)
                               for i, (g, v) in enumerate(zip(grads, variables))))
        reducer = self._reducer(list(shapes), list(dtypes))
        inputs: List[tf.Tensor] = []
        static: List[Any] = []  # the outputs' shapes as far as known before the reduction
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                inputs += [tf.convert_to_tensor(g.values), tf.cast(g.indices, tf.int64)]
                static += [tf.TensorShape([None]).concatenate(g.values.shape[1:]),
                           tf.TensorShape([None])]
            elif g is not None:
                inputs.append(tf.convert_to_tensor(g))
                static.append(g.shape)
        forms = [None if g is None else isinstance(g, tf.IndexedSlices) for g in grads]

        def work(*arrays: np.ndarray) -> List[Any]:
            values, at = [], 0
            for form in forms:
                if form is None:
                    values.append(None)
                elif form:
                    values.append((arrays[at + 1], arrays[at]))
                    at += 2
                else:
                    values.append(arrays[at])
                    at += 1
            # The set's size when the reduction runs, not when a graph was traced: a job that
            # hvdrun --ulfm shrank averages over its survivors.
            postscale = self.predivide / self.process_set.size() if self.op == Average else 1.0
            return reducer.reduce(values, postscale)

        work = raises_tensorflow_errors(work)
        if bridge.eager():
            results = work(*[bridge.to_numpy(t) for t in inputs])
            return [_eager_result(r, g, shape) for r, g, shape in zip(results, grads, shapes)]
        return self._in_graph(work, inputs, static, grads, shapes)

    def reduce_shared(self, grads: Sequence[Any], variables: Sequence[Any], local: set,
                      scale_local: bool) -> List[Any]:
        """:meth:`reduce`, except for the gradients of the variables whose ids are in
        ``local``: those stay this rank's, divided by the set's size when ``scale_local``
        (Horovod's ``scale_local_gradients``)."""
        shared = [i for i, v in enumerate(variables) if id(v) not in local]
        result = list(grads)
        reduced = self.reduce([grads[i] for i in shared], [variables[i] for i in shared])
        for i, g in zip(shared, reduced):
            result[i] = g
        size = self.process_set.size()
        if scale_local and local and size > 1:
            for i, v in enumerate(variables):
                g = result[i]
                if id(v) in local and g is not None:
                    result[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                                 if isinstance(g, tf.IndexedSlices) else g / size)
        return result

    def _in_graph(self, work: Any, inputs: List[tf.Tensor], static: List[Any],
                  grads: Sequence[Any],
                  shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        """The reduction as one op of the graph being built; each output in its gradient's
        local form."""
        def local(*arrays: np.ndarray) -> List[np.ndarray]:
            out = []
            for r, g, shape in zip(work(*arrays), grads, shapes):
                if isinstance(g, tf.IndexedSlices):
                    ids, rows = r if isinstance(r, tuple) else (np.arange(shape[0]), r)
                    out += [rows, ids]
                elif g is not None:
                    out.append(_table(r, shape) if isinstance(r, tuple) else r)
            return out

        outputs = bridge.call(local, inputs, [t.dtype for t in inputs], static,
                              self.prefix + "step")
        results, at = [], 0
        for g in grads:
            if g is None:
                results.append(None)
            elif isinstance(g, tf.IndexedSlices):
                results.append(tf.IndexedSlices(outputs[at], outputs[at + 1], g.dense_shape))
                at += 2
            else:
                results.append(outputs[at])
                at += 1
        return results


def _described(grad: Any, variable: Any, i: int) -> Tuple[Tuple[int, ...], np.dtype]:
    """The dense shape and dtype of gradient ``i``, from its variable."""
    shape = tf.TensorShape(getattr(variable, "shape", None))
    if not shape.is_fully_defined() and grad is not None and \
            not isinstance(grad, tf.IndexedSlices):
        shape = grad.shape
    if not shape.is_fully_defined():
        raise ValueError(f"source {i} has shape {shape}, not fully defined; gradients are "
                         "reduced for variables or tensors of known shape")
    dtype = tf.as_dtype(variable.dtype if grad is None else grad.dtype)
    return tuple(shape.as_list()), np.dtype(dtype.as_numpy_dtype)


def _table(rows: Tuple[np.ndarray, np.ndarray], shape: Tuple[int, ...]) -> np.ndarray:
    table = np.zeros(shape, rows[1].dtype)
    table[rows[0]] = rows[1]
    return table


def _eager_result(result: Any, grad: Any, shape: Tuple[int, ...]) -> Any:
    """A reduced gradient as a tensor: an IndexedSlices where the gradient was one here (or,
    missing here, where the ranks agreed on rows)."""
    if result is None:
        return None
    if isinstance(result, tuple):
        if grad is None or isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.convert_to_tensor(result[1]),
                                    tf.convert_to_tensor(result[0]),
                                    tf.constant(shape, tf.int64))
        return tf.convert_to_tensor(_table(result, shape))
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.convert_to_tensor(result),
                                tf.range(shape[0], dtype=tf.int64), tf.constant(shape, tf.int64))
    return tf.convert_to_tensor(result)
