"""16-bit float ring sums and the reducer's fp16 path, on NumPy's and torch's kernels, on 2 and
3 ranks against NumPy by hand (see the worker). One job per rank count; each case its own
result."""
import functools

import pytest

from runner import run_ranks

DTYPES = ("float16", "bfloat16")
CASES = [f"{k} {d} ring" for k in ("numpy", "torch") for d in DTYPES] + \
    [f"torch api {d} sum" for d in DTYPES] + [f"{k} reducer fp16" for k in ("numpy", "torch")]


@functools.lru_cache(maxsize=None)
def job(np_: int) -> str:
    proc = run_ranks("fp16_ring_worker.py", np_, timeout=300, check=False)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("np_", [2, 3])
def test_fp16_ring_matches_numpy(np_, case):
    out = job(np_)
    assert all(f"rank {r} {case}: ok" in out for r in range(np_)), out
