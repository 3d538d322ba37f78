"""Collectives from several threads of every rank, checked against NumPy.

concurrent  one thread runs grouped allreduces on the world while another runs them on the
            process set [0..N-2], at the same time, on every rank
covered     while the main thread is inside ``agreement.covered`` (as the trainer's step
            is), another thread's collective waits for the block to end and then makes its
            own agreement, instead of being mixed into the block
unnamed_threads  two threads of every rank make unnamed allreduces of one shape, each rank
            interleaving them in its own order: every sum is the one of the same thread's
            arrays (automatic names are counted per thread)
unnamed_threads_apart  the same from threads whose names differ across ranks: every call
            raises MismatchError on every rank (never a sum of the wrong arrays), and the
            next collective works
Run as: worker.py [case ...] (default: all).
"""
import random
import threading
import time

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
from hvd_trainer.coordination import agreement
from hvd_trainer.runtime import runtime

R, N = hvd.rank(), hvd.size()
ROUNDS = 40
failures = []


def data(r, i, k):
    return np.random.default_rng([r, i, k]).integers(0, 9, 500 + 7 * k).astype(np.float64)


def loop(label, ranks, process_set):
    """Grouped allreduces of three tensors (fused in one buffer), ROUNDS times."""
    try:
        for i in range(ROUNDS):
            got = hvd.grouped_allreduce([data(R, i, k) for k in range(3)], op=hvd.Sum,
                                        name=f"{label}.{i}", process_set=process_set)
            for k, g in enumerate(got):
                if not np.array_equal(g, sum(data(r, i, k) for r in ranks)):
                    failures.append(f"{label} round {i} tensor {k} differs from NumPy")
    except Exception as e:  # noqa: BLE001 - reported with the other failures
        failures.append(f"{label}: {type(e).__name__}: {e}")


def case_concurrent():
    side = hvd.add_process_set(list(range(N - 1)))
    threads = [threading.Thread(target=loop, args=("world", range(N), hvd.global_process_set))]
    if side.included():
        threads.append(threading.Thread(target=loop, args=("side", range(N - 1), side)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hvd.remove_process_set(side)


def case_covered():
    comm = runtime.communicator(hvd.global_process_set)
    order = []
    calling = threading.Event()

    def side():
        calling.set()
        try:
            got = hvd.allreduce(np.full(4, R + 1.0), op=hvd.Sum, name="from another thread")
            if not np.array_equal(got, np.full(4, N * (N + 1) / 2)):
                failures.append(f"the other thread's allreduce gave {got}")
        except Exception as e:  # noqa: BLE001 - reported with the other failures
            failures.append(f"the other thread's allreduce: {type(e).__name__}: {e}")
        order.append("other thread done")

    thread = threading.Thread(target=side)
    inside = np.arange(6.0) * (R + 1)
    # What the block will run, agreed on first (as the trainer agrees on its step).
    agreement.agree(comm, lambda: {"kind": "block", "name": "covered block",
                                     "tensors": [{"name": "inside", "shape": (6,)}]})
    with agreement.covered(comm):
        thread.start()
        calling.wait()
        time.sleep(0.5)  # the other thread has reached its collective by now
        got = hvd.allreduce(inside, op=hvd.Sum, name="inside")
        if not np.array_equal(got, np.arange(6.0) * N * (N + 1) / 2):
            failures.append(f"the covered allreduce gave {got}")
        order.append("block done")
    thread.join()
    if order != ["block done", "other thread done"]:
        failures.append(f"order of completion {order}: the other thread's collective ran "
                        "inside the covered block")


def unnamed_threads(names, calls):
    """Two threads named ``names`` make ``calls`` unnamed allreduces of one shape each, with
    pauses of this rank's own; returns, per thread, what each call gave (an array or the
    exception)."""
    results = {name: [] for name in names}

    def loop(name):
        pause = random.Random(f"{R}{name}")
        for i in range(calls):
            time.sleep(pause.uniform(0, 0.004))
            try:
                results[name].append(hvd.allreduce(unnamed_data(name[-1], i, R), op=hvd.Sum))
            except Exception as e:  # noqa: BLE001 - the case judges it
                results[name].append(e)

    threads = [threading.Thread(target=loop, args=(name,), name=name) for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def unnamed_data(thread, i, r):
    return np.full(16, {"a": 1.0, "b": 1000.0}[thread] * (i + 1) * (r + 1))


def case_unnamed_threads():
    calls = 30
    results = unnamed_threads(["a", "b"], calls)
    for name, got in results.items():
        for i, g in enumerate(got):
            want = sum(unnamed_data(name, i, r) for r in range(N))
            if not isinstance(g, np.ndarray) or not np.array_equal(g, want):
                failures.append(f"thread {name} call {i}: {g!r:.120}, NumPy's sum {want[0]}")


def case_unnamed_threads_apart():
    results = unnamed_threads([f"rank{R}.a", f"rank{R}.b"], 2)
    for name, got in results.items():
        for i, g in enumerate(got):
            if not isinstance(g, hvd.MismatchError):
                failures.append(f"thread {name} call {i}: {g!r:.120} instead of a mismatch")
    check = hvd.allreduce(np.full(3, R + 1.0), op=hvd.Sum)
    if not np.array_equal(check, np.full(3, N * (N + 1) / 2)):
        failures.append(f"the next allreduce gave {check}")


run_cases({"concurrent": case_concurrent, "covered": case_covered,
           "unnamed_threads": case_unnamed_threads,
           "unnamed_threads_apart": case_unnamed_threads_apart}, failures, R)
