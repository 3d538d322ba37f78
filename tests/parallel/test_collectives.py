"""Real multi-process runs of the NumPy collectives, on 2 and 3 ranks (3 catches ring chunking
that only works for even sizes)."""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("algorithm", ["ring", "native", "auto"])
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_match_numpy(np_, algorithm):
    out = run_ranks("collectives_worker.py", np_, [algorithm], timeout=120).stdout
    assert out.count("all collectives match NumPy") == np_


@pytest.mark.parametrize("np_", [2, 3])
def test_disagreeing_ranks_all_raise(np_):
    out = run_ranks("mismatch_worker.py", np_, timeout=60).stdout
    assert out.count("every mismatch raised on every rank") == np_
