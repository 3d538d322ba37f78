"""The reducer's steps as an adapter drives them, in a size-1 world: the adapter's fill() at
close, an early close by the thread's own next collective (not inside backward, not by another
thread), the step launched once; the kinds of gradients described by their rows."""
import threading

import numpy as np

from hvd_trainer.coordination import work_order
from hvd_trainer.runtime import runtime
from hvd_trainer.training.buckets import Gradient
from hvd_trainer.training.kinds import DENSE, NONE, Kinds, table_shape
from hvd_trainer.training.reducer import Reducer


class Adapter:
    """Backs the buckets with arrays and records what the reducer asks of it."""

    def __init__(self, inside=lambda: False):
        runtime.init()
        self.filled = []
        self.reducer = Reducer(prefix="test.", eager=True)
        self.reducer.bucket_threshold = 32  # keys 2 and 1 in one bucket, key 0 in another
        self.reducer.set_gradients([Gradient(k, (2,), "<f8") for k in range(3)]
                                   + [Gradient(3, (), "<f8")])
        self.reducer.attach(self.back, fill=lambda ready: self.filled.append(list(ready)),
                            inside=inside)
        self.launches = 0
        launch = self.reducer._launch

        def counted():
            self.launches += 1
            return launch()
        self.reducer._launch = counted

    def back(self, buckets):
        for bucket in buckets:
            flat = np.zeros(bucket.bounds[-1])
            bucket.open = lambda flat=flat: flat


def test_the_adapter_fills_at_close_what_it_had_not_marked():
    adapter = Adapter()
    reducer = adapter.reducer
    assert [b.keys for b in reducer.buckets] == [[2, 1], [0]]
    reducer.mark(0)
    step, every_marked = reducer.close()
    assert adapter.filled == [[True, False, False, False]] and not every_marked
    assert step.complete(1) and not step.complete(0)
    reducer.finish(step)


def test_the_threads_own_next_collective_closes_a_begun_step_once():
    adapter = Adapter()
    reducer = adapter.reducer
    reducer.mark(2)
    reducer.mark(1)  # a bucket is complete: the step's program waits on the thread for more
    other = threading.Thread(target=lambda: work_order.flush(here=True))
    other.start()
    other.join()
    assert adapter.launches == 0  # another thread's collective leaves it open
    work_order.flush(here=True)  # this thread starts a collective: the step closes first
    assert adapter.launches == 1
    step, every_marked = reducer.close()  # close() takes the closed step
    assert adapter.launches == 1 and not every_marked and step.marked(2)
    reducer.finish(step)


def test_a_collective_made_inside_backward_leaves_the_step_open():
    computing = [True]
    adapter = Adapter(inside=lambda: computing[0])
    reducer = adapter.reducer
    reducer.mark(2)
    reducer.mark(1)
    work_order.flush(here=True)
    assert adapter.launches == 0
    computing[0] = False
    reducer.finish(reducer.close()[0])
    assert adapter.launches == 1
    work_order.flush(here=True)  # the closer is gone once the step closed
    assert adapter.launches == 1


def test_kinds_describe_sparse_gradients_by_their_rows():
    assert table_shape((4, 5, 3), 2) == (20, 3)
    dense = [Gradient(0, (4, 5, 3), "<f4"), Gradient(1, (2,), "<f4")]
    assert Kinds(dense, [2, DENSE]).gradients() == [Gradient(0, (20, 3), "<f4", sparse=True),
                                                    Gradient(1, (2,), "<f4")]
    assert Kinds(dense, [NONE, DENSE]).gradients()[0] == Gradient(0, (4, 5, 3), "<f4")
