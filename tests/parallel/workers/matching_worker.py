"""Matching by name and no cascade after errors (issue 21), checked against NumPy.

reordered     named asynchronous allreduces submitted in a different order on every rank
              are paired by name, not by position
duplicate     a second pending call with the same name raises ValueError on the rank that
              made it alone; a barrier meanwhile runs; the first call still completes
unnamed after duplicate
              after a duplicate-name error on one rank, unnamed calls (automatic names)
              still pair up: the error took no automatic name
drifted counts
              a rank whose count of automatic names drifted ahead (as after an unnamed call
              that failed on that rank alone) still pairs its unnamed calls with the others'
different names
              synchronous calls whose names differ on every rank raise MismatchError on every
              rank instead of waiting forever, and the next call works
random        a long sequence, the same on every rank, of good calls mixed with bad ones
              (one rank's bad argument, a shape mismatch, a duplicate name, reordered named
              async calls); every good result equals NumPy's and every bad call raises on
              the ranks it should
Run as: worker.py [case ...] (default: all). Each case reports on its own (case_runner.py).
"""
import zlib

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
from hvd_trainer import handles, runtime, scheduler

R, N = hvd.rank(), hvd.size()
failures = []


def data(tag, r, shape=(5,), dtype=np.float64):
    rng = np.random.default_rng([zlib.crc32(tag.encode()), r])
    return rng.integers(-9, 9, shape).astype(dtype)


def check(label, got, want):
    if not np.array_equal(got, want):
        failures.append(f"{label}: got {got!r}, NumPy says {want!r}")


def case_reordered():
    names = [f"reorder.{i}" for i in range(4)]
    order = names if R % 2 == 0 else names[::-1]
    if R == N - 1:
        order = names[1:] + names[:1]
    pending = {n: handles.submit(hvd.allreduce, data(n, R), op=hvd.Sum, name=n) for n in order}
    for n in names:
        check(n, pending[n].wait(), sum(data(n, r) for r in range(N)))


def case_duplicate():
    x = data("dup", R)
    first = None
    if R == 0:
        first = handles.submit(hvd.allreduce, x, op=hvd.Sum, name="dup")
        try:
            handles.submit(hvd.allreduce, x, op=hvd.Sum, name="dup")
            failures.append("rank 0: a second pending 'dup' did not raise")
        except ValueError as e:
            if "'dup'" not in str(e):
                failures.append(f"rank 0: the duplicate error does not name 'dup': {e}")
    hvd.barrier()  # rank 0's 'dup' is still pending: the barrier must not wait for it
    if R > 0:
        first = handles.submit(hvd.allreduce, x, op=hvd.Sum, name="dup")
    check("dup", first.wait(), sum(data("dup", r) for r in range(N)))


def case_unnamed_after_duplicate():
    x = data("u", R)
    held = handles.submit(hvd.allreduce, x, op=hvd.Sum, name="held")
    if R == N - 1:
        try:
            handles.submit(hvd.allreduce, x, op=hvd.Sum, name="held")
            failures.append("a second pending 'held' did not raise")
        except ValueError:
            pass
    for i in range(3):
        y = data(f"u{i}", R, (3, 2))
        check(f"unnamed {i}", hvd.allreduce(y, op=hvd.Sum), sum(data(f"u{i}", r, (3, 2))
                                                                for r in range(N)))
    check("held", held.wait(), sum(data("u", r) for r in range(N)))


def case_drifted_counts():
    if R == 0:
        scheduler.of(runtime.communicator(hvd.global_process_set)).unnamed += 3
    for i in range(3):
        y = data(f"d{i}", R, (4,))
        check(f"drifted {i}", hvd.allreduce(y, op=hvd.Sum), sum(data(f"d{i}", r, (4,))
                                                              for r in range(N)))


