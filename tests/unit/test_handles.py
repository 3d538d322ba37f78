"""Handles of asynchronous collectives: order, polling, errors (the order of work itself is
tested in test_scheduler.py)."""
import threading

import numpy as np
import pytest

import hvd_trainer as hvd
from hvd_trainer.coordination import handles


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
