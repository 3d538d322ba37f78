"""join on 3 ranks. workers/torch_join_worker.py: hvd_trainer.torch's reductions while
ranks are joined against NumPy, refused collectives raising on every rank that called them,
join's return value and the collectives after it, and DistributedOptimizer with unequal numbers
of batches per rank against a single-process run. workers/mxnet_join_worker.py: the same for
DistributedTrainer with hvd_trainer.join().
"""
import pytest

from runner import case_job, case_names


@pytest.mark.parametrize("case", case_names("torch_join_worker.py"))
@pytest.mark.parametrize("np_", [3])
def test_torch_join_serves_reductions_and_optimizer_steps(np_, case):
    # Small fusion buckets and the ring algorithm: the joined ranks' zeros must travel in the
    # same pieces as the others' tensors; small gradient buckets: several per step.
    env = {"HVD_FUSION_THRESHOLD": "4096", "HVD_ALLREDUCE_ALGO": "ring",
           "HVD_BUCKET_THRESHOLD": "100"}
    case_job("torch_join_worker.py", np_, timeout=120, env=env).check(case)


@pytest.mark.parametrize("np_", [3])
def test_distributed_trainer_with_unequal_batches_then_join(np_):
    case_job("mxnet_join_worker.py", np_, timeout=120).check("unequal_batches_then_join")
