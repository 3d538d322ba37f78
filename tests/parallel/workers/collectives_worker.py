"""Every collective on NumPy arrays, checked on each rank against a NumPy reference.

Each rank's input is regenerated from a seed, so every rank can compute the reference from
all ranks' inputs without any communication. Run as: worker.py <algorithm>; each case
reports on its own (case_runner.py).
"""
import os
import sys

import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases

os.environ["HVD_ALLREDUCE_ALGO"] = sys.argv.pop(1)  # the rest name cases
hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8,
          np.complex64, np.bool_]
SIZES = [0, 1, 2, 3, 7, 1000, 4097]
failures = []


def data(rank, shape, dtype, salt=0):
    rng = np.random.default_rng([rank, salt, *shape])
    x = rng.integers(0, 5, size=shape)  # small integers: sums are exact in every dtype
    if np.dtype(dtype).kind == "c":
        return (x + 1j * rng.integers(0, 5, size=shape)).astype(dtype)
    return x.astype(dtype)


TOLERANCE = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-6, np.dtype(np.complex64): 1e-6,
             np.dtype(np.float64): 1e-13}


def check(label, got, want):
    """Exact for integers; within a few units in the last place for floating point."""
    want = np.asarray(want)
    rtol = TOLERANCE.get(want.dtype, 0)
    if (got.shape != want.shape or got.dtype != want.dtype
            or not np.allclose(got, want, rtol=rtol, atol=0)):
        failures.append(f"{label}: got {got.dtype}{got.shape} {got.ravel()[:5]}, "
                        f"want {want.dtype}{want.shape} {want.ravel()[:5]}")


def reference(op, xs, dtype):
    stacked = np.stack(xs)
    if op in (hvd.Sum, hvd.Average):
        if dtype == np.bool_:
            return stacked.any(axis=0)
        total = stacked.sum(axis=0, dtype=np.complex128 if np.dtype(dtype).kind == "c" else np.float64)
        if op == hvd.Average:
            total = total / N
        return total.astype(dtype) if np.dtype(dtype).kind in "fc" else np.trunc(total).astype(dtype)
    if op == hvd.Min:
        return stacked.min(axis=0)
    if op == hvd.Max:
        return stacked.max(axis=0)
    return stacked.prod(axis=0).astype(dtype)


def case_allreduce():
    for dtype in DTYPES:
        for n in SIZES:
            xs = [data(r, (n,), dtype) for r in range(N)]
            ops = [hvd.Sum, hvd.Average, hvd.Product] if np.dtype(dtype).kind == "c" else \
                [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
            for op in ops:
                label = f"allreduce {np.dtype(dtype).name} n={n} {op.name}"
                check(label, hvd.allreduce(xs[R], op=op), reference(op, xs, dtype))
            inplace = xs[R].copy()
            hvd.allreduce_(inplace, op=hvd.Sum, name=f"inplace.{n}")
            check(f"allreduce_ {np.dtype(dtype).name} n={n}", inplace, reference(hvd.Sum, xs, dtype))


def case_allreduce_big():
    """Large buffers cross the ring threshold of `auto`."""
    for dtype in (np.float32, np.float16, np.int64):
        n = 1 << 20
        xs = [data(r, (n,), dtype, salt=1) for r in range(N)]
        mine = xs[R].copy()
        check(f"allreduce big {np.dtype(dtype).name}", hvd.allreduce(xs[R], op=hvd.Sum),
              reference(hvd.Sum, xs, dtype))
        # The ring reduces from the input straight into the output: the input is only read.
        check(f"allreduce big {np.dtype(dtype).name} leaves its input", xs[R], mine)


def case_float16_accumulation():
    """Float16 sums beyond 2048, where float16 spacing is 2."""
    xs = [np.full(9, 1024.0 + r, np.float16) for r in range(N)]
    check("float16 accumulation", hvd.allreduce(xs[R], op=hvd.Sum),
          np.full(9, sum(1024.0 + r for r in range(N)), np.float16))


def case_zero_d_and_scaling():
    """0-d arrays and scaling."""
    check("0-d", hvd.allreduce(np.array(R + 1.0), op=hvd.Sum), np.array(N * (N + 1) / 2))
    check("prescale/postscale", hvd.allreduce(np.arange(5.0) + R, op=hvd.Sum, prescale_factor=2.0,
                                              postscale_factor=0.5),
          sum(np.arange(5.0) + r for r in range(N)))


def case_grouped_allreduce():
    """Grouped allreduce mixes dtypes and tiny fusion buckets."""
    shapes = [(3, 4), (0,), (1,), (5, 2, 3), (), (129,)]
    group = [data(R, s, np.float32 if i % 2 else np.int32, salt=i) for i, s in enumerate(shapes)]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum)
    for i, (s, o) in enumerate(zip(shapes, outs)):
        dt = np.float32 if i % 2 else np.int32
        check(f"grouped[{i}]", o, reference(hvd.Sum, [data(r, s, dt, salt=i) for r in range(N)], dt))
    hvd.grouped_allreduce_(group, op=hvd.Average)
    for i, s in enumerate(shapes):
        dt = np.float32 if i % 2 else np.int32
        check(f"grouped_[{i}]", group[i],
              reference(hvd.Average, [data(r, s, dt, salt=i) for r in range(N)], dt))


