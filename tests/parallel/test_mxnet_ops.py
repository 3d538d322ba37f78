"""The horovod.mxnet collectives on NDArrays, on 2 and 3 ranks, against NumPy references.

One launch per size runs every check (see workers/mxnet_ops_worker.py): starting ranks that
import MXNet costs seconds, checking one more op costs milliseconds.
"""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_ndarray_collectives_match_numpy(np_):
    out = run_ranks("mxnet_ops_worker.py", np_, timeout=120).stdout
    assert out.count("mxnet ops ok") == np_, out


@pytest.mark.parametrize("np_", [2, 3])
def test_one_ranks_bad_argument_raises_on_every_rank_and_the_job_goes_on(np_):
    out = run_ranks("mxnet_bad_arguments.py", np_, timeout=120).stdout
    assert out.count("mxnet bad arguments ok") == np_, out
