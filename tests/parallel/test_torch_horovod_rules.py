"""Rules of horovod.torch that Horovod's own tests check, on 2 and 3 ranks, one job per rank
count and each case its own result (workers/torch_horovod_rules.py, whose docstring says what
each case checks): reducescatter's gradient, float alltoall splits,
broadcast_optimizer_state's zero gradients, SparseAdam with sparse_as_dense, and
DistributedOptimizer(op=Adasum)."""
import pytest

from runner import case_job, case_names


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names("torch_horovod_rules.py"))
def test_horovod_torch_rule(case, np_):
    case_job("torch_horovod_rules.py", np_, timeout=180).check(case)
