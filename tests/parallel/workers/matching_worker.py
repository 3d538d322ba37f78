"""Matching by name and no cascade after errors (issue 21), checked against NumPy.

reordered     named asynchronous allreduces submitted in a different order on every rank
              are paired by name, not by position
duplicate     a second pending call with the same name raises ValueError on the rank that
              made it alone; a barrier meanwhile runs; the first call still completes
back to back  Horovod's duplicate-name test, 30 times: rank 0 starts a named async call
              alone, then after a barrier each other rank starts the same name twice back
              to back; the second raises DuplicateNameError every time, also when the peers
              already waited and the first call finished at once. The name is free again
              after its handle is waited on, after it is polled done, and after a call with
              another name ran
unnamed after duplicate
              after a duplicate-name error on one rank, unnamed calls (automatic names)
              still pair up: the error took no automatic name
drifted counts
              a rank whose count of automatic names drifted ahead (as after an unnamed call
              that failed on that rank alone) still pairs its unnamed calls with the others'
different names
              synchronous calls whose names differ on every rank raise MismatchError on every
              rank instead of waiting forever, and the next call works
waited handles
              asynchronous calls whose names differ on every rank, each waited for through
              its handle (as horovod.torch's synchronous calls are), raise MismatchError on
              every rank instead of waiting forever, and the next call works
behind a barrier
              while the other ranks wait in a barrier, the last rank's other calls raise
              (naming the barrier) and the barrier goes on waiting until that rank reaches
              it; then every rank is in step again
diverged while joined
              rank 0 joins; the others' calls that cannot match each other raise instead of
              waiting forever (on 3 ranks), a call the joined rank cannot serve raises, a
              reduction is served with rank 0's zeros; then every rank joins and the next
              call works
random        a long sequence, the same on every rank, of good calls mixed with bad ones
              (one rank's bad argument, a shape mismatch, a different kind of call on one
              rank, a duplicate name, reordered named async calls, calls that can never
              match and raise after a wait, a rank behind a barrier, a rank joined while the
              others reduce); every good result equals NumPy's, every bad call raises on the
              ranks it should, and the step after it works on every rank
Run as: worker.py [case ...] (default: all). Each case reports on its own (case_runner.py).
"""
import concurrent.futures
import zlib

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
from hvd_trainer.coordination import handles, rounds, scheduler
from hvd_trainer.runtime import runtime

R, N = hvd.rank(), hvd.size()
# Calls that can never match raise once every rank's rounds matched nothing for this grace;
# it covers a thread that is about to submit the matching call. Each rank here submits from
# one thread, whose call is in the schedule before it waits, so a shorter grace decides the
# same verdicts sooner (most of the random case's time is such waits: 17 s of 19 s on 2 ranks).
assert hasattr(rounds, "_MATCH_GRACE_SECONDS"), "the grace moved: shorten it where it is"
rounds._MATCH_GRACE_SECONDS = 0.05
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


def case_back_to_back():
    x = data("b2b", R)
    want = sum(data("b2b", r) for r in range(N))
    for i in range(30):
        name = f"b2b.{i}"
        first = handles.submit(hvd.allreduce, x, op=hvd.Sum, name=name) if R == 0 else None
        hvd.barrier()
        if R > 0:
            first = handles.submit(hvd.allreduce, x, op=hvd.Sum, name=name)
            if i % 2:  # the race made certain: the first call finished, its handle unpolled
                concurrent.futures.wait([first._future])
            try:
                handles.submit(hvd.allreduce, x, op=hvd.Sum, name=name)
                failures.append(f"round {i}: a back-to-back {name!r} did not raise")
            except scheduler.DuplicateNameError:
                pass
        check(name, first.wait(), want)
    # Reuse after the handle was waited on (above), after it was polled done, and after a
    # call with another name: each goes through.
    check("after wait", handles.submit(hvd.allreduce, x, op=hvd.Sum, name="b2b.0").wait(), want)
    polled = handles.submit(hvd.allreduce, x, op=hvd.Sum, name="b2b.poll")
    while not polled.poll():
        pass
    check("after poll", handles.submit(hvd.allreduce, x, op=hvd.Sum, name="b2b.poll").wait(),
          want)
    unwaited = handles.submit(hvd.allreduce, x, op=hvd.Sum, name="b2b.other")
    concurrent.futures.wait([unwaited._future])  # it ran; its handle is not polled
    check("another name", hvd.allreduce(x, op=hvd.Sum, name="b2b.between"), want)
    again = handles.submit(hvd.allreduce, x, op=hvd.Sum, name="b2b.other")
    check("after another name", again.wait(), want)
    check("the unwaited one", unwaited.wait(), want)


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


