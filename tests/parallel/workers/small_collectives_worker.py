"""Small collectives whose data travels in the carrier's gather right after the agreement
(issues 25 and 50), against NumPy.

one exchange  a small allreduce, allreduce_, grouped_allreduce, broadcast(_), allgather,
              broadcast_object and allgather_object each make one agreement exchange and
              one gather of the carrier (both persistent requests) and no other MPI call
              (a repeated broadcast and broadcast_object the exchange alone), a barrier
              the agreement alone; the same calls on data larger than the carrier's
              room make their data phase as before
results       small and large calls of every op, dtype, scale and root equal NumPy's, and
              every rank holds the same bytes; 16-bit float Average is summed and scaled in
              float32 and rounded once
mismatches    ranks that disagree on a small call (shape, dtype, op, root, scale factor, kind,
              small against large, an argument error, an object the root cannot pickle) raise
              on every rank the error the same disagreement on large data raises, and the
              next call works
one rank's data too large
              an allgather or allgather_object whose data fits on every rank but one goes
              the slow way on every rank, with the right result
inline payloads
              broadcast_object from each root in turn, around and past the record's room,
              gives the root's object; a pickle of at most records.INLINE_ROOM bytes, and a
              repeated small broadcast_, travel in the agreement's exchange alone
Run as: worker.py [case ...] (default: all); each case reports one record per rank
(case_runner.py).
"""
import pickle
import zlib

import ml_dtypes
import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
from hvd_trainer.coordination import records, scheduler
from hvd_trainer.runtime import runtime

R, N = hvd.rank(), hvd.size()
LAST = N - 1
COMM = runtime.communicator(hvd.global_process_set)
ROOM = records.room(COMM)
failures = []


def data(tag, rank, shape, dtype):
    """Rank ``rank``'s input, which every rank can make (small integers: exact sums)."""
    rng = np.random.default_rng([zlib.crc32(tag.encode()), rank])
    values = rng.integers(-4, 5, shape)
    if np.dtype(dtype).kind == "b":
        return values > 0
    if np.dtype(dtype).kind == "u":
        values = np.abs(values)
    return values.astype(dtype)


def same_everywhere(label, array):
    """Every rank holds the same bytes in ``array``."""
    every = hvd.allgather_object(np.ascontiguousarray(array).tobytes())
    if len(set(every)) != 1:
        failures.append(f"{label}: ranks hold different bytes")


def check(label, got, want):
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(
            got.astype(np.float64) if want.dtype.name == "bfloat16" else got,
            want.astype(np.float64) if want.dtype.name == "bfloat16" else want,
            equal_nan=want.dtype.kind in "fc"):
        failures.append(f"{label}: got {got.dtype}{got.shape} {got.ravel()[:4]}, "
                        f"want {want.dtype}{want.shape} {want.ravel()[:4]}")
    same_everywhere(label, got)


