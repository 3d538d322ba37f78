"""The gradient reducer in a size-1 world, with plain NumPy gradients: bucket layout, readiness
in any order, in-order launches, handles, stale gradients, sparse rows, the step's own record
and state round trips. Multi-rank sums, hooks and agreement mismatches: tests/parallel."""
import contextlib
import threading
import warnings

import numpy as np
import pytest

import hvd_trainer
from hvd_trainer.collectives import objects
from hvd_trainer.compression import TwoBit
from hvd_trainer.runtime import runtime
from hvd_trainer.training import hook_state
from hvd_trainer.training.buckets import Gradient
from hvd_trainer.training.reducer import Reducer


def make(**settings):
    """A Reducer whose buckets hold at most 64 bytes (16 float32)."""
    runtime.init()
    reducer = Reducer(**settings)
    reducer.bucket_threshold = 64
    return reducer


def grads(*shapes, dtype="<f4"):
    return [Gradient(k, shape, dtype) for k, shape in enumerate(shapes)]


def back(reducer, opened=None):
    """Back every bucket with a NumPy array; return each bucketed gradient's view."""
    views = {}
    for bucket in reducer.buckets:
        flat = np.zeros(bucket.bounds[-1], bucket.dtype)
        for key, a, b in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
            views[key] = flat[a:b].reshape(reducer.gradients[key].shape)

        def open_(bucket=bucket, flat=flat):
            if opened is not None:
                opened.append(bucket.number)
            return flat
        bucket.open = open_
    return views


def step_of(reducer):
    """Close the step and finish it; return (step, results)."""
    step, _ = reducer.close()
    results, _ = reducer.finish(step)
    return step, results


def test_layout_reverse_order_one_dtype_per_bucket_threshold():
    reducer = make()
    gradients = grads((4,), (8,), (8,), (4,)) + [Gradient(4, (2,), "<f8")]
    assert reducer.set_gradients(gradients)
    # Reverse order; a bucket closes once it holds 64 bytes (16 + 32 + 32); float64 apart.
    assert [b.keys for b in reducer.buckets] == [[4], [3, 2, 1], [0]]
    assert [b.bounds for b in reducer.buckets] == [[0, 2], [0, 4, 12, 20], [0, 4]]
    assert [b.dtype for b in reducer.buckets] == [np.float64, np.float32, np.float32]
    assert not reducer.set_gradients(list(gradients))  # unchanged: same buckets


def test_num_groups_and_what_stays_out_of_buckets():
    reducer = make(num_groups=2)
    reducer.set_gradients(grads((4,), (4,), (4,), (4,))
                          + [Gradient(4, (5, 2), "<f4", sparse=True),
                             Gradient(5, (0,), "<f4"), Gradient(6, (), "<f4")])
    assert [b.keys for b in reducer.buckets] == [[3, 2], [1, 0]]


def test_compressed_gradients_are_bucketed_like_the_others():
    compressed = make(compression=TwoBit())
    compressed.set_gradients(grads((4,), (4,)))
    assert [b.keys for b in compressed.buckets] == [[1, 0]]


def test_gpu_gradients_get_buckets_of_their_own_reduced_in_their_context():
    reducer = make()
    reducer.set_gradients([Gradient(0, (4,), "<f4"), Gradient(1, (4,), "<f4", memory="gpu"),
                           Gradient(2, (4,), "<f4", memory="gpu"), Gradient(3, (4,), "<f4")])
    # Same dtype, and 64 bytes would fit all four: memory keeps them apart.
    assert [(b.keys, b.memory) for b in reducer.buckets] == [([3, 0], "host"), ([2, 1], "gpu")]
    events = []
    back(reducer, events)

    @contextlib.contextmanager
    def active():
        events.append("enter")
        yield
        events.append("exit")
    reducer.buckets[1].active = active
    reducer.mark_all((k, None) for k in range(4))
    step_of(reducer)
    assert events == [0, "enter", 1, "exit"]


def test_eager_buckets_launch_in_order_once_complete_whatever_the_ready_order():
    reducer = make(eager=True)
    reducer.set_gradients(grads(*[(4,)] * 8))
    opened = []
    views = back(reducer, opened)
    assert [b.keys for b in reducer.buckets] == [[7, 6, 5, 4], [3, 2, 1, 0]]
    marked = []
    real_open = {b.number: b.open for b in reducer.buckets}
    for bucket in reducer.buckets:
        def check(bucket=bucket):
            assert set(bucket.keys) <= set(marked), "launched before its members were ready"
            return real_open[bucket.number]()
        bucket.open = check
    order = [0, 5, 3, 1, 2, 7, 6, 4]  # bucket 1 completes first, but launches second
    reducer.begin()  # here: the closer is this thread's, which starts no collective
    for key in order:
        views[key][...] = key + 1
        marked.append(key)
        t = threading.Thread(target=reducer.mark, args=(key,))
        t.start()
        t.join()
    step, _ = step_of(reducer)
    assert opened == [0, 1]
    assert all(handle.poll() for handle in step.handles)
    for key in range(8):  # a size-1 sum leaves the values as they were
        assert np.array_equal(views[key], np.full(4, key + 1, np.float32))


