"""How hvd_trainer.torch routes tensors that are not on the CPU, on a machine without a GPU:
CUDA tensors go to the GPU path (which needs CuPy, the rank's GPU and a CuPy dtype), other
devices are refused. A CUDA tensor is stood in for by a tensor whose ``device`` says cuda;
where the GPU path needs CuPy's answers, ``cupy_module`` and ``rank_device`` are replaced.
The GPU path itself runs in tests/gpu/test_torch_cuda.py."""
import sys

import pytest
import torch

import hvd_trainer.torch as hvd
from hvd_trainer.torch import bridge


class OnGPU(torch.Tensor):
    """A CPU tensor that says it is on cuda:<index>."""

    index = 0

    @property
    def device(self):
        return torch.device("cuda", self.index)


class OnGPU1(OnGPU):
    index = 1


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


@pytest.fixture
def cupy_present(monkeypatch):
    """CuPy importable and this rank on GPU 0, as bridge.py would find them."""
    monkeypatch.setattr(bridge, "cupy_module", lambda what: object())
    monkeypatch.setattr(bridge, "rank_device", lambda: 0)


def test_other_devices_are_refused_naming_the_device():
    with pytest.raises(TypeError, match="tensor is on meta; hvd_trainer.torch takes CPU and CUDA"):
        hvd.allreduce(torch.zeros(3, device="meta"))


def test_a_cuda_tensor_without_cupy_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    t = torch.zeros(3).as_subclass(OnGPU)
    with pytest.raises(TypeError, match=r"tensor is on cuda:0: .*pip install cupy-cuda12x"):
        hvd.allreduce(t)
    with pytest.raises(TypeError, match=r"tensors\[0\] is on cuda:0: .*pip install cupy-cuda12x"):
        hvd.grouped_allreduce_([t])
    with pytest.raises(TypeError, match="pip install cupy-cuda12x"):
        hvd.broadcast_(t, 0)


def test_a_tensor_on_another_gpu_names_both(cupy_present):
    t = torch.zeros(3).as_subclass(OnGPU1)
    with pytest.raises(ValueError, match=r"tensor is on cuda:1, but this rank works on cuda:0"):
        hvd.allgather(t)


def test_bfloat16_and_other_dtypes_cupy_lacks_are_refused_on_the_gpu(cupy_present):
    with pytest.raises(TypeError, match="bfloat16 CUDA tensor.*tensor.float"):
        hvd.allreduce(torch.zeros(3, dtype=torch.bfloat16).as_subclass(OnGPU))
    with pytest.raises(TypeError, match="dtype torch.float8_e4m3fn"):
        hvd.reducescatter(torch.zeros(3, dtype=torch.float8_e4m3fn).as_subclass(OnGPU))
    # On the CPU bfloat16 is still taken (through ml_dtypes).
    assert hvd.allreduce(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_a_group_on_two_devices_is_refused(cupy_present):
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cuda:0 but tensors\[0\] on cpu"):
        hvd.grouped_allreduce([torch.zeros(2), torch.zeros(2).as_subclass(OnGPU)])


def test_cpu_tensors_run_without_a_stream_and_cuda_ones_are_recognised():
    assert not bridge.is_cuda(torch.zeros(1)) and bridge.ordered(torch.zeros(1)) is None
    assert bridge.is_cuda(torch.zeros(1).as_subclass(OnGPU))


def test_distributed_optimizer_refuses_compression_for_cuda_parameters(cupy_present):
    w = torch.zeros(3).as_subclass(OnGPU).requires_grad_()
    optimizer = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="parameter 'w' is on cuda:0.*Compression.none"):
        hvd.DistributedOptimizer(optimizer, [("w", w)], compression=hvd.Compression.fp16)
    empty = torch.zeros(0).as_subclass(OnGPU).requires_grad_()
    with pytest.raises(ValueError, match="parameter 'e' on cuda:0 has no elements"):
        hvd.DistributedOptimizer(torch.optim.SGD([empty], lr=0.1), [("e", empty)])