class Recorder:
    """The mpi4py communicator with every method call counted (persistent requests that
    were made before it are started without it: the agreement's exchange)."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def __getattr__(self, name):
        found = getattr(self.comm, name)
        if not callable(found):
            return found

        def call(*args, **kwargs):
            self.calls.append(name)
            return found(*args, **kwargs)
        return call


def counted(call):
    """(agreement exchanges, carrier gathers, other MPI calls) that ``call()`` makes on this
    rank."""
    recorder, carrier = Recorder(COMM.comm), records.carrier_of(COMM)
    COMM.comm, before, gathers = recorder, scheduler.of(COMM).exchanges, carrier.gathers
    try:
        call()
    finally:
        COMM.comm = recorder.comm
    return (scheduler.of(COMM).exchanges - before, carrier.gathers - gathers,
            [c for c in recorder.calls if c != "Iprobe"])


def one_exchange():
    hvd.barrier()  # the agreement's buffers exist from here on
    small, large = np.ones(8, np.float32), np.ones(ROOM // 4 + 1, np.float32)
    calls = {
        "allreduce": lambda x: hvd.allreduce(x, op=hvd.Sum),
        "allreduce_": lambda x: hvd.allreduce_(x.copy(), op=hvd.Average),
        "grouped_allreduce": lambda x: hvd.grouped_allreduce([x, x[:1]], op=hvd.Max),
        "broadcast": lambda x: hvd.broadcast(x, LAST),
        "broadcast_": lambda x: hvd.broadcast_(x.copy(), 0),
        "allgather": lambda x: hvd.allgather(x),
        "broadcast_object": lambda x: hvd.broadcast_object(x.tolist(), LAST),
        "allgather_object": lambda x: hvd.allgather_object(x.tolist()),
    }
    for kind, call in calls.items():
        # A first call gathers its data; a broadcast_object's, which needs no plan, and a
        # repeated small broadcast's ride in the root's record (see records.py).
        rides = ("broadcast_object",) if kind == "broadcast_object" else ()
        for repeat in (False, True):
            exchanges, gathers, others = counted(lambda: call(small))
            want = 0 if kind in rides or (repeat and kind.startswith("broadcast")) else 1
            if (exchanges, gathers, others) != (1, want, []):
                failures.append(f"small {kind}{' again' if repeat else ''}: {exchanges} "
                                f"exchanges, {gathers} gathers and MPI calls {others}, want "
                                f"1, {want} and none")
        exchanges, _, others = counted(lambda: call(large))
        if exchanges != 1 or not others:
            failures.append(f"large {kind}: {exchanges} exchanges and MPI calls {others}, "
                            "want 1 and a data phase")
    made = counted(hvd.barrier)
    if made != (1, 0, []):
        failures.append(f"barrier: {made[0]} exchanges, {made[1]} gathers and MPI calls "
                        f"{made[2]}")


def reference(op, inputs, dtype, pre=1.0, post=1.0):
    """NumPy's reduction of the ranks' ``inputs``, as documented: the sums are exact (small
    integers), scale factors multiply in the dtype's precision, 16-bit floats are prescaled
    in their own, then summed and postscaled in float32 and rounded once, integers truncate
    toward zero."""
    stacked = np.stack(inputs)
    if op in (hvd.Sum, hvd.Average):
        if np.dtype(dtype).kind == "b":
            return stacked.any(axis=0)
        factor = post / (N if op == hvd.Average else 1)
        if np.dtype(dtype).itemsize == 2 and np.dtype(dtype).kind in "fV":
            # Prescaled in their own precision, then summed and postscaled in float32.
            scaled = (stacked * np.dtype(dtype).type(pre)).astype(np.float32)
            return (scaled.sum(axis=0, dtype=np.float32) * np.float32(factor)).astype(dtype)
        if np.dtype(dtype).kind in "iu":  # each rank's prescaled input truncates, then the sum
            total = np.trunc(stacked * pre).sum(axis=0) * factor
            return np.trunc(total).astype(dtype)
        # The factors in the dtype's precision, as Horovod multiplies (the sums are exact).
        real = np.dtype(dtype).type(0).real.dtype.type
        total = (stacked * real(pre)).sum(axis=0).astype(dtype)
        return (total * real(factor)).astype(dtype)
    ufunc = {hvd.Min: np.minimum, hvd.Max: np.maximum, hvd.Product: np.multiply}[op]
    return ufunc.reduce(stacked, axis=0).astype(dtype)


def results():
    dtypes = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int8,
              np.uint8, np.int64, np.complex64, np.bool_]
    for dtype in dtypes:
        itemsize = np.dtype(dtype).itemsize
        for count in (0, 1, 7, ROOM // itemsize, ROOM // itemsize + 1):
            for op in ([hvd.Sum, hvd.Average, hvd.Product] if np.dtype(dtype).kind in "cb"
                       else [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]):
                tag = f"{np.dtype(dtype).name}.{count}.{op.name}"
                inputs = [data(tag, r, (count,), dtype) for r in range(N)]
                check(f"allreduce {tag}", hvd.allreduce(inputs[R], op=op),
                      reference(op, inputs, dtype))
            inplace = data(tag, R, (count,), dtype)
            hvd.allreduce_(inplace, op=hvd.Sum)
            check(f"allreduce_ {tag}", inplace,
                  reference(hvd.Sum, [data(tag, r, (count,), dtype) for r in range(N)], dtype))
    # Scale factors, 16-bit floats among them (summed and scaled in float32).
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.int32):
        inputs = [data("scaled", r, (6, 5), dtype) for r in range(N)]
        check(f"scaled {np.dtype(dtype).name}",
              hvd.allreduce(inputs[R], op=hvd.Average, prescale_factor=0.5,
                            postscale_factor=3.0),
              reference(hvd.Average, inputs, dtype, 0.5, 3.0))
    # A 0-d array, a strided one, and a small group of one dtype.
    check("0-d", hvd.allreduce(np.array(R + 1.0), op=hvd.Sum), np.array(N * (N + 1) / 2))
    strided = [(np.arange(20.0).reshape(4, 5) + r)[:, ::2] for r in range(N)]
    check("strided", hvd.allreduce(strided[R], op=hvd.Sum), np.sum(strided, axis=0))
    group = [[data(f"group{i}", r, shape, np.float32) for r in range(N)]
             for i, shape in enumerate([(3, 2), (0,), (5,)])]
    for i, got in enumerate(hvd.grouped_allreduce([g[R] for g in group], op=hvd.Min)):
        check(f"group {i}", got, reference(hvd.Min, group[i], np.float32))
    # Broadcast from every root, small and large, in place and not.
    for root in range(N):
        for count in (0, 3, ROOM // 8 + 1):
            inputs = [data(f"bcast{root}", r, (count,), np.float64) for r in range(N)]
            check(f"broadcast root={root} n={count}", hvd.broadcast(inputs[R], root),
                  inputs[root])
            mine = inputs[R].copy()
            hvd.broadcast_(mine, root)
            check(f"broadcast_ root={root} n={count}", mine, inputs[root])
    # Allgather with rows that differ per rank (none on rank 0), small and large rows.
    for width in (3, ROOM // 4):
        inputs = [data(f"gather{width}", r, (r, width), np.float32) for r in range(N)]
        check(f"allgather width={width}", hvd.allgather(inputs[R]), np.concatenate(inputs))
    objects = [{"rank": r, "values": list(range(r + 2))} for r in range(N)]
    if hvd.broadcast_object(objects[R], LAST) != objects[LAST]:
        failures.append("broadcast_object")
    if hvd.allgather_object(objects[R]) != objects:
        failures.append("allgather_object")


def raised(call):
    """(type name, message) of what ``call()`` raised, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares whatever comes
        return type(e).__name__, str(e)
    return None


