"""DistributedTrainer on 2 and 3 ranks against single-process gluon.Trainer references.

The workers hold the cases (see their docstrings); one launch checks many cases because each
MXNet rank takes seconds to start on two cores.
"""
import pytest

from runner import run_ranks

EQUIVALENCE_CASES = 7


@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_match_one_process_on_the_global_batch(np_):
    out = run_ranks("trainer_equivalence.py", np_, timeout=120).stdout
    assert out.count("all trainer equivalence cases passed") == np_
    assert out.count("OK ") == EQUIVALENCE_CASES


def test_prefixes_stale_gradients_and_resume(tmp_path):
    out = run_ranks("trainer_features.py", 3, [str(tmp_path)], timeout=120).stdout
    assert out.count("all trainer feature cases passed") == 3
    assert out.count("OK ") == 4
