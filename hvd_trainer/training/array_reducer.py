"""Reducing a set of gradients handed over all at once as NumPy arrays: the core's
:class:`~hvd_trainer.training.reducer.Reducer` with host buckets that this module owns.

For adapters whose framework produces a whole step's gradients at once as values that cannot
become views of a bucket (TensorFlow's immutable tensors, from ``GradientTape.gradient`` or a
Keras optimizer's ``apply``). Each step copies the dense gradients into fresh flat buckets
(the one copy; the results are views of them), compressed or not, hands the others (row-sparse,
0-d) over as they are, and lets the reducer do the rest: one agreement, each bucket through its
comm hook, row-sparse gradients, stale ranks' zeros, autotuning.

**Kinds.** A gradient is dense (an array), row-sparse (``(ids, rows)``, ids may repeat) or
missing on a rank (None: that rank contributes zeros). The ranks agree on each gradient's
kind, dense winning over row-sparse, in one small allreduce at the steps in which a gradient
has had no kind agreed yet (usually the first only; :func:`hvd_trainer.training.kinds.agree_kinds`);
a rank whose gradient has the other form converts it. A gradient missing on every rank so far stays out of the step.
The kinds are agreed again once the job starts again on other ranks (hvdrun --ulfm's shrink,
a growth in place): a new rank knows none, and its reducer is made at its first step.
"""
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..collectives import sparse
from ..compression import Compression
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set
from .buckets import Gradient
from .kinds import DENSE, NONE, agree_kinds
from .reducer import Reducer

Rows = Tuple[np.ndarray, np.ndarray]
Value = Union[None, np.ndarray, Rows]
SPARSE = 1  # the agreed kind of a row-sparse gradient (see kinds.py: the largest kind wins)


class ArrayReducer:
    """Sums a fixed set of gradients, described by their dense ``shapes`` and ``dtypes``,
    across ``process_set`` at each :meth:`reduce` (a collective of the set's members).

    ``compression``, ``gradient_predivide_factor``, ``num_groups``, ``sparse_as_dense`` and
    ``prefix`` are the :class:`Reducer`'s.
    """

    def __init__(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[Any], *,
                 prefix: str = "", compression: Any = Compression.none,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set):
        if len(shapes) != len(dtypes):
            raise ValueError(f"{len(shapes)} shapes but {len(dtypes)} dtypes; give one of each "
                             "per gradient")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self.kinds = self._unagreed()
        self.reducer = Reducer(prefix=prefix, compression=compression,
                               gradient_predivide_factor=gradient_predivide_factor,
                               num_groups=num_groups, sparse_as_dense=sparse_as_dense,
                               process_set=process_set)
        self._agreed_on: Any = None  # the communicator on which the kinds were agreed

    def reduce(self, values: Sequence[Value], postscale: float = 1.0) -> List[Value]:
        """Sum each gradient across the process set, times ``postscale`` (on more than one
        rank the reducer has already divided by ``gradient_predivide_factor``); return per gradient its agreed
        kind's form (an array, or unique sorted ``(ids, rows)``), or None where no rank has
        had one. A collective: every member calls it once per step, with the same gradients.
        """
        if len(values) != len(self.shapes):
            raise ValueError(f"{len(values)} gradients given, {len(self.shapes)} expected")
        self._agree_kinds(values)
        keys = [k for k, kind in enumerate(self.kinds) if kind != NONE]
        self.reducer.set_gradients([Gradient(k, self.shapes[k], self.dtypes[k].str,
                                             sparse=self.kinds[k] == SPARSE) for k in keys])
        flats, place = [], {}
        for bucket in self.reducer.buckets:
            flat = np.empty(bucket.bounds[-1], bucket.dtype)
            flats.append(flat)
            bucket.open = (lambda f: lambda: f)(flat)
            for k, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                place[k] = flat[start:end].reshape(self.shapes[k])
        ready = []
        for k in keys:
            value = values[k]
            if value is None:
                continue  # stale here: the reducer adds zeros for this rank
            if self.kinds[k] == SPARSE:
                ready.append((k, self._rows(k, value)))
            elif k in place:
                place[k][...] = self._dense(k, value)
                ready.append((k, None))
            else:
                ready.append((k, np.array(self._dense(k, value), self.dtypes[k], order="C")))
        self.reducer.mark_all(ready)
        step, _ = self.reducer.close()
        results, _ = self.reducer.finish(step)
        out: List[Value] = [None] * len(self.shapes)
        for k in keys:
            if not self.reducer.fresh(step, k):
                continue
            result = place[k] if k in place else results[k]
            if postscale != 1.0:
                rows = result[1] if self.kinds[k] == SPARSE else result
                rows *= np.asarray(postscale).astype(rows.dtype)
            out[k] = result
        return out

    def _unagreed(self) -> List[int]:
        """The kinds before any agreement: dense under ``sparse_as_dense``, else none yet."""
        return [DENSE if self.sparse_as_dense else NONE] * len(self.shapes)

    def _agree_kinds(self, values: Sequence[Value]) -> None:
        """Agree on the kinds not agreed yet (a small allreduce, only when there are any)."""
        comm = runtime.communicator(self.process_set)
        if comm is not self._agreed_on:  # a start, or the job started again on other ranks
            self.kinds = self._unagreed()
            self._agreed_on = comm
        undecided = [k for k, kind in enumerate(self.kinds) if kind == NONE]
        if not undecided:
            return
        agree_kinds(self.kinds, undecided, [_kind(values[k]) for k in undecided],
                    f"{self.reducer.prefix}gradient_kinds", self.process_set)

    def _dense(self, k: int, value: Union[np.ndarray, Rows]) -> np.ndarray:
        """Gradient ``k`` as a dense array (rows scattered into zeros, repeats summed)."""
        if not isinstance(value, tuple):
            return np.asarray(value).reshape(self.shapes[k])
        ids, rows = sparse.merge_rows(*value)
        table = np.zeros(self.shapes[k], self.dtypes[k])
        table[ids] = rows
        return table

    def _rows(self, k: int, value: Union[np.ndarray, Rows]) -> Rows:
        """Gradient ``k`` as unique ``(ids, rows)`` (a dense one as all its rows)."""
        if isinstance(value, tuple):
            ids, rows = sparse.merge_rows(*value)
            return ids, np.ascontiguousarray(rows, self.dtypes[k])
        table = np.ascontiguousarray(np.asarray(value).reshape(self.shapes[k]), self.dtypes[k])
        return np.arange(table.shape[0], dtype=sparse.ID_DTYPE), table


def _kind(value: Value) -> int:
    if value is None:
        return NONE
    return SPARSE if isinstance(value, tuple) else DENSE