def case_allgather():
    """Allgather with a first dimension that differs per rank (rank 0 sends no rows)."""
    for dtype in (np.float32, np.float16, np.uint8):
        xs = [data(r, (r, 3), dtype) for r in range(N)]
        check(f"allgather {np.dtype(dtype).name}", hvd.allgather(xs[R]), np.concatenate(xs))
    got = hvd.grouped_allgather([np.full((1,), R), np.full((R + 1, 2), R, np.float64)])
    check("grouped_allgather[0]", got[0], np.arange(N))
    check("grouped_allgather[1]", got[1], np.concatenate([np.full((r + 1, 2), r, np.float64) for r in range(N)]))


def case_broadcast():
    """Broadcast from every root, in and out of place."""
    for root in range(N):
        xs = [data(r, (4, 5), np.float64, salt=root) for r in range(N)]
        check(f"broadcast root={root}", hvd.broadcast(xs[R], root_rank=root), xs[root])
        y = xs[R].copy()
        hvd.broadcast_(y, root_rank=root)
        check(f"broadcast_ root={root}", y, xs[root])


def case_alltoall():
    """Alltoall, even and with uneven splits (rank r sends (r + k) % 3 rows to rank k)."""
    xs = [data(r, (2 * N, 3), np.int32) for r in range(N)]
    check("alltoall even", hvd.alltoall(xs[R]), np.concatenate([x[2 * R:2 * R + 2] for x in xs]))
    splits = [[(r + k) % 3 for k in range(N)] for r in range(N)]
    xs = [data(r, (sum(splits[r]), 2), np.float32, salt=9) for r in range(N)]
    out, received = hvd.alltoall(xs[R], splits=splits[R])
    want = np.concatenate([xs[r][sum(splits[r][:R]):sum(splits[r][:R + 1])] for r in range(N)])
    check("alltoall splits", out, want)
    check("alltoall received", received, np.array([splits[r][R] for r in range(N)], np.int64))


def case_reducescatter():
    """Reducescatter: Horovod's row split, the first ranks take one extra row."""
    for rows in (0, 1, N + 1, 7):
        xs = [data(r, (rows, 2), np.float32, salt=rows) for r in range(N)]
        total = np.sum(xs, axis=0) / N
        base, extra = divmod(rows, N)
        start = R * base + min(R, extra)
        mine = base + (1 if R < extra else 0)
        check(f"reducescatter rows={rows}", hvd.reducescatter(xs[R]), total[start:start + mine].astype(np.float32))
    xs = [data(r, (5,), np.float16) for r in range(N)]
    got = hvd.grouped_reducescatter([xs[R], xs[R].astype(np.int32)], op=hvd.Sum)
    base, extra = divmod(5, N)
    start, mine = R * base + min(R, extra), base + (1 if R < extra else 0)
    check("grouped_reducescatter f16", got[0], np.sum(xs, axis=0)[start:start + mine])
    check("grouped_reducescatter i32", got[1], np.sum(xs, axis=0).astype(np.int32)[start:start + mine])


def case_objects():
    """Objects."""
    if hvd.broadcast_object({"from": R, "x": [1, 2]}, root_rank=N - 1) != {"from": N - 1, "x": [1, 2]}:
        failures.append("broadcast_object")
    if hvd.allgather_object(("r", R)) != [("r", r) for r in range(N)]:
        failures.append("allgather_object")


def case_any_rank():
    """Flags or-ed over the ranks, a few (inside the agreement's record) and 400 (more than
    it holds)."""
    from hvd_trainer.collectives import ops
    if ops.any_rank([R == 0, R == N - 1, False], "any few") != [True, True, False]:
        failures.append("any_rank, few flags")
    every = [np.random.RandomState(r).rand(400) < 0.2 for r in range(N)]
    if ops.any_rank(every[R].tolist(), "any many") != np.any(every, axis=0).tolist():
        failures.append("any_rank, 400 flags")


def case_process_sets():
    """Process sets: on 3 ranks {0, 2} leaves rank 1 outside; on 2 ranks {1} leaves rank 0
    outside."""
    members = [0, N - 1] if N > 2 else [1]
    ps = hvd.add_process_set(members)
    if ps.included():
        check("process set allreduce", hvd.allreduce(np.array([R + 1.0]), op=hvd.Sum, process_set=ps),
              np.array([sum(r + 1.0 for r in members)]))
        if ps.rank() != members.index(R) or ps.size() != len(members):
            failures.append(f"process set rank/size {ps.rank()}/{ps.size()}")
    else:
        try:
            hvd.allreduce(np.ones(1), process_set=ps)
            failures.append("allreduce outside the process set did not raise")
        except ValueError as e:
            if "not a part of process set" not in str(e):
                failures.append(f"outside process set: {e}")
    if not hvd.remove_process_set(ps) or hvd.remove_process_set(ps):
        failures.append("remove_process_set")


run_cases({"allreduce": case_allreduce, "allreduce_big": case_allreduce_big, "float16_accumulation": case_float16_accumulation, "zero_d_and_scaling": case_zero_d_and_scaling, "grouped_allreduce": case_grouped_allreduce, "allgather": case_allgather, "broadcast": case_broadcast, "alltoall": case_alltoall, "reducescatter": case_reducescatter, "objects": case_objects, "any_rank": case_any_rank, "process_sets": case_process_sets}, failures, R)
