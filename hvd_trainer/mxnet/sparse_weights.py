"""Row-sparse weights (``stype='row_sparse'``): every rank holds the whole weight, served by rows.

``gluon.Trainer`` keeps such a weight in its KVStore: ``Parameter.row_sparse_data(row_id)``
calls the trainer's ``_row_sparse_pull``, which copies the rows a batch needs from the
KVStore's copy into the parameter's array, and the KVStore applies the optimizer to its copy
with the summed row_sparse gradient. DistributedTrainer has no KVStore, so :class:`SparseWeights`
takes that part on every rank: it holds each weight as the KVStore stores it (a row_sparse
NDArray holding every row), serves rows from it, and applies the optimizer to it once per step
through MXNet's own updater, after the trainer has summed the gradient rows across ranks
(:mod:`hvd_trainer.collectives.sparse`). Lazy updates (``lazy_update=True``, SGD's and Adam's
default) thus touch only rows some rank touched, and every rank's copy equals a gluon.Trainer's on
the global batch.

A row_sparse weight may also have a dense gradient (``grad_stype='default'``). gluon.Trainer
means to push it to the KVStore, which updates its whole copy of the weight with it (every
row, as a dense weight would be updated); MXNet 1.9.1's gluon.Trainer fails before that
(``step`` asks the weight for ``list_data()``, which row_sparse weights refuse). Here the
trainer allreduces such a gradient like any dense one, and :meth:`SparseWeights.update`
applies it to the whole weight, which is what that KVStore update does.
"""
from typing import Any, Callable, Dict, List, Sequence, Union

import mxnet as mx
import numpy as np

from ..collectives import ops
from ..runtime.runtime import ProcessSet


def weight_arrays(param: mx.gluon.Parameter) -> List[mx.nd.NDArray]:
    """Every context's weight array, dense or row_sparse (``list_data()`` refuses row_sparse)."""
    return param._check_and_get(param._data, list)


def check(param: mx.gluon.Parameter) -> None:
    """Raise ValueError naming ``param`` unless it is a weight :class:`SparseWeights` can hold."""
    if param._stype != "row_sparse":
        raise ValueError(f"Parameter {param.name!r} has stype={param._stype!r}; "
                         "DistributedTrainer takes dense (the default) and 'row_sparse' weights")
    if param._grad_stype not in ("row_sparse", "default"):
        raise ValueError(f"Parameter {param.name!r} has stype='row_sparse' and a "
                         f"{param._grad_stype!r} gradient; DistributedTrainer takes "
                         "grad_stype='row_sparse' (as contrib.nn.SparseEmbedding has) or "
                         "'default'")
    if param._data is None and param._deferred_init:
        raise ValueError(f"Parameter {param.name!r} is a row_sparse weight whose shape is not "
                         "known yet; give it its full shape and initialize it before creating "
                         "the trainer")


def _dense(values: Union[mx.nd.NDArray, np.ndarray]) -> np.ndarray:
    """Host values of a dense or row_sparse NDArray (rows it lacks are zeros), or of an array."""
    if isinstance(values, mx.nd.NDArray):
        return values.tostype("default").asnumpy()
    return np.asarray(values)


class SparseWeights:
    """The trainer's whole copy of each row_sparse weight, keyed by the parameter's index.

    A copy lives on the parameter's first context. It is taken from the root rank at
    construction when ``ranks`` > 1 (a broadcast on ``process_set``, named like the dense
    weights') and replaced, locally, whenever ``param.set_data`` runs (``load_parameters``
    included), as that resets gluon.Trainer's KVStore copy.
    """

    def __init__(self, params: Sequence[mx.gluon.Parameter], prefix: str, root_rank: int,
                 process_set: ProcessSet, ranks: int):
        self._params = {i: p for i, p in enumerate(params) if p._stype != "default"}
        self._index = {id(p): i for i, p in self._params.items()}
        self._whole: Dict[int, mx.nd.NDArray] = {}
        for i, param in self._params.items():
            values = _dense(weight_arrays(param)[0])
            if ranks > 1:
                ops.broadcast_(values, root_rank, f"{prefix}param.{i}", process_set)
            self._replace(i, values)
            param.set_data = self._following_set_data(i, param.set_data)

    def __contains__(self, index: int) -> bool:
        return index in self._params

    def __bool__(self) -> bool:
        return bool(self._params)

    def _replace(self, index: int, values: np.ndarray) -> None:
        """Make ``values`` (every row, dense) the whole weight of parameter ``index``."""
        param = self._params[index]
        rows = np.arange(values.shape[0], dtype=np.int64)
        # Every row is stored, zeros included: MXNet's sparse optimizer kernels require it.
        self._whole[index] = mx.nd.sparse.row_sparse_array(
            (values, rows), shape=values.shape, ctx=param.list_ctx()[0], dtype=param.dtype)

    def _following_set_data(self, index: int, set_data: Callable[[Any], None]
                            ) -> Callable[[Any], None]:
        """``set_data`` that also replaces the whole weight with the new value."""
        def set_data_and_whole(data: Any) -> None:
            set_data(data)
            self._replace(index, _dense(data).astype(self._params[index].dtype, copy=False))
        return set_data_and_whole

    def pull(self, param: mx.gluon.Parameter, out: Union[mx.nd.NDArray, List[mx.nd.NDArray]],
             row_id: mx.nd.NDArray, full_idx: bool = False) -> None:
        """Copy the rows ``row_id`` names (every row with ``full_idx``) into ``out``.

        ``out`` (an array or a list of arrays) becomes row_sparse with exactly those rows,
        sorted and unique, as ``KVStore.row_sparse_pull`` leaves it. Ids are cast to integers
        as ``Embedding`` does; one outside ``[0, rows)`` raises ValueError.
        """
        whole = self._whole[self._index[id(param)]]
        if full_idx:
            rows = whole
        else:
            ids = np.unique(row_id.asnumpy().astype(np.int64).reshape(-1))
            if ids.size and (ids[0] < 0 or ids[-1] >= whole.shape[0]):
                bad = ids[0] if ids[0] < 0 else ids[-1]
                raise ValueError(f"row_sparse_data of Parameter {param.name!r}: row id {bad} is "
                                 f"outside [0, {whole.shape[0]})")
            rows = mx.nd.sparse.retain(whole, mx.nd.array(ids, ctx=whole.context, dtype=np.int64))
        with mx.autograd.pause():  # forward asks for rows while recording
            for array in (out if isinstance(out, (list, tuple)) else [out]):
                rows.copyto(array)

    def update(self, updater: Callable[..., None], index: int, ignore_stale_grad: bool) -> None:
        """Apply the optimizer once to the whole weight with the first context's gradient.

        The trainer has already made every context's gradient the sum over ranks and contexts
        (and fresh on all of them, or on none). Without a fresh gradient the weight is left
        alone under ``ignore_stale_grad``, like a dense weight.
        """
        param = self._params[index]
        arrays = weight_arrays(param)
        if ignore_stale_grad and not any(a._fresh_grad for a in arrays):
            return
        updater(index, param.list_grad()[0], self._whole[index])
        for array in arrays:
            array._fresh_grad = False

    def value(self, index: int) -> np.ndarray:
        """The whole weight as a dense host array (a copy)."""
        return _dense(self._whole[index])

    def assign(self, index: int, values: np.ndarray) -> None:
        """Replace the whole weight with ``values``, on this rank alone."""
        self._replace(index, np.asarray(values, self._params[index].dtype))
