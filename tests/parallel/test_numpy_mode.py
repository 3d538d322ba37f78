"""numpy-mode Gluon (npx.set_np()) under DistributedTrainer on 3 ranks (2 with the overlap
on), against one gluon.Trainer on the global batch; with the overlap on, buckets are reduced
on the thread."""
import pytest

from runner import case_job, case_names


@pytest.mark.parametrize("case", case_names("numpy_equivalence.py"))
@pytest.mark.parametrize("np_,env", [(3, {}), (2, {"HVD_OVERLAP": "1"})],
                         ids=["3", "2-overlap-on"])
def test_numpy_mode_matches_one_process(np_, env, case):
    case_job("numpy_equivalence.py", np_, timeout=180, env=env).check(case)
