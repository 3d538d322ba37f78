"""The step protocol (hvd_trainer.training.steps), driven without MPI through a stand-in reducer
that records what it is given: bucket marks batched, an early close by the thread's own next
collective (not inside backward, not by another thread), the step launched once."""
import threading

import numpy as np

from hvd_trainer.coordination import work_order
from hvd_trainer.training.buckets import Bucket, Gradient
from hvd_trainer.training.steps import DENSE, NONE, Steps, table_shape


class Recorder:
    """A reducer with two buckets (keys 0, 1 and key 2) and key 3 outside them."""

    eager = True
    prefix = "test."

    def __init__(self):
        self.calls = []
        self.buckets = [Bucket(0, [0, 1], [0, 2, 4], np.dtype("float64")),
                        Bucket(1, [2], [0, 2], np.dtype("float64"))]

    def begin(self):
        self.calls.append("begin")

    def mark_ready(self, key, value=None):
        self.calls.append(("mark", key))

    def mark_all_ready(self, ready):
        self.calls.append(("marks", [key for key, _ in ready]))

    def launch(self):
        self.calls.append("launch")
        return "step"


def steps_of(reducer, inside=lambda: False):
    filled = []
    steps = Steps(reducer, [Gradient(k, (2,), "<f8") for k in range(4)], lambda b: None,
                  fill=lambda marked: filled.append(list(marked)), inside=inside)
    steps.back_if_relaid()
    return steps, filled


def test_a_buckets_marks_reach_the_reducer_in_one_call_when_it_is_complete():
    reducer = Recorder()
    steps, _ = steps_of(reducer)
    steps.mark(1)
    steps.mark(3, np.zeros(2))
    assert reducer.calls == ["begin", ("mark", 3)]  # bucket 0 still waits for key 0
    steps.mark(0)
    assert reducer.calls[-1] == ("marks", [1, 0])
    assert steps.close() == ("step", False)  # key 2 was never marked
    assert reducer.calls[-1] == "launch"


def test_a_partly_marked_bucket_goes_to_the_reducer_when_the_step_closes():
    reducer = Recorder()
    steps, filled = steps_of(reducer)
    steps.mark(0)
    steps.close()
    assert reducer.calls == ["begin", ("marks", [0]), "launch"]
    assert filled == [[True, False, False, False]]


def test_the_threads_own_next_collective_closes_a_begun_step_once():
    reducer = Recorder()
    steps, _ = steps_of(reducer)
    steps.mark(2)
    other = threading.Thread(target=lambda: work_order.flush(here=True))
    other.start()
    other.join()
    assert "launch" not in reducer.calls  # another thread's collective leaves it open
    work_order.flush(here=True)  # this thread starts a collective: the step closes first
    assert reducer.calls.count("launch") == 1
    assert steps.close() == ("step", False)  # close() takes the closed step
    assert reducer.calls.count("launch") == 1


def test_a_collective_made_inside_backward_leaves_the_step_open():
    reducer = Recorder()
    computing = [True]
    steps, _ = steps_of(reducer, inside=lambda: computing[0])
    steps.mark(2)
    work_order.flush(here=True)
    assert "launch" not in reducer.calls
    computing[0] = False
    steps.close()
    assert reducer.calls.count("launch") == 1
    work_order.flush(here=True)  # the closer is gone once the step closed
    assert reducer.calls.count("launch") == 1


def test_kinds_describe_sparse_gradients_by_their_rows():
    assert table_shape((4, 5, 3), 2) == (20, 3)
    reducer = Recorder()
    steps = Steps(reducer, [Gradient(0, (4, 5, 3), "<f4"), Gradient(1, (2,), "<f4")],
                  lambda b: None)
    steps.kinds = [2, DENSE]
    assert steps.gradients() == [Gradient(0, (20, 3), "<f4", sparse=True),
                                 Gradient(1, (2,), "<f4")]
    steps.kinds = [NONE, DENSE]
    assert steps.gradients()[0] == Gradient(0, (4, 5, 3), "<f4")
