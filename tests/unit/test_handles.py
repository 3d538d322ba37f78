"""Asynchronous collectives on the communication thread: order, polling, errors."""
import threading

import numpy as np
import pytest

import hvd_trainer as hvd
from hvd_trainer import handles


def test_submitted_work_runs_in_order_on_one_other_thread_while_none_waits_for_a_match():
    seen = []
    release = threading.Event()

    def record(i):
        if i == 0:
            release.wait(10)
        seen.append((i, threading.current_thread().name))
        return i * 10

    pending = [handles.submit(record, i) for i in range(5)]
    assert not pending[-1].poll()  # the first one holds the thread
    release.set()
    assert [h.wait() for h in pending] == [0, 10, 20, 30, 40]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({name for _, name in seen}) == 1
    assert seen[0][1].startswith("hvd_trainer-comm")
    assert all(h.poll() for h in pending)


def test_wait_returns_the_result_and_raises_the_error():
    x = np.arange(4.0)
    assert np.array_equal(handles.submit(hvd.allreduce, x, op=hvd.Sum).wait(), x)
    bad = handles.submit(hvd.broadcast, x, root_rank=3)
    with pytest.raises(ValueError, match="root_rank=3"):
        bad.wait()
    assert bad.poll()


def _recorder(seen):
    def record(label):
        def work():
            seen.append((label, threading.current_thread().name))
            return label
        return work
    return record


def _idle():
    handles.start(lambda: None).result(10)  # the thread has nothing left
    while handles._busy:
        pass


def test_deferred_work_runs_where_it_is_needed_if_nothing_comes_first():
    _idle()
    seen = []
    record = _recorder(seen)
    future = handles.defer(record("step"))
    assert not future.done() and seen == []  # queued, the thread not woken
    handles.run_deferred(future)
    assert future.result(0) == "step"
    assert seen == [("step", threading.current_thread().name)]
    handles.run_deferred(future)  # once only
    assert len(seen) == 1


def test_what_starts_after_deferred_work_goes_behind_it():
    _idle()
    seen = []
    record = _recorder(seen)
    step = handles.defer(record("step"))
    later = handles.start(record("async collective"))
    assert later.result(10) == "async collective" and step.result(10) == "step"
    assert [label for label, _ in seen] == ["step", "async collective"]
    assert len({name for _, name in seen}) == 1
    assert seen[0][1].startswith("hvd_trainer-comm")
    handles.run_deferred(step)  # already ran on the thread: nothing more
    assert len(seen) == 2

    _idle()
    seen.clear()
    step = handles.defer(record("step"))
    handles.flush(here=True)  # a synchronous collective on this thread: the step first, here
    assert step.result(0) == "step"
    assert seen == [("step", threading.current_thread().name)]


def test_deferring_while_the_thread_has_work_hands_it_over_in_order():
    seen = []
    record = _recorder(seen)
    release = threading.Event()
    busy = handles.start(lambda: release.wait(10))
    step = handles.defer(record("step"))
    assert handles._deferred is None  # handed to the thread behind the busy work
    release.set()
    busy.result(10)
    assert step.result(10) == "step" and seen[0][1].startswith("hvd_trainer-comm")


def test_a_synchronous_collective_runs_a_deferred_step_first():
    _idle()
    x = np.arange(3.0)
    results = []
    step = handles.defer(lambda: results.append(hvd.allreduce(x, op=hvd.Sum)))
    assert hvd.allreduce(x, op=hvd.Max) is not None  # runs the step first, on this thread
    assert step.done() and np.array_equal(results[0], x)


def test_a_closer_runs_before_its_own_threads_next_collective_only():
    _idle()
    seen = []
    answers = [False, True]  # declines once (as inside a backward), then closes

    def closer():
        seen.append("closer")
        return answers.pop(0)

    handles.on_own_collective(closer)
    other = threading.Thread(target=lambda: handles.start(lambda: seen.append("other")).result(10))
    other.start()
    other.join()
    assert seen == ["other"]  # another thread's collective does not run it
    handles.start(lambda: seen.append("first")).result(10)
    handles.start(lambda: seen.append("second")).result(10)
    handles.start(lambda: seen.append("third")).result(10)
    assert seen == ["other", "closer", "first", "closer", "second", "third"]

    def forgotten():
        seen.append("forgotten")
        return True

    handles.on_own_collective(forgotten)
    handles.forget_closer(forgotten)
    handles.flush(here=True)
    assert "forgotten" not in seen
