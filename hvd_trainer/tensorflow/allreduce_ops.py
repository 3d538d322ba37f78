"""horovod.tensorflow's allreduce and grouped_allreduce on tf.Tensor, tf.Variable and
tf.IndexedSlices, with Horovod's gradient rule (the incoming gradients are reduced with the
same op and scale factors)."""
from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..collectives import arguments, sparse
from ..collectives import memory as core_memory
from ..collectives import ops as core
from ..collectives.arguments import Average, Sum
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .bridge import plain_python
from .calls import (checked, collective, differentiable, reduce_op, same_set, tensor_list,
                    with_gradient)
from .compression import Compression

_SPARSE = "allreduce.indexed_slices"  # the base name of an unnamed IndexedSlices allreduce


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
        return collective(work, inputs, [t.dtype for t in inputs], [t.shape for t in inputs],
                           name, process_set)

    def backward(inputs, outputs, upstream):
        differentiable(kind, op)
        return _allreduce_dense(upstream, op, prescale, postscale, None, process_set, kind)

    return with_gradient(forward, backward, tensors)


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

    out_values, out_ids = collective(work, [values, slices.indices, shape],
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
    op = checked("allreduce", name, process_set, lambda: (same_set(process_set),
                                                          reduce_op(op, average))[1])
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
                 lambda: (same_set(process_set), reduce_op(op, average))[1])
    results: List[Any] = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _allreduce_slices(t, op, prescale_factor, postscale_factor,
                                           None if name is None else f"{name}.{i}",
                                           process_set)
    if dense:
        checked_tensors = checked("grouped_allreduce", name, process_set,
                                  lambda: tensor_list([tensors[i] for i in dense]))
        packed = [compression.compress(t) for t in checked_tensors]
        reduced = _allreduce_dense([t for t, _ in packed], op, prescale_factor,
                                   postscale_factor, name, process_set, "grouped_allreduce")
        for i, r, (_, ctx) in zip(dense, reduced, packed):
            results[i] = compression.decompress(r, ctx)
    return results
