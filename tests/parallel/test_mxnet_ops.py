"""The horovod.mxnet collectives on NDArrays, on 3 ranks, against NumPy references.

One launch runs every check (see workers/mxnet_ops_worker.py), shared with the sparse tests'
(runner.MXNET_JOB): starting ranks that import MXNet costs seconds, checking one more op
costs milliseconds.
"""
import pytest

from runner import MXNET_JOB, MXNET_JOB_SECONDS, case_job, case_names


@pytest.mark.parametrize("case", case_names("mxnet_ops_worker.py"))
@pytest.mark.parametrize("np_", [3])
def test_ndarray_collectives_match_numpy(np_, case):
    case_job(MXNET_JOB, np_, timeout=MXNET_JOB_SECONDS).check(case)


@pytest.mark.parametrize("case", case_names("mxnet_bad_arguments.py"))
@pytest.mark.parametrize("np_", [3])
def test_one_ranks_bad_argument_raises_on_every_rank_and_the_job_goes_on(np_, case):
    case_job("mxnet_bad_arguments.py", np_, timeout=120).check(case)
