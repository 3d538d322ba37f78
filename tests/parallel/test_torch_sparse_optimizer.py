"""hvd_trainer.torch.DistributedOptimizer with nn.Embedding(sparse=True) and
sparse_as_dense=False on 3 ranks against one process on the global batch
(workers/torch_sparse_optimizer.py): SGD, op=Sum, a predivide factor,
backward_passes_per_step=2, Adagrad and SparseAdam, ranks without an embedding gradient or
without touched rows, fp16 compression (which leaves sparse gradients exact); sparse
gradients stay sparse and hold the rows touched on any rank; the rows travel by allgather,
or by the dense fallback when the ranks together touch more rows than the table has.
"""
import pytest

from runner import TORCH_JOB, TORCH_JOB_SECONDS, case_job, case_names


@pytest.mark.parametrize("case", case_names("torch_sparse_optimizer.py"))
@pytest.mark.parametrize("np_", [3])
def test_sparse_gradients_match_one_process(np_, case):
    case_job(TORCH_JOB, np_, timeout=TORCH_JOB_SECONDS).check(case)
