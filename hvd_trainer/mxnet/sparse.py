"""Row-sparse gradients (``sparse_grad=True``) between NDArrays and the core's ``(ids, rows)``.

The reduced gradient is written back into each context's own row_sparse gradient NDArray,
so autograd keeps writing the next step's gradient there and the optimizer sees a row_sparse
gradient, which keeps its lazy updates lazy. The result is built from NDArrays that adopt
the NumPy arrays (no copy) and copied in with ``copyto``, which resizes the gradient's rows:
about 5 ms for 80k rows of 64 floats, against 40 ms when ``row_sparse_array`` is given the
NumPy arrays themselves.
"""
from typing import Optional, Tuple

import mxnet as mx
import numpy as np

from ..collectives import sparse
from . import bridge
from .sparse_weights import weight_arrays


def local_rows(param: mx.gluon.Parameter) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """This process's fresh row-sparse gradient as unique ids and rows, summed over contexts.

    Returns None when no context has a fresh gradient.
    """
    fresh = [g for d, g in zip(weight_arrays(param), param.list_grad()) if d._fresh_grad]
    if not fresh:
        return None
    parts = [(bridge.read_view(g.indices), bridge.read_view(g.data)) for g in fresh]
    if len(parts) == 1:
        return parts[0][0].astype(sparse.ID_DTYPE, copy=False), parts[0][1]
    return sparse.merge_rows(np.concatenate([ids for ids, _ in parts]),
                             np.concatenate([rows for _, rows in parts]))


def publish_rows(param: mx.gluon.Parameter, ids: np.ndarray, rows: np.ndarray) -> None:
    """Write the reduced rows into every context's gradient and mark it fresh there.

    ``ids`` and ``rows`` become read-only: the result's NDArrays adopt their memory.
    """
    grads = param.list_grad()
    ctx, dtype = grads[0].context, grads[0].dtype
    reduced = mx.nd.sparse.row_sparse_array(
        (bridge.to_ndarray(rows.astype(dtype, copy=False), ctx), bridge.to_ndarray(ids, ctx)),
        shape=grads[0].shape, ctx=ctx, dtype=dtype)
    for grad in grads:
        reduced.copyto(grad)
    for data in weight_arrays(param):
        data._fresh_grad = True
