"""The GPU collectives on 2 and 3 ranks sharing one GPU, which sends them through pinned
host memory and MPI (NCCL refuses ranks that share a GPU); checked against NumPy."""
import os
import sys

import pytest

from gpu import require_gpu

require_gpu()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
from runner import run_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "staged_worker.py")
# The ranks see one GPU, the first visible, so they share it on a machine with several too.
ONE_GPU = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


@pytest.mark.parametrize("np_", [2, 3])
def test_staged_collectives_match_numpy(np_):
    out = run_ranks(WORKER, np_, timeout=300, env=ONE_GPU).stdout
    assert out.count("GPU collectives match NumPy") == np_


def test_forcing_nccl_on_a_shared_gpu_names_the_fix():
    proc = run_ranks(WORKER, 2, ["--force-nccl"], timeout=300, env=ONE_GPU, check=False)
    assert proc.returncode != 0
    assert "ranks share a GPU" in proc.stdout + proc.stderr
