"""The core's gradient reducer on plain NumPy gradients, on 2 and 3 ranks (see the worker)."""
import pytest

from runner import case_job, case_names


@pytest.mark.parametrize("case", case_names("reducer_worker.py"))
@pytest.mark.parametrize("np_", [2, 3])
def test_reducer_sums_like_numpy_on_every_rank(np_, case):
    case_job("reducer_worker.py", np_, timeout=180).check(case)
