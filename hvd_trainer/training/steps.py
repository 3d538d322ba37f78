"""The step protocol around a :class:`~hvd_trainer.training.reducer.Reducer`, once for every
adapter.

An adapter (the torch ``DistributedOptimizer``, the MXNet ``DistributedTrainer``) bridges its
framework's tensors: it backs the reducer's buckets with its flat storage, turns gradients into
arrays or (ids, rows), and publishes the results. What happens around the reducer in a step is
here, so that a fix reaches every adapter:

- **Readiness.** :meth:`Steps.mark` marks one gradient ready (from a per-parameter hook during
  backward), :meth:`Steps.mark_all` many at once (step time). Marks of bucketed gradients are
  batched: a bucket goes to the reducer in one call once all its members are in, one lock and
  one wake-up of the step's program per bucket instead of per gradient. With an eager reducer
  the step begins at its first mark (see the reducer's ``begin``).
- **Early close.** From its beginning until it is closed, a step is the thread's *closer*
  (:func:`hvd_trainer.coordination.work_order.on_own_collective`): a collective that the thread
  which began it starts before :meth:`Steps.close` first closes it, as ``close()`` would (gradients
  not marked by then count as stale on this rank: zeros), so the step does not wait for
  ``close()`` while ``close()`` waits for that collective. Not while ``inside()`` says the
  thread still computes gradients (a collective made by an autograd function in backward).
  A step that begins and closes in one call (step-time readiness) never is a closer.
- **Kinds.** Which gradients are row-sparse may show only in backward, and a rank that has no
  gradient for a parameter cannot tell. The ranks agree on each gradient's kind (:data:`NONE`,
  a number of sparse dimensions, :data:`DENSE`; the largest wins, so dense beats sparse) in
  one small allreduce after the steps in which some gradient has had no kind agreed yet
  (usually the first step only). Until then a gradient travels in its bucket: a sparse one
  travels densely in the step that reveals it, is summed by rows as well (the result is taken
  from those), and leaves the buckets from the next step on. After ``join()`` the ranks take
  the kinds that were decided while a rank was joined.
- **Finish.** :meth:`Steps.finish` waits for each bucket in launch order, hands it to the
  adapter (postscale, copies to other devices, per-bucket updates), finishes the reducer,
  agrees on the kinds and lets the adapter back any new layout of buckets.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..collectives import arguments, joined, ops
from ..coordination import work_order
from .buckets import Bucket, Gradient, ReducerStep
from .reducer import Reducer

NONE = 0     # no rank has had a gradient for the parameter yet
DENSE = 64   # a dense gradient; a row-sparse one with s sparse dimensions has the kind s

Rows = Tuple[np.ndarray, np.ndarray]


def table_shape(shape: Sequence[int], sparse_dim: int) -> Tuple[int, ...]:
    """The (rows, ...) shape of a tensor of ``shape`` with ``sparse_dim`` sparse dimensions."""
    return (int(np.prod(shape[:sparse_dim], dtype=np.int64)),) + tuple(shape[sparse_dim:])


def agree_kinds(kinds: List[int], keys: Sequence[int], mine: Sequence[int], name: str,
                process_set: Any) -> List[int]:
    """Set ``kinds[k]`` for each of ``keys`` to the largest of the ranks' kinds (``mine`` here)
    and return the keys agreed row-sparse. A collective (a small allreduce over the set)."""
    agreed = ops.allreduce(np.array(mine, np.int8), arguments.Max, name, process_set=process_set)
    for k, kind in zip(keys, agreed):
        kinds[k] = int(kind)
    return [k for k, kind in zip(keys, agreed) if NONE < kind < DENSE]


class Steps:
    """The steps of one adapter's ``reducer`` (see the module docstring).

    ``dense``: each gradient as the reducer describes it when dense, by key 0..n-1.
    ``kinds``: their starting kinds, where they are to be agreed (None: every gradient's kind
    is known, as the reducer's gradients say). ``back(buckets)`` backs a new layout of
    buckets; ``rows(k, value)`` makes a revealing sparse gradient (as given to :meth:`see`)
    the (ids, rows) of its agreed kind; ``fill(marked)`` marks, when a step closes, what this
    rank has not marked yet but should; ``inside()`` says whether the calling thread still
    computes gradients (no early close then).
    """

    def __init__(self, reducer: Reducer, dense: Sequence[Gradient],
                 back: Callable[[List[Bucket]], None], *, kinds: Optional[List[int]] = None,
                 rows: Optional[Callable[[int, Any], Optional[Rows]]] = None,
                 fill: Optional[Callable[[List[bool]], None]] = None,
                 inside: Callable[[], bool] = lambda: False):
        self.reducer = reducer
        self.dense = list(dense)
        self.kinds = kinds
        self._back, self._rows, self._fill, self._inside = back, rows, fill, inside
        count = len(self.dense)
        self.marked = [False] * count
        self._seen = [NONE] * count  # this step's kinds of the undecided gradients
        self._revealing: Dict[int, Any] = {}  # first sparse gradients, by key
        self._begun = False  # this step's reductions have started
        self._early: Optional[Tuple[ReducerStep, bool]] = None  # the step, closed before close()
        self._backed: Optional[List[Bucket]] = None
        self._bucket_of: Dict[int, int] = {}
        self._sizes: List[int] = []
        self._waiting: List[List[int]] = []  # per bucket: marked here, not yet handed over
        if kinds is not None:
            reducer.set_gradients(self.gradients())
            joined.after_join(self._settle)

    def gradients(self) -> List[Gradient]:
        """The gradients as the reducer must know them: row-sparse where agreed sparse."""
        if self.kinds is None:
            return self.dense
        return [Gradient(g.key, table_shape(g.shape, kind), g.dtype, sparse=True)
                if NONE < kind < DENSE else g for g, kind in zip(self.dense, self.kinds)]

    def back_if_relaid(self) -> bool:
        """Have the adapter back the reducer's buckets if they are not the ones it backed
        last; True if it did."""
        buckets = self.reducer.buckets
        if buckets is self._backed:
            return False
        self._back(buckets)
        self._backed = buckets
        self._bucket_of = {k: b.number for b in buckets for k in b.keys}
        self._sizes = [len(b.keys) for b in buckets]
        self._waiting = [[] for _ in buckets]
        return True

    # -- readiness --------------------------------------------------------------------------
    def _begin(self) -> None:
        self._begun = True
        if self.reducer.eager:
            self.reducer.begin()
            work_order.on_own_collective(self._close_early)

    def see(self, k: int, kind: int, revealing: Any = None) -> None:
        """This rank's gradient ``k``, of a kind not agreed yet, is of ``kind``; a sparse one
        is kept as ``revealing`` for the rows summed at the end of the step."""
        self._seen[k] = kind
        if revealing is not None:
            self._revealing[k] = revealing

    def mark(self, k: int, value: Any = None) -> None:
        """Gradient ``k`` is ready: in its bucket (``value`` None), or as ``value`` (an array,
        or (ids, rows) for a row-sparse one)."""
        if not self._begun:
            self._begin()
        self.marked[k] = True
        number = self._bucket_of.get(k) if value is None else None
        if number is None:
            self.reducer.mark_ready(k, value)
            return
        waiting = self._waiting[number]
        waiting.append(k)
        if len(waiting) == self._sizes[number]:
            self.reducer.mark_all_ready([(key, None) for key in waiting])

    def mark_all(self, ready: Sequence[Tuple[int, Any]]) -> None:
        """:meth:`mark` for each (key, value) pair, in one call to the reducer: step-time
        readiness, where :meth:`close` comes next (the marks are not kept one by one)."""
        if not self._begun:
            self._begin()
        self.reducer.mark_all_ready(ready)

    # -- closing ----------------------------------------------------------------------------
    def _close_early(self) -> bool:
        """The closer: close the step now, unless the thread still computes gradients."""
        if self._inside():
            return False
        self._early = self._launch()
        return True

    def _launch(self) -> Tuple[ReducerStep, bool]:
        marked = self.marked
        every_marked = all(marked)
        if self._fill is not None:
            self._fill(marked)
        for number, waiting in enumerate(self._waiting):
            if waiting and len(waiting) < self._sizes[number]:
                self.reducer.mark_all_ready([(key, None) for key in waiting])
        self._waiting = [[] for _ in self._sizes]
        return self.reducer.launch(), every_marked

    def close(self) -> Tuple[ReducerStep, bool]:
        """Close this step (what is not marked is stale here) and launch it, unless a
        collective closed it already; return it and whether every gradient had been marked
        before. A collective."""
        work_order.forget_closer(self._close_early)
        if self._early is not None:
            closed, self._early = self._early, None
            return closed
        self._begun = True  # launch() starts the step; no closer from here on
        return self._launch()

    def finish(self, step: ReducerStep, on_bucket: Callable[[Bucket], None]
               ) -> Tuple[Dict[int, Any], bool]:
        """Wait for each bucket of ``step`` in launch order and call ``on_bucket`` with it;
        finish the reducer's step and agree on the kinds not agreed yet; return the reduced
        per-tensor gradients by key and whether the buckets were laid out anew (and backed).
        Raises what a reduction raised, after the reductions have ended."""
        revealing, self._revealing = self._revealing, {}
        try:
            for bucket, handle in step.launched():
                handle.wait()
                on_bucket(bucket)
            results = self.reducer.finish(step)
            found = self._agree()
        finally:
            step.program.exception()  # on an error, let the reductions end before leaving
            self.marked = [False] * len(self.marked)
            self._seen = [NONE] * len(self._seen)
            self._begun = False
        relaid = self.back_if_relaid()
        for k in found:  # every rank's first gradient was sparse: sum it by rows as well
            results[k] = self.reducer.sum_rows_now(k, self._rows(k, revealing.get(k)))
        return results, relaid

    # -- kinds ------------------------------------------------------------------------------
    def _agree(self) -> List[int]:
        """Agree on the kind of each gradient that had none before this step; lay out the
        buckets again without those found sparse, and return them."""
        if self.kinds is None:
            return []
        undecided = [k for k, kind in enumerate(self.kinds) if kind == NONE]
        if not undecided:
            return []
        return self._take(undecided, [self._seen[k] for k in undecided], "gradient_kinds")

    def _take(self, keys: List[int], mine: List[int], name: str) -> List[int]:
        found = agree_kinds(self.kinds, keys, mine, f"{self.reducer.prefix}{name}",
                            self.reducer.process_set)
        if found:
            self.reducer.set_gradients(self.gradients())
        return found

    def _settle(self) -> None:
        """At the end of join(): take the kinds that the other ranks decided while this rank
        was joined (or keep one's own). A collective over the process set (its members)."""
        if not self.reducer.process_set.included():
            return
        self._take(list(range(len(self.kinds))), list(self.kinds), "settled_kinds")
        self.back_if_relaid()
