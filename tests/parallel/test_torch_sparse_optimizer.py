"""hvd_trainer.torch.DistributedOptimizer with nn.Embedding(sparse=True) and
sparse_as_dense=False on 2 and 3 ranks against one process on the global batch
(workers/torch_sparse_optimizer.py): SGD, op=Sum, a predivide factor,
backward_passes_per_step=2, Adagrad and SparseAdam, ranks without an embedding gradient or
without touched rows, fp16 compression (which leaves sparse gradients exact); sparse
gradients stay sparse and hold the rows touched on any rank; the rows travel by allgather,
or by the dense fallback when the ranks together touch more rows than the table has.
"""
import pytest

from runner import run_ranks

ROW_CASES = ["sgd", "sgd, idle ranks", "sum with lr / size", "predivide",
             "backward_passes_per_step=2", "adagrad, idle ranks", "sparse adam, idle ranks",
             "fp16 compression leaves sparse gradients exact"]
DENSE_CASES = ["dense fallback: sgd", "dense fallback: adagrad, idle ranks"]


@pytest.fixture(scope="module", params=[2, 3])
def job(request):
    """One run of the worker per number of ranks: (ranks, output)."""
    return request.param, run_ranks("torch_sparse_optimizer.py", request.param,
                                    timeout=180).stdout


def test_sparse_gradients_by_row_allgather_match_one_process(job):
    np_, out = job
    for case in ROW_CASES:
        assert out.count(f"torch sparse ok: {case}\n") == np_, (case, out)


def test_dense_fallback_matches_one_process(job):
    np_, out = job
    for case in DENSE_CASES:
        assert out.count(f"torch sparse ok: {case}\n") == np_, (case, out)
