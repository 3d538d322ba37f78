"""Horovod's matching and no cascade after errors (issue 21), on 2 and 3 ranks: named
asynchronous calls pair by name, a duplicate name raises on its rank alone, and a long
sequence of good and bad calls keeps every rank in step. One job per rank count; each case
is its own result."""
import functools

import pytest

from runner import run_ranks

CASES = ["reordered", "duplicate", "unnamed after duplicate", "drifted counts",
         "different names", "waited handles", "behind a barrier", "diverged while joined",
         "random"]
# A job that hangs ends itself, naming where it waited, instead of holding the suite.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@functools.lru_cache(maxsize=None)
def job(np_: int) -> str:
    proc = run_ranks("matching_worker.py", np_, timeout=240, env=BOUNDED, check=False)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("np_", [2, 3])
def test_matching_case(np_, case):
    out = job(np_)
    passed = [r for r in range(np_) if f"rank {r} {case}: ok" in out]
    assert passed == list(range(np_)), out
