"""The core's gradient reducer on plain NumPy gradients, on 2 and 3 ranks (see the worker)."""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_reducer_sums_like_numpy_on_every_rank(np_):
    out = run_ranks("reducer_worker.py", np_, timeout=180).stdout
    assert out.count("reducer cases passed") == np_
