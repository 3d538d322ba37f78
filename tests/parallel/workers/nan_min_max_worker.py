"""Min and Max with NaN, ±inf and signed zeros, checked on each rank against NumPy.

Run as: nan_min_max_worker.py <algorithm>. Every float dtype (float16, float32, float64,
bfloat16), sizes that split unevenly over 3 ranks. The reference is np.minimum/np.maximum
over all ranks' inputs, which every rank regenerates from a seed; NaN must come out where
any rank had one. Every rank must also hold the same bytes (checked by an allgather of them).
Each input pattern is a case of its own (case_runner.py).
"""
import os
import sys

import ml_dtypes
import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases

os.environ["HVD_ALLREDUCE_ALGO"] = sys.argv.pop(1)  # the rest name cases
hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16]
SIZES = [1, 7, 1000]
failures = []


def finite(rank, n, salt):
    return np.random.default_rng([rank, n, salt]).integers(-50, 50, n).astype(np.float64)


def nan_on_one_rank(rank, n):
    x = finite(rank, n, 1)
    if rank == N - 1:  # the last rank: MPI's own MAX lost it on the other ranks
        x[::2] = np.nan
    return x


def nan_on_every_rank(rank, n):
    x = finite(rank, n, 2)
    x[rank::3] = np.nan  # some elements NaN on one rank, some on several
    x[0] = np.nan if rank == 0 else -np.nan  # both signs at one element
    return x


def infinities(rank, n):
    x = finite(rank, n, 3)
    x[rank % 2::2] = np.inf if rank % 2 else -np.inf
    x[-1] = [np.inf, -np.inf, np.nan][rank % 3]
    return x


def signed_zeros(rank, n):
    return np.where(np.arange(n) % 2 == rank % 2, 0.0, -0.0)


CASES = {"NaN on one rank": nan_on_one_rank, "NaN on every rank": nan_on_every_rank,
         "±inf": infinities, "-0 and +0": signed_zeros}
REFERENCE = {hvd.Min: np.minimum, hvd.Max: np.maximum}

def check_pattern(case):
    """Every dtype, size and op on the inputs of pattern ``case``."""
    make = CASES[case]
    for dtype in DTYPES:
        name = np.dtype(dtype).name
        for n in SIZES:
            xs = [make(r, n).astype(dtype) for r in range(N)]
            for op, ufunc in REFERENCE.items():
                label = f"{case} {name} n={n} {op.name}"
                got = hvd.allreduce(xs[R], op=op, name=label)
                want = ufunc.reduce(np.stack([x.astype(np.float64) for x in xs]), axis=0)
                if got.dtype != np.dtype(dtype) or not np.array_equal(
                        got.astype(np.float64), want.astype(dtype).astype(np.float64),
                        equal_nan=True):
                    bad = np.flatnonzero(~((got.astype(np.float64) == want)
                                           | (np.isnan(got.astype(np.float64)) & np.isnan(want))))
                    failures.append(f"{label}: got {got[bad[:4]]} at {bad[:4]}, NumPy gives "
                                    f"{want[bad[:4]]}")
                every = hvd.allgather(got.view(np.uint8)[None], name=f"bits {label}")
                if not (every == every[0]).all():
                    failures.append(f"{label}: ranks hold different bits")


run_cases({"nan_on_one_rank": lambda: check_pattern("NaN on one rank"),
           "nan_on_every_rank": lambda: check_pattern("NaN on every rank"),
           "infinities": lambda: check_pattern("±inf"),
           "signed_zeros": lambda: check_pattern("-0 and +0")}, failures, R)
