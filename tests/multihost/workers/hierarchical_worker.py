"""One rank of a job with hierarchical allreduce and allgather asked for: says whether they run
hierarchically here, then checks each case against NumPy.

Prints ``hierarchical on`` or ``off``, then per case ``case NAME ok`` or ``case NAME failed:
WHY``. Every buffer is larger than what the agreement's carrier takes (4 KiB), so each call
moves its data through the data phase; the 1.6 MB ones take the ring across hosts under
HVD_ALLREDUCE_ALGO=auto, the smaller ones MPI's allreduce. Float sums and products are
compared to NumPy's float64 within a tolerance (the summation order differs from the flat
ring's and from NumPy's); integer, boolean, Min and Max results, NaN included, and the
allgathers must be exact. A last case checks that every rank got the same bits.
"""
import hashlib

import numpy as np

import hvd_trainer as hvd
from hvd_trainer.collectives import hierarchical

hvd.init()
R, N = hvd.rank(), hvd.size()
print(f"hierarchical {'on' if hierarchical.active() else 'off'}", flush=True)
BIG, SMALL = 400_000, 10_000  # elements


def data(rank, count, dtype, seed=0):
    x = np.random.default_rng([rank, count, seed]).standard_normal(count)
    return x.astype(dtype)


def every(count, dtype, seed=0):
    return np.stack([data(r, count, dtype, seed) for r in range(N)])


def reduced(op, tensor, name, **kw):
    return hvd.allreduce(tensor, op=op, name=name, **kw)


def sum_float32():
    got = reduced(hvd.Sum, data(R, BIG, np.float32), "sum_float32")
    return np.allclose(got, every(BIG, np.float64).sum(0), rtol=1e-5, atol=1e-5), got


def average_float64():
    got = reduced(hvd.Average, data(R, SMALL, np.float64), "average_float64")
    return np.allclose(got, every(SMALL, np.float64).mean(0), rtol=1e-12, atol=1e-12), got


def sum_int32_wraps():
    big = lambda r: (data(r, BIG, np.float64) * 2**30).astype(np.int32)  # sums overflow
    got = reduced(hvd.Sum, big(R), "sum_int32")
    want = np.sum([big(r) for r in range(N)], axis=0, dtype=np.int32)
    return np.array_equal(got, want), got


def with_nan(rank, count):
    x = data(rank, count, np.float32)
    x[rank::7] = np.nan  # every rank a NaN somewhere, some places NaN on one rank only
    return x


def min_float32_nan():
    got = reduced(hvd.Min, with_nan(R, BIG), "min_float32")
    want = np.minimum.reduce([with_nan(r, BIG) for r in range(N)])
    return np.array_equal(got, want, equal_nan=True), got


def max_float32_nan():
    got = reduced(hvd.Max, with_nan(R, SMALL), "max_float32")
    want = np.maximum.reduce([with_nan(r, SMALL) for r in range(N)])
    return np.array_equal(got, want, equal_nan=True), got


def product_float64():
    near_one = lambda r: 1 + data(r, BIG, np.float64, seed=1) / 100
    got = reduced(hvd.Product, near_one(R), "product_float64")
    return np.allclose(got, np.prod([near_one(r) for r in range(N)], axis=0), rtol=1e-12), got


def sum_float16():
    # Added in float32 and rounded to half after each addition: within a few half ulps.
    got = reduced(hvd.Sum, data(R, BIG, np.float16), "sum_float16")
    want = every(BIG, np.float16).astype(np.float64).sum(0)
    return np.allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3), got


def sum_bool():
    flags = lambda r: data(r, SMALL, np.float64) > 1.5
    got = reduced(hvd.Sum, flags(R), "sum_bool")
    return np.array_equal(got, np.logical_or.reduce([flags(r) for r in range(N)])), got


def grouped_mixed():
    parts = [data(R, BIG // 2, np.float32), data(R, SMALL, np.float64, seed=2)]
    got = hvd.grouped_allreduce(parts, op=hvd.Sum, name="grouped_mixed")
    ok = (np.allclose(got[0], every(BIG // 2, np.float64).sum(0), rtol=1e-5, atol=1e-5)
          and np.allclose(got[1], every(SMALL, np.float64, seed=2).sum(0), rtol=1e-12))
    return ok, np.concatenate([g.astype(np.float64) for g in got])


def allgather_rows():
    rows = lambda r: np.full((1000 * (r + 1), 7), r, np.int64) + np.arange(7)
    got = hvd.allgather(rows(R), name="allgather_rows")
    return np.array_equal(got, np.concatenate([rows(r) for r in range(N)])), got


def allgather_float32():
    got = hvd.allgather(data(R, SMALL, np.float32).reshape(-1, 10), name="allgather_float32")
    return np.array_equal(got, every(SMALL, np.float32).reshape(-1, 10)), got


def process_set_sum():
    # A process set stays flat: the first and the last rank, on two hosts where there are.
    members = [0, N - 1]
    ps = hvd.add_process_set(members)
    got = hvd.allreduce(data(R, BIG, np.float32), op=hvd.Sum, name="set_sum", process_set=ps) \
        if R in members else None
    ok = got is None or np.allclose(got, every(BIG, np.float64)[members].sum(0), rtol=1e-5,
                                    atol=1e-5)
    return ok, np.zeros(0) if got is None else got


CASES = [sum_float32, average_float64, sum_int32_wraps, min_float32_nan, max_float32_nan,
         product_float64, sum_float16, sum_bool, grouped_mixed, allgather_rows,
         allgather_float32, process_set_sum]
digests = {}
for case in CASES:
    try:
        ok, result = case()
        digests[case.__name__] = hashlib.sha256(result.tobytes()).hexdigest()
        print(f"case {case.__name__} {'ok' if ok else 'failed: differs from NumPy'}", flush=True)
    except Exception as error:  # reported as that case's failure; the next case still runs
        print(f"case {case.__name__} failed: {type(error).__name__}: {error}", flush=True)
seen = hvd.allgather_object(digests, name="digests")
shared = [name for name in digests if name != "process_set_sum"
          and len({d.get(name) for d in seen}) == 1]
print(f"case identical_on_every_rank "
      f"{'ok' if len(shared) == len(CASES) - 1 else 'failed: ' + str(sorted(set(digests) - set(shared)))}",
      flush=True)