def differently_named(label, call):
    """Every rank waits in ``call(name)`` with a name of its own: MismatchError on every
    rank, naming the calls, and the next call works."""
    try:
        call(f"{label}.on.{R}")
        failures.append(f"{label}: differently named calls did not raise")
    except hvd.MismatchError as e:
        if f"{label}.on.0" not in str(e) or f"{label}.on.1" not in str(e):
            failures.append(f"{label}: the mismatch does not name both calls: {e}")
    check(f"after {label}", hvd.allreduce(np.full(2, R + 1.0), op=hvd.Sum),
          np.full(2, N * (N + 1) / 2))


def case_different_names():
    differently_named("only", lambda name: hvd.allreduce(np.ones(2), name=name))


def case_waited_handles():
    differently_named("waited", lambda name: handles.submit(hvd.allreduce, np.ones(2),
                                                             name=name).wait())


def behind_a_barrier(label, late, through_handles):
    """Ranks other than ``late`` wait in a barrier while ``late`` makes two other calls."""
    def call(fn, *args, **kwargs):
        if through_handles:
            return handles.submit(fn, *args, **kwargs).wait()
        return fn(*args, **kwargs)

    if R != late:
        call(hvd.barrier)
    else:
        for bad in (lambda: call(hvd.allreduce, np.ones(3), name=f"{label}.late"),
                    lambda: call(hvd.allgather, np.ones(2))):
            try:
                bad()
                failures.append(f"{label}: a call while the others wait in a barrier did "
                                "not raise")
            except hvd.MismatchError as e:
                if "barrier" not in str(e):
                    failures.append(f"{label}: the error does not name the barrier: {e}")
        call(hvd.barrier)
    x = data(label, R)
    check(f"{label}: after the barrier", hvd.allreduce(x, op=hvd.Sum),
          sum(data(label, r) for r in range(N)))


def case_behind_a_barrier():
    behind_a_barrier("behind", N - 1, False)
    behind_a_barrier("behind through handles", 0, True)


def joined_round(label, first, served, through_handles=True):
    """Rank ``first`` joins; the others make ``served`` reductions (checked against NumPy,
    with zeros for ``first``), a call the joined rank cannot serve, and (on 3 ranks or more)
    calls that cannot match each other, then join. Returns join's value."""
    if R == first:
        return hvd.join()
    active = [r for r in range(N) if r != first]
    for i in range(served):
        x = [data(f"{label}.{i}", r) if r != first else np.zeros(5) for r in range(N)]
        check(f"{label}: served {i}", hvd.allreduce(x[R], op=hvd.Sum, name=f"{label}.{i}"),
              sum(x))
    expect(f"{label}: refused while joined", RuntimeError,
           lambda: hvd.allgather(np.ones(2), name=f"{label}.refused"))
    if len(active) > 1:
        mine = f"{label}.only.on.{R}"
        if through_handles:
            call = lambda: handles.submit(hvd.allreduce, np.ones(2), name=mine).wait()
        else:
            call = lambda: hvd.allreduce(np.ones(2), name=mine)
        expect(f"{label}: diverged while joined", hvd.MismatchError, call)
    return hvd.join()


def case_diverged_while_joined():
    last = joined_round("joined", 0, 1)
    every = hvd.allgather(np.array([last]))
    if not (every == every[0]).all() or last == 0:
        failures.append(f"join returned {every.tolist()} (rank 0 joined first)")
    check("after join", hvd.allreduce(np.full(2, R + 1.0), op=hvd.Sum),
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
                           "bad argument", "mismatch", "other kind", "duplicate", "reorder",
                           "async", "never matches", "behind a barrier", "joined"],
                          p=[.14, .08, .08, .08, .08, .08, .06, .08, .08, .06, .06, .06, .06])
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
        elif what == "other kind":
            if R == odd:
                call = lambda: hvd.allgather(every[R], name=name)
            else:
                call = lambda: hvd.allreduce(every[R], op=hvd.Sum, name=name)
            expect(label, hvd.MismatchError, call)
        elif what == "never matches":  # raises once every rank has waited a moment
            mine = f"{tag}.only.on.{R}"
            if named:
                call = lambda: handles.submit(hvd.allreduce, every[R], name=mine).wait()
            else:
                call = lambda: hvd.broadcast(every[R], root_rank=0, name=mine)
            expect(label, hvd.MismatchError, call)
        elif what == "behind a barrier":
            behind_a_barrier(label, odd, named)
        elif what == "joined":
            last = joined_round(label, odd, int(rng.integers(3)), named)
            every_last = hvd.allgather(np.array([last]))
            if not (every_last == every_last[0]).all():
                failures.append(f"{label}: join returned {every_last.tolist()}")
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
           "back_to_back": case_back_to_back,
           "unnamed_after_duplicate": case_unnamed_after_duplicate,
           "drifted_counts": case_drifted_counts,
           "different_names": case_different_names, "waited_handles": case_waited_handles,
           "behind_a_barrier": case_behind_a_barrier,
           "diverged_while_joined": case_diverged_while_joined, "random": case_random},
          failures, R)
