"""hvd_trainer.torch on CUDA tensors: the DLPack bridge in one process, and the collectives
and a DistributedOptimizer step on 2 and 3 ranks sharing one GPU (host-staged underneath),
checked against NumPy and a single-process CPU run."""
import os
import sys

import numpy as np
import pytest

from gpu import DEVICE_GPUS

if not DEVICE_GPUS:
    pytest.skip("needs CuPy and a CUDA GPU, and a CUDA build of PyTorch: the CPU stand-in "
                "cannot stand in for PyTorch's CUDA tensors (its CPU build makes none; "
                "docs/gpu.md says what runs instead); benchmarks/gpu_check.sh runs these",
                allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA build of PyTorch (this torch sees no GPU)", allow_module_level=True)
import cupy  # noqa: E402

import hvd_trainer.torch as hvd  # noqa: E402
from hvd_trainer.torch import bridge  # noqa: E402

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel")))
from runner import run_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                      "torch_cuda_worker.py")
ONE_GPU = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
           "HVD_BUCKET_THRESHOLD": "64"}  # several buckets from the small model


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


def test_cuda_tensors_and_cupy_arrays_share_memory_both_ways():
    t = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    view = bridge.view(t)
    assert isinstance(view, cupy.ndarray) and view.data.ptr == t.data_ptr()
    view[1, 2] = 50
    assert t[1, 2].item() == 50
    back = bridge.adopt(view)
    assert back.is_cuda and back.data_ptr() == t.data_ptr()


def test_in_place_and_out_of_place_at_world_size_one():
    t = torch.arange(5, dtype=torch.float64, device="cuda")
    ptr = t.data_ptr()
    assert hvd.allreduce_(t, op=hvd.Sum, prescale_factor=3.0) is t and t.data_ptr() == ptr
    np.testing.assert_array_equal(t.cpu().numpy(), np.arange(5) * 3.0)
    out = hvd.allreduce(t[::2], op=hvd.Average)  # strided input, new result on the GPU
    assert out.is_cuda and out.data_ptr() != t.data_ptr()
    np.testing.assert_array_equal(out.cpu().numpy(), np.arange(0, 5, 2) * 3.0)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_cuda_collectives_and_optimizer_match_numpy(np_):
    out = run_ranks(WORKER, np_, timeout=300, env=ONE_GPU).stdout
    assert out.count("torch CUDA collectives match NumPy") == np_
    print(*[line for line in out.splitlines() if "optimizer on CUDA" in line])
