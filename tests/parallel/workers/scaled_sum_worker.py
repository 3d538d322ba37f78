"""Scaled sums round once, as Horovod's CPU path does (checked against NumPy on every rank).

On 3 ranks a half-precision sum of three equal tensors is not exact in half precision, and
Average's 1/3 is not exact in float32: a float16 sum scaled after rounding to float16, or a
float32 sum scaled by a float32 1/3, is one unit off in the last place.
"""
import sys

import numpy as np

import hvd_trainer as hvd

R, N = hvd.rank(), hvd.size()
rng = np.random.default_rng(1234)  # the same tensors on every rank
failures = []
for dtype in (np.float16, np.float32):
    x = rng.integers(-100, 100, 289).astype(dtype)
    factor = 0.1915194503788923
    wide = np.float32 if dtype == np.float16 else np.float64
    shares = [17 // N + (r < 17 % N) for r in range(N)]  # rows per rank, the first ranks more
    mine = slice(sum(shares[:R]), sum(shares[:R + 1]))
    cases = {
        "postscale": (lambda: hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor),
                      (x.astype(wide) * N * wide(factor)).astype(dtype)),
        "average": (lambda: hvd.allreduce(x, op=hvd.Average),
                    (x.astype(wide) * N / N).astype(dtype)),
        "reducescatter average": (
            lambda: hvd.reducescatter(x.reshape(17, 17), op=hvd.Average),
            (x.reshape(17, 17).astype(wide) * N / N).astype(dtype)[mine]),
    }
    for label, (call, want) in cases.items():
        got = call()
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
            failures.append(f"{np.dtype(dtype).name} {label}: {bad.size} elements differ "
                            f"from NumPy, e.g. {got.reshape(-1)[bad[0]]!r} vs "
                            f"{want.reshape(-1)[bad[0]]!r}")
        else:
            print(f"rank {R} {np.dtype(dtype).name} {label}: ok", flush=True)
if failures:
    print(f"rank {R}:", *failures, sep="\n  ")
    sys.exit(1)