def case_different_names():
    try:
        hvd.allreduce(np.ones(2), name=f"only.on.{R}")
        failures.append("differently named calls did not raise")
    except hvd.MismatchError as e:
        if "only.on.0" not in str(e) or "only.on.1" not in str(e):
            failures.append(f"the mismatch does not name both calls: {e}")
    check("after different names", hvd.allreduce(np.full(2, R + 1.0), op=hvd.Sum),
          np.full(2, N * (N + 1) / 2))


def expect(label, kind, call):
    try:
        call()
        failures.append(f"{label}: no {kind.__name__}")
    except kind:
        pass


def case_random():
    rng = np.random.default_rng(2112)  # the same sequence on every rank
    for step in range(240):
        what = rng.choice(["allreduce", "allgather", "broadcast", "reducescatter",
                           "bad argument", "mismatch", "duplicate", "reorder", "async"],
                          p=[.2, .1, .1, .1, .1, .1, .1, .1, .1])
        tag = f"s{step}"
        named = bool(rng.integers(2))
        name = tag if named else None
        shape = tuple(int(d) for d in rng.integers(1, 5, rng.integers(1, 3)))
        dtype = [np.float32, np.float64, np.int32][rng.integers(3)]
        odd = int(rng.integers(N))  # the rank that misbehaves, if any
        every = [data(tag, r, shape, dtype) for r in range(N)]
        label = f"step {step} {what}"
        if what == "allreduce":
            op = [hvd.Sum, hvd.Min, hvd.Max][rng.integers(3)]
            want = {hvd.Sum: sum(every), hvd.Min: np.minimum.reduce(every),
                    hvd.Max: np.maximum.reduce(every)}[op]
            check(label, hvd.allreduce(every[R], op=op, name=name), want)
        elif what == "allgather":
            check(label, hvd.allgather(every[R], name=name), np.concatenate(every))
        elif what == "broadcast":
            check(label, hvd.broadcast(every[R], root_rank=odd, name=name), every[odd])
        elif what == "reducescatter":
            rows = [data(tag, r, (N, 2), dtype) for r in range(N)]
            check(label, hvd.reducescatter(rows[R], op=hvd.Sum, name=name),
                  sum(rows)[R:R + 1])
        elif what == "bad argument":
            expect(label, ValueError, lambda: hvd.allreduce(
                every[R], op="mean" if R == odd else hvd.Sum, name=name))
        elif what == "mismatch":
            mine = every[R] if R != odd else np.zeros(shape + (2,), dtype)
            expect(label, hvd.MismatchError, lambda: hvd.allreduce(mine, name=name))
        elif what == "duplicate":
            first = handles.submit(hvd.allreduce, every[R], op=hvd.Sum, name=tag)
            if R == odd:
                expect(label, ValueError, lambda: handles.submit(
                    hvd.allreduce, every[R], op=hvd.Sum, name=tag))
            check(label, first.wait(), sum(every))
        elif what == "reorder":
            names = [f"{tag}.{i}" for i in range(3)]
            mine = list(names)
            np.random.default_rng([step, R]).shuffle(mine)  # a different order per rank
            got = {n: handles.submit(hvd.allreduce, data(n, R), op=hvd.Sum, name=n)
                   for n in mine}
            for n in names:
                check(f"{label} {n}", got[n].wait(), sum(data(n, r) for r in range(N)))
        elif what == "async":
            handle = handles.submit(hvd.allreduce, every[R], op=hvd.Sum, name=name)
            check(f"{label} sync", hvd.allgather(every[R]), np.concatenate(every))
            check(label, handle.wait(), sum(every))
    check("after the sequence", hvd.allreduce(np.full(3, R + 1.0), op=hvd.Sum),
          np.full(3, N * (N + 1) / 2))


run_cases({"reordered": case_reordered, "duplicate": case_duplicate,
           "unnamed_after_duplicate": case_unnamed_after_duplicate,
           "drifted_counts": case_drifted_counts,
           "different_names": case_different_names, "random": case_random}, failures, R)