def test_a_bucket_completes_at_its_last_mark_and_the_step_keeps_its_own_record():
    reducer = make(eager=True)
    reducer.set_gradients(grads((4,), (4,), (2, 2), (4,), (4,)))
    reducer.bucket_threshold = 32
    reducer.lay_out()
    back(reducer)
    assert [b.keys for b in reducer.buckets] == [[4, 3], [2, 1], [0]]
    reducer.mark(3)
    step = reducer._step
    assert not step.complete(0) and step.pending() and step.marked(3)
    reducer.mark(4)
    assert step.complete(0) and not step.complete(1)
    closed, every_marked = reducer.close()
    assert closed is step and not every_marked
    assert step.ready.tolist() == [False, False, False, True, True]
    with pytest.raises(ValueError):
        step.ready[0] = True  # the step's marks are its own
    reducer.finish(step)


def test_step_time_readiness_stale_and_fresh_nowhere():
    reducer = make()
    reducer.set_gradients(grads((4,), (4,)) + [Gradient(2, (), "<f4")])
    views = back(reducer)
    views[0][...], views[1][...] = 1, 2
    reducer.mark(1)
    reducer.mark(2, np.full((), 5, np.float32))
    step, results = step_of(reducer)
    # Fresh nowhere: left as it was, not reduced; the per-tensor one comes back.
    assert not reducer.fresh(step, 0) and reducer.fresh(step, 1)
    assert np.array_equal(views[0], np.ones(4)) and np.array_equal(views[1], np.full(4, 2))
    assert not step.complete(0)
    assert np.array_equal(results[2], np.full((), 5))


def test_eager_reduces_what_was_never_marked_as_zeros():
    reducer = make(eager=True)
    reducer.set_gradients(grads((4,), (4,)) + [Gradient(2, (), "<f4")])
    views = back(reducer)
    views[0][...], views[1][...] = 7, 2
    reducer.mark(1)
    _, results = step_of(reducer)
    assert np.array_equal(views[0], np.zeros(4)) and np.array_equal(views[1], np.full(4, 2))
    assert np.array_equal(results[2], np.zeros(()))


def test_marking_twice_or_after_launch_is_refused():
    reducer = make()
    reducer.set_gradients(grads((4,)))
    back(reducer)
    reducer.mark(0)
    with pytest.raises(RuntimeError, match="'grad.0' was marked ready twice"):
        reducer.mark(0)
    with pytest.raises(RuntimeError, match="'grad.0' was marked ready twice"):
        reducer.mark_all([(0, None)])
    with pytest.raises(ValueError, match="gradient key 5 is not one of"):
        reducer.mark(5)
    step_of(reducer)
    reducer.mark(0)  # the next step
    step_of(reducer)


def test_sparse_rows_merge_in_a_size_one_world():
    reducer = make()
    reducer.set_gradients([Gradient(0, (6, 2), "<f4", sparse=True)])
    ids = np.array([4, 1])
    rows = np.array([[1, 2], [3, 4]], np.float32)
    reducer.mark(0, (ids, rows))
    _, results = step_of(reducer)
    got_ids, got_rows = results[0]
    assert got_ids.tolist() == [1, 4] and got_rows.tolist() == [[3, 4], [1, 2]]
    assert reducer.sparse_exchanges[0].dense is False


def test_agreement_description_names_every_gradient_and_the_hook():
    reducer = make(prefix="m.")
    reducer.set_gradients([Gradient(3, (2, 2), "<f4"), Gradient(5, (9, 2), "<f8", sparse=True)])
    described = reducer.description
    assert described["name"] == "m.step" and described["compression"] == "NoneCompressor"
    assert described["tensors"] == [
        {"name": "m.grad.3", "shape": (2, 2), "dtype": "<f4", "stype": "default",
         "memory": "host"},
        {"name": "m.grad.5", "shape": (9, 2), "dtype": "<f8", "stype": "row_sparse",
         "memory": "host"}]
    assert reducer.description is described  # reused, so the digest is too


def test_state_round_trip_and_other_settings_start_from_zero():
    reducer = make(compression=TwoBit(0.5))
    residual = np.arange(4, dtype=np.float32)
    feedback = hook_state.kept(reducer)
    feedback.residuals = {7: residual.copy()}
    state = hook_state.gather(reducer, "residuals")
    assert state["size"] == 1 and state["compression"].startswith("TwoBit")
    feedback.residuals = {}
    hook_state.scatter(reducer, state, "residuals")
    assert np.array_equal(feedback.residuals[7], residual)
    other = make(compression=TwoBit(0.25))
    hook_state.kept(other).residuals = {7: residual.copy()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook_state.scatter(other, state, "residuals")
    assert hook_state.kept(other).residuals == {}
    assert "start again from zero" in str(caught[0].message)
    assert hook_state.gather(make(), "residuals") is None  # no error feedback, no state


def test_gather_and_scatter_object_in_a_size_one_world():
    assert objects.gather_object({"a": 1}, 0) == [{"a": 1}]
    assert objects.scatter_object([("x", 2)], 0) == ("x", 2)
    with pytest.raises(ValueError, match="one object per rank"):
        objects.scatter_object([1, 2], 0)
    assert hvd_trainer.rank() == 0
