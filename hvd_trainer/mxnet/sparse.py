"""Row-sparse gradients (``sparse_grad=True``) between NDArrays and the core's ``(ids, rows)``.

The reduced gradient is written back into each context's own row_sparse gradient NDArray
(``copyto`` replaces its rows in place), so autograd keeps writing the next step's gradient
there and the optimizer sees a row_sparse gradient, which keeps its lazy updates lazy.
"""
from typing import Optional, Tuple

import mxnet as mx
import numpy as np

from .. import sparse


def local_rows(param: mx.gluon.Parameter) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """This process's fresh row-sparse gradient as unique ids and rows, summed over contexts.

    Returns None when no context has a fresh gradient.
    """
    fresh = [g for d, g in zip(param.list_data(), param.list_grad()) if d._fresh_grad]
    if not fresh:
        return None
    if len(fresh) == 1:
        return fresh[0].indices.asnumpy().astype(sparse.ID_DTYPE), fresh[0].data.asnumpy()
    return sparse.merge_rows(np.concatenate([g.indices.asnumpy() for g in fresh]),
                             np.concatenate([g.data.asnumpy() for g in fresh]))


def no_rows(param: mx.gluon.Parameter) -> Tuple[np.ndarray, np.ndarray]:
    """A stale rank's contribution: no ids and no rows."""
    grad = param.list_grad()[0]
    return (np.empty(0, sparse.ID_DTYPE),
            np.empty((0,) + grad.shape[1:], np.dtype(grad.dtype)))


def publish_rows(param: mx.gluon.Parameter, ids: np.ndarray, rows: np.ndarray) -> None:
    """Write the reduced rows into every context's gradient and mark it fresh there."""
    for grad in param.list_grad():
        reduced = mx.nd.sparse.row_sparse_array((rows, ids), shape=grad.shape,
                                                ctx=grad.context, dtype=grad.dtype)
        reduced.copyto(grad)
    for data in param.list_data():
        data._fresh_grad = True
