"""An uncaught exception on one rank ends the whole job quickly, with its traceback shown."""
import time

import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_exception_on_one_rank_ends_the_job(np_):
    start = time.monotonic()
    proc = run_ranks("failing_worker.py", np_, timeout=60, check=False)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    assert "[1]<stderr>:ZeroDivisionError: rank 1 fails at step 3" in proc.stderr
    assert "rank 1 exited with code 1 (first failure)" in proc.stderr
