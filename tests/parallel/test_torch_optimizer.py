"""hvd_trainer.torch.DistributedOptimizer on 2 and 3 ranks against one process on the global
batch (workers/torch_optimizer_equivalence.py): SGD with momentum and weight decay, Adam,
AdamW, clipping through synchronize() and skip_synchronize(), an LR scheduler,
backward_passes_per_step=2, a parameter unused on one rank, op=Sum, a predivide factor,
several buckets, sparse embeddings with sparse_as_dense, and fp16 compression.
"""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_distributed_optimizer_matches_one_process(np_):
    out = run_ranks("torch_optimizer_equivalence.py", np_, timeout=300).stdout
    assert out.count("torch optimizer ok\n") == np_, out
