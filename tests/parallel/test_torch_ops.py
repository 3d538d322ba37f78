"""hvd_trainer.torch on 2 and 3 ranks: every collective and dtype against NumPy, async handles,
sparse tensors and one-rank argument errors (workers/torch_ops_worker.py); autograd through
the collectives, broadcast_parameters, broadcast_optimizer_state and SyncBatchNorm against
single-process references (workers/torch_training_worker.py).
"""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_tensor_collectives_match_numpy(np_):
    out = run_ranks("torch_ops_worker.py", np_, timeout=180).stdout
    assert out.count("torch ops ok") == np_, out


@pytest.mark.parametrize("np_", [2, 3])
def test_autograd_parameters_optimizer_state_and_sync_batch_norm(np_):
    out = run_ranks("torch_training_worker.py", np_, timeout=180).stdout
    assert out.count("torch training ok") == np_, out
