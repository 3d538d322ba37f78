"""Small collectives whose data travels in the agreement's exchange (issue 25), on 2 and 3
ranks: one exchange per call, results equal to NumPy's, the same errors as on large data,
and the slow way where one rank's data does not fit. One job per rank count; each case is
its own result."""
import functools

import pytest

from runner import run_ranks

CASES = ["one exchange", "results", "mismatches", "one rank's data too large"]
# A job that hangs ends itself, naming where it waited, instead of holding the suite.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@functools.lru_cache(maxsize=None)
def job(np_: int) -> str:
    proc = run_ranks("small_collectives_worker.py", np_, timeout=300, env=BOUNDED, check=False)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("np_", [2, 3])
def test_small_collectives_case(np_, case):
    out = job(np_)
    passed = [r for r in range(np_) if f"rank {r} {case}: ok" in out]
    assert passed == list(range(np_)), out
