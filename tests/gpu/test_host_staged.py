"""The GPU collectives on 2 and 3 ranks that share one GPU, which sends them through pinned
host memory and MPI (NCCL refuses ranks that share a GPU, and so does its stand-in), against
NumPy; forcing NCCL there fails on every rank, naming the fix."""
import pytest

from gpu import KINDS, names, shared_gpu_job

CASES = [(np_, case) for np_ in (2, 3)
         for case in names("collectives_worker.py") + names("shared_gpu_worker.py")]


@pytest.mark.parametrize("np_,case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_staged_collectives_match_numpy(kind, np_, case):
    shared_gpu_job(kind, np_).check(case)
