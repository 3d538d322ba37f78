"""hvd_trainer.torch.DistributedOptimizer on 3 ranks against one process on the global
batch (workers/torch_optimizer_equivalence.py): SGD with momentum and weight decay, Adam,
AdamW, clipping through synchronize() and skip_synchronize(), an LR scheduler,
backward_passes_per_step=2, a parameter unused on one rank, op=Sum, a predivide factor,
several buckets, sparse embeddings with sparse_as_dense, fp16 and packed top-k compression and
SyncBatchNorm (whose backward allreduce must not wait behind the gradients' step); each packed
codec (2-bit, scaled 2-bit, 1-bit, top-k, with error feedback) against a NumPy model of it
(workers/torch_compression_equivalence.py); and examples/torch_digits.py on 2 ranks.
"""
import os

import pytest

from runner import REPO, TORCH_JOB, TORCH_JOB_SECONDS, case_job, case_names, run_ranks


@pytest.mark.parametrize("case", case_names("torch_optimizer_equivalence.py"))
@pytest.mark.parametrize("np_", [3])
def test_distributed_optimizer_matches_one_process(np_, case):
    case_job("torch_optimizer_equivalence.py", np_, timeout=300).check(case)


def test_torch_digits_example_reaches_95_percent_on_two_ranks():
    out = run_ranks(os.path.join(REPO, "examples", "torch_digits.py"), 2, timeout=120).stdout
    last = [line for line in out.splitlines() if "epoch 25" in line]
    assert len(last) == 1, out
    assert float(last[0].split("test acc")[1].split()[0]) >= 0.95, out


@pytest.mark.parametrize("case", case_names("torch_compression_equivalence.py"))
@pytest.mark.parametrize("np_", [3])
def test_packed_codecs_match_a_numpy_model_of_each(np_, case):
    case_job(TORCH_JOB, np_, timeout=TORCH_JOB_SECONDS).check(case)


@pytest.mark.parametrize("case", case_names("torch_step_order.py"))
@pytest.mark.parametrize("np_", [3])
def test_collectives_between_backward_and_step_and_join_before_the_first_step(np_, case):
    case_job(TORCH_JOB, np_, timeout=TORCH_JOB_SECONDS).check(case)
