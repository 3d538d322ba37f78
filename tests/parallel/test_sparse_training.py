"""Row-sparse gradients on 2 and 3 ranks against a single-process gluon.Trainer reference.

One launch per world size runs every case of workers/sparse_equivalence.py (see its docstring).
"""
import pytest

from runner import run_ranks

SPARSE_CASES = 7


@pytest.mark.parametrize("np_", [2, 3])
def test_sparse_gradients_match_one_process_on_the_global_batch(np_):
    out = run_ranks("sparse_equivalence.py", np_, timeout=120).stdout
    assert out.count("all sparse equivalence cases passed") == np_
    assert out.count("OK ") == SPARSE_CASES
