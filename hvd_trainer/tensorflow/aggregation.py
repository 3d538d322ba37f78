"""``backward_passes_per_step`` for Keras 2 optimizers: gradients add up locally and are
reduced across ranks once every N passes, as Horovod's local gradient aggregation does.

Each pass adds its gradients into a variable per gradient and counts itself; the N-th pass
reduces the sums (divided by N with ``average_aggregated_gradients``), zeroes the sums (an
assignment, so an infinite gradient does not leave NaN behind) and resets the count to 0.
``apply_gradients`` then steps only when the count is 0; the other passes only count an
iteration. Eagerly the choice is Python's, in a graph a ``tf.cond``: every rank takes the
same branch, since every rank counts the same passes.
"""
from typing import Any, Callable, List

import tensorflow as tf

from . import bridge


class LocalAggregation:
    """The sums of ``passes`` backward passes and their count (``counter``, Horovod's name)."""

    def __init__(self, passes: int, average: bool):
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes!r}: pass 1 or more")
        self.passes = int(passes)
        self.average = bool(average)
        self.counter = tf.Variable(0, trainable=False, dtype=tf.int32)
        self.sums: List[Any] = []

    def compute_gradients(self, grads: List[Any], variables: List[Any],
                          reduce: Callable[[List[Any]], List[Any]], *,
                          sparse_as_dense: bool) -> List[Any]:
        """Add ``grads`` to the sums and count the pass; on the N-th, the sums reduced with
        ``reduce`` (a collective), otherwise the local sums."""
        dense = []
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if not sparse_as_dense:
                    raise ValueError(f"gradient {i} is a tf.IndexedSlices: with "
                                     "backward_passes_per_step > 1 pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        if not self.sums:
            with tf.init_scope():  # made once, outside any graph being traced
                self.sums = [None if g is None else
                             tf.Variable(tf.zeros(v.shape, g.dtype), trainable=False)
                             for g, v in zip(dense, variables)]
        if len(self.sums) != len(dense):
            raise ValueError(f"backward_passes_per_step: this pass has {len(dense)} gradients, "
                             f"the first had {len(self.sums)}; pass the same variables")
        summed = [None if s is None or g is None else s.assign_add(g)
                  for s, g in zip(self.sums, dense)]
        count = self.counter.assign_add(1)

        def reduced() -> List[Any]:
            values = reduce([None if s is None else tf.identity(s) for s in summed])
            if self.average:
                values = [None if v is None else v / self.passes for v in values]
            with tf.control_dependencies([v for v in values if v is not None]):
                resets = [s.assign(tf.zeros_like(s)) for s in self.sums if s is not None]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(resets):
                return [None if v is None else tf.identity(v) for v in values]

        def kept() -> List[Any]:
            return [None if s is None else tf.identity(s) for s in summed]

        if bridge.eager():
            return reduced() if int(count) == self.passes else kept()
        return _cond(tf.equal(count, self.passes), reduced, kept,
                     [s is not None for s in summed])

    def apply_gradients(self, step: Callable[[], Any], iterations: Any) -> Any:
        """``step()`` when the count is 0 (the pass that reduced), else one more iteration."""
        if bridge.eager():
            return step() if int(self.counter) == 0 else iterations.assign_add(1)

        def applied() -> Any:
            result = step()
            with tf.control_dependencies([] if result is None else [result]):
                return tf.identity(iterations)

        def counted() -> Any:
            return tf.identity(iterations.assign_add(1))

        return tf.cond(tf.equal(self.counter, 0), applied, counted)


def _cond(pred: Any, true_fn: Callable[[], List[Any]], false_fn: Callable[[], List[Any]],
          present: List[bool]) -> List[Any]:
    """``tf.cond`` over lists whose entries are None where ``present`` is False (a variable
    without a gradient): the Nones stay out of the branches and come back in place."""
    values = iter(tf.cond(pred, lambda: [g for g in true_fn() if g is not None],
                          lambda: [g for g in false_fn() if g is not None]))
    return [next(values) if here else None for here in present]
