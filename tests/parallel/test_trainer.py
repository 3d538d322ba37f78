"""DistributedTrainer on 2 and 3 ranks against single-process gluon.Trainer references.

The workers hold the cases (see their docstrings); one launch checks many cases because each
MXNet rank takes seconds to start on two cores. The gradient buckets and the overlap of
communication with backward must not change results: the cases also run with the overlap
off, with one bucket per gradient and with a single bucket.
"""
import pytest

from runner import run_ranks

EQUIVALENCE_CASES = 7
OVERLAP_OFF = {"HVD_OVERLAP": "0"}
BUCKET_PER_TENSOR = {"HVD_BUCKET_THRESHOLD": "1"}
ONE_BUCKET = {"HVD_BUCKET_THRESHOLD": str(1 << 40)}


@pytest.mark.parametrize("np_,env", [(2, {}), (3, {}), (2, OVERLAP_OFF), (2, BUCKET_PER_TENSOR),
                                     (3, ONE_BUCKET)],
                         ids=["2", "3", "2-overlap-off", "2-bucket-per-tensor", "3-one-bucket"])
def test_ranks_match_one_process_on_the_global_batch(np_, env):
    out = run_ranks("trainer_equivalence.py", np_, timeout=120, env=env).stdout
    assert out.count("all trainer equivalence cases passed") == np_
    assert out.count("OK ") == EQUIVALENCE_CASES


@pytest.mark.parametrize("env", [{}, OVERLAP_OFF, BUCKET_PER_TENSOR],
                         ids=["default", "overlap-off", "bucket-per-tensor"])
def test_prefixes_stale_gradients_and_resume(tmp_path, env):
    out = run_ranks("trainer_features.py", 3, [str(tmp_path)], timeout=120, env=env).stdout
    assert out.count("all trainer feature cases passed") == 3
    assert out.count("OK ") == 4