def mismatches():
    small, large = 4, ROOM // 4 + 8
    cases = {
        "dtype": lambda n: hvd.allreduce(np.zeros(n, np.float32 if R != LAST else np.float64),
                                         name="d"),
        "op": lambda n: hvd.allreduce(np.zeros(n, np.float32), op=hvd.Sum if R else hvd.Max,
                                      name="o"),
        "scale": lambda n: hvd.allreduce(np.zeros(n, np.float32), op=hvd.Sum, name="s",
                                         postscale_factor=2.0 if R == LAST else 1.0),
        "root": lambda n: hvd.broadcast(np.zeros(n, np.float32), 0 if R != LAST else 1,
                                        name="r"),
        "allgather trailing shape": lambda n: hvd.allgather(
            np.zeros((n, 2 if R != LAST else 3), np.float32), name="g"),
        "kind": lambda n: (hvd.allreduce(np.zeros(n, np.float32), name="k") if R != LAST
                           else hvd.broadcast(np.zeros(n, np.float32), 0, name="k")),
        "argument": lambda n: hvd.allreduce(np.zeros(n, np.float32), name="a",
                                            op=hvd.Sum if R != LAST else "mean"),
        "root argument": lambda n: hvd.broadcast(np.zeros(n, np.float32), name="b",
                                                 root_rank=0 if R != LAST else N),
        "object root argument": lambda n: hvd.broadcast_object(list(range(n)), name="bo",
                                                               root_rank=0 if R != LAST
                                                               else "first"),
        "unpicklable object": lambda n: hvd.broadcast_object(
            (lambda: n) if R == 0 else list(range(n)), 0, name="u"),
    }
    for label, call in cases.items():
        quick, slow = raised(lambda: call(small)), raised(lambda: call(large))
        if quick is None or quick != slow:
            failures.append(f"{label}: small data raised {quick}, large data {slow}")
        elif len(set(hvd.allgather_object(quick))) != 1:
            failures.append(f"{label}: ranks raised different errors")
        if hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() != [N, N]:
            failures.append(f"{label}: the next allreduce went wrong")
    # Small on some ranks and large on another: the shapes differ, named in the message.
    error = raised(lambda: hvd.allreduce(np.zeros(small if R != LAST else large, np.float32),
                                         name="m"))
    want = ("MismatchError", "allreduce 'm': ranks disagree on shape of tensor 0 'm' ("
            + ", ".join(f"rank {r}: ({small if r != LAST else large},)" for r in range(N))
            + ")")
    if error != want:
        failures.append(f"small against large: raised {error}, want {want}")
    if hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() != [N, N]:
        failures.append("small against large: the next allreduce went wrong")


