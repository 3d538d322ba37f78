"""DistributedTrainer when a Gluon script starts its own collectives mid-step, on 3 ranks,
with the step reduced on the calling thread (HVD_OVERLAP=0) and on the communication
thread (HVD_OVERLAP=1), against hand-computed weights and NumPy sums
(workers/mxnet_step_order.py): a synchronous and an asynchronous allreduce of the loss
between backward() and step(), and an optimizer that makes a collective in every update
while later buckets are still reduced. Each job is bounded: a hang ends it and fails the
cases it did not report."""
import pytest

from runner import case_job, case_names

BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "45",
           "HVD_BUCKET_THRESHOLD": "32"}


@pytest.mark.parametrize("case", case_names("mxnet_step_order.py"))
@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("np_", [3])
def test_collectives_mid_step_keep_every_rank_in_order(np_, overlap, case):
    case_job("mxnet_step_order.py", np_, timeout=180,
             env=dict(BOUNDED, HVD_OVERLAP=overlap)).check(case)
