"""Scaled sums round once, as Horovod's CPU path does (checked against NumPy on every rank).

On 3 ranks a half-precision sum of three equal tensors is not exact in half precision: a
float16 sum scaled after rounding to float16 is one unit off in the last place. float32 sums
are scaled in float32 by the factor rounded to float32, as Horovod multiplies (its own
postscale tests expect those bits).
"""
import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases

R, N = hvd.rank(), hvd.size()
rng = np.random.default_rng(1234)  # the same tensors on every rank
# a sum of three needs more bits than x
XS = {dtype: rng.uniform(-100, 100, 289).astype(dtype) for dtype in (np.float16, np.float32)}
failures = []


def scaled(dtype, label):
    x = XS[dtype]
    factor = 0.1915194503788923
    wide = np.float32
    shares = [17 // N + (r < 17 % N) for r in range(N)]  # rows per rank, the first ranks more
    mine = slice(sum(shares[:R]), sum(shares[:R + 1]))
    cases = {
        "postscale": (lambda: hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor),
                      (x.astype(wide) * N * wide(factor)).astype(dtype)),
        "average": (lambda: hvd.allreduce(x, op=hvd.Average),
                    (x.astype(wide) * N * wide(1 / N)).astype(dtype)),
        "reducescatter average": (
            lambda: hvd.reducescatter(x.reshape(17, 17), op=hvd.Average),
            (x.reshape(17, 17).astype(wide) * N * wide(1 / N)).astype(dtype)[mine]),
    }
    call, want = cases[label]
    got = call()
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        failures.append(f"{np.dtype(dtype).name} {label}: {bad.size} elements differ "
                        f"from NumPy, e.g. {got.reshape(-1)[bad[0]]!r} vs "
                        f"{want.reshape(-1)[bad[0]]!r}")


run_cases({"float16_postscale": lambda: scaled(np.float16, "postscale"),
           "float16_average": lambda: scaled(np.float16, "average"),
           "float16_reducescatter_average": lambda: scaled(np.float16, "reducescatter average"),
           "float32_postscale": lambda: scaled(np.float32, "postscale"),
           "float32_average": lambda: scaled(np.float32, "average"),
           "float32_reducescatter_average": lambda: scaled(np.float32, "reducescatter average")},
          failures, R)
