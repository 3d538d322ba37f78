"""DistributedTrainer on 2 and 3 ranks against single-process gluon.Trainer references.

The workers hold the cases (see their docstrings); one launch checks many cases because each
MXNet rank takes seconds to start on two cores. The gradient buckets and the overlap of
communication with backward must not change results: the cases also run with the overlap
on (off is the default), and with it on, with one bucket per gradient and with a single
bucket.
"""
import pytest

from runner import run_ranks

EQUIVALENCE_CASES = 7
OVERLAP_ON = {"HVD_OVERLAP": "1"}
BUCKET_PER_TENSOR = {"HVD_OVERLAP": "1", "HVD_BUCKET_THRESHOLD": "1"}
ONE_BUCKET = {"HVD_OVERLAP": "1", "HVD_BUCKET_THRESHOLD": str(1 << 40)}


@pytest.mark.parametrize("np_,env", [(2, {}), (3, {}), (2, OVERLAP_ON), (2, BUCKET_PER_TENSOR),
                                     (3, ONE_BUCKET)],
                         ids=["2", "3", "2-overlap-on", "2-bucket-per-tensor", "3-one-bucket"])
def test_ranks_match_one_process_on_the_global_batch(np_, env):
    out = run_ranks("trainer_equivalence.py", np_, timeout=120, env=env).stdout
    assert out.count("all trainer equivalence cases passed") == np_
    assert out.count("OK ") == EQUIVALENCE_CASES


@pytest.mark.parametrize("env", [{}, OVERLAP_ON, BUCKET_PER_TENSOR],
                         ids=["default", "overlap-on", "bucket-per-tensor"])
def test_prefixes_stale_gradients_and_resume(tmp_path, env):
    out = run_ranks("trainer_features.py", 3, [str(tmp_path)], timeout=120, env=env).stdout
    assert out.count("all trainer feature cases passed") == 3
    assert out.count("OK ") == 4
