"""Scaled sums round as Horovod's tests expect: float16 sums are summed and scaled in float32
and rounded once, after a prescale rounded to float16; float32 ones are scaled by the factor
rounded to float32 (Horovod's test_mxnet1.py and test_torch.py compare with zero tolerance on
up to 3 ranks); Average with a rank joined scales its sum by 1/size rounded to the dtype,
as Horovod does. One job per rank count; each case its own result."""
import functools

import pytest

from runner import run_ranks

CASES = [f"{dtype} {label}" for dtype in ("float16", "float32")
         for label in ("postscale", "prescale", "average", "reducescatter average",
                       "reducescatter prescale")] + [
    f"{dtype} average with a rank joined" for dtype in ("float32", "float64")]


@functools.lru_cache(maxsize=None)
def job(np_: int) -> str:
    proc = run_ranks("scaled_sum_worker.py", np_, timeout=120, check=False)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("np_", [2, 3])
def test_scaled_sum_matches_numpy(np_, case):
    out = job(np_)
    assert all(f"rank {r} {case}: ok" in out for r in range(np_)), out
