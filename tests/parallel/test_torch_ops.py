"""hvd_trainer.torch on 3 ranks: every collective and dtype against NumPy, async handles,
sparse tensors and one-rank argument errors (workers/torch_ops_worker.py); autograd through
the collectives, broadcast_parameters, broadcast_optimizer_state and SyncBatchNorm against
single-process references (workers/torch_training_worker.py).
"""
import pytest

from runner import TORCH_JOB, TORCH_JOB_SECONDS, case_job, case_names


@pytest.mark.parametrize("case", case_names("torch_ops_worker.py"))
@pytest.mark.parametrize("np_", [3])
def test_tensor_collectives_match_numpy(np_, case):
    case_job(TORCH_JOB, np_, timeout=TORCH_JOB_SECONDS).check(case)


@pytest.mark.parametrize("case", case_names("torch_training_worker.py"))
@pytest.mark.parametrize("np_", [3])
def test_autograd_parameters_optimizer_state_and_sync_batch_norm(np_, case):
    case_job(TORCH_JOB, np_, timeout=TORCH_JOB_SECONDS).check(case)