def one_rank_too_large():
    rows = [1 if r != LAST else ROOM // 8 + 1 for r in range(N)]
    inputs = [data("too large", r, (rows[r], 2), np.float32) for r in range(N)]
    got = []
    exchanges, _, others = counted(lambda: got.append(hvd.allgather(inputs[R])))
    check("allgather", got[0], np.concatenate(inputs))
    if exchanges != 1 or not others:
        failures.append(f"allgather: {exchanges} exchanges and MPI calls {others}, want 1 "
                        "and a data phase on every rank")
    objects = [bytes(5 if r != LAST else ROOM + 1) for r in range(N)]
    if hvd.allgather_object(objects[R]) != objects:
        failures.append("allgather_object of one large object")


def inline_payloads():
    # broadcast_object from each rank in turn, of pickles from 4 bytes to past the record's
    # room and the carrier's: every rank gets the root's object, and those of at most
    # INLINE_ROOM bytes travel in the agreement's exchange alone (no gather, no data phase).
    hvd.barrier()
    for k, length in enumerate([0, 1, 60, 112, 113, 114, 150, 40, 3000, ROOM + 10, 2]):
        root = k % N
        mine = "abcdefgh"[R] * length  # each rank's own: a stale byte of another's shows
        got = []
        exchanges, gathers, others = counted(
            lambda: got.append(hvd.broadcast_object(mine, root)))
        want, [result] = "abcdefgh"[root] * length, got
        if result != want:
            failures.append(f"broadcast_object of {length} characters from rank {root}: got "
                            f"{result[:8]!r}... ({len(result)})")
        size = len(pickle.dumps(want, protocol=pickle.HIGHEST_PROTOCOL))
        if size <= records.INLINE_ROOM and (exchanges, gathers, others) != (1, 0, []):
            failures.append(f"broadcast_object of a {size}-byte pickle: {exchanges} exchanges, "
                            f"{gathers} gathers and MPI calls {others}, want 1, 0 and none")
    # A repeated broadcast_ of a small tensor: one exchange from its second call on.
    for dtype, count in ((np.uint8, 1), (np.float64, 16), (np.float32, 33)):
        for repeat in range(3):
            tensor = data(f"inline {repeat}", R, (count,), dtype)
            exchanges, gathers, _ = counted(lambda: hvd.broadcast_(tensor, LAST))
            check(f"broadcast_ {dtype.__name__} x{count}", tensor,
                  data(f"inline {repeat}", LAST, (count,), dtype))
            want = 0 if tensor.nbytes <= records.INLINE_ROOM else 1
            if repeat and (exchanges, gathers) != (1, want):
                failures.append(f"broadcast_ of {tensor.nbytes} bytes again: {exchanges} "
                                f"exchanges and {gathers} gathers, want 1 and {want}")


run_cases({"one exchange": one_exchange, "results": results, "mismatches": mismatches,
           "one rank's data too large": one_rank_too_large,
           "inline payloads": inline_payloads}, failures, R)
