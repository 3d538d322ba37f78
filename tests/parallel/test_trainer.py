"""DistributedTrainer on 3 ranks (2 in two of the bucket variants) against single-process
gluon.Trainer references.

The workers hold the cases (see their docstrings); one launch checks many cases because each
MXNet rank takes seconds to start on two cores. The gradient buckets and the overlap of
communication with backward must not change results: the cases also run with the overlap
on (off is the default), and with it on, with one bucket per gradient and with a single
bucket.
"""
import pytest

from runner import case_job, case_names

OVERLAP_ON = {"HVD_OVERLAP": "1"}
BUCKET_PER_TENSOR = {"HVD_OVERLAP": "1", "HVD_BUCKET_THRESHOLD": "1"}
ONE_BUCKET = {"HVD_OVERLAP": "1", "HVD_BUCKET_THRESHOLD": str(1 << 40)}


@pytest.mark.parametrize("case", case_names("trainer_equivalence.py"))
@pytest.mark.parametrize("np_,env", [(3, {}), (2, OVERLAP_ON), (2, BUCKET_PER_TENSOR),
                                     (3, ONE_BUCKET)],
                         ids=["3", "2-overlap-on", "2-bucket-per-tensor", "3-one-bucket"])
def test_ranks_match_one_process_on_the_global_batch(np_, env, case):
    case_job("trainer_equivalence.py", np_, timeout=120, env=env).check(case)


@pytest.fixture(scope="module")
def features_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


@pytest.mark.parametrize("case", case_names("trainer_features.py"))
@pytest.mark.parametrize("env", [{}, OVERLAP_ON, BUCKET_PER_TENSOR],
                         ids=["default", "overlap-on", "bucket-per-tensor"])
def test_prefixes_stale_gradients_and_resume(features_folder, env, case):
    folder = features_folder / ("-".join(f"{k}={v}" for k, v in env.items()) or "default")
    folder.mkdir(exist_ok=True)
    case_job("trainer_features.py", 3, [str(folder)], timeout=120, env=env).check(case)
