"""hvd_trainer.torch in a size-1 world: the tensor bridge, in-place writes, dtypes, errors,
compression, sparse tensors, SyncBatchNorm and broadcast_optimizer_state, against torch and
NumPy references."""
import numpy as np
import pytest
import torch

import hvd_trainer
import hvd_trainer.torch as hvd
from hvd_trainer.torch import bridge
from hvd_trainer.torch.errors import as_horovod_error

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_share_the_tensors_memory(dtype):
    t = torch.zeros(2, 3, dtype=dtype)
    view = bridge.view(t)
    view[1, 2] = 1
    assert t[1, 2].item() == 1 and t.sum().item() == 1
    back = bridge.adopt(view)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_results_land_in_the_tensor(dtype):
    t = (torch.arange(6) % 2).reshape(2, 3).to(dtype)
    want = t.clone()
    ptr = t.data_ptr()
    assert hvd.allreduce_(t, op=hvd.Max) is t and t.data_ptr() == ptr
    assert torch.equal(t, want)
    assert hvd.broadcast_(t, 0) is t and torch.equal(t, want)
    assert hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum)) is t and torch.equal(t, want)


def test_bfloat16_is_scaled_in_float32_by_the_core():
    x = torch.tensor([1.0, 3.0, 255.0], dtype=torch.bfloat16)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1 / 3, postscale_factor=3.0)
    # One rounding to bfloat16 after each float32 scaling, as torch does it.
    want = ((x.float() * (1 / 3)).bfloat16().float() * 3.0).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_out_of_place_takes_any_strides_and_leaves_the_input():
    x = torch.arange(12.0).reshape(3, 4).t()
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0)
    assert torch.equal(out, 2 * x) and torch.equal(x, torch.arange(12.0).reshape(3, 4).t())


def test_argument_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="contiguous.*tensor.contiguous"):
        hvd.allreduce_(torch.ones(2, 3).t())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        hvd.allreduce(np.ones(3))
    with pytest.raises(TypeError, match="sparse_allreduce_async"):
        hvd.allgather(torch.ones(3).to_sparse())
    with pytest.raises(TypeError, match="list of tensors"):
        hvd.grouped_allreduce_(torch.ones(3))
    with pytest.raises(ValueError, match="does not take op=Adasum"):
        hvd.reducescatter(torch.ones(3), op=hvd.Adasum)
    with pytest.raises(ValueError, match="either op= or the deprecated average="):
        hvd.allreduce(torch.ones(3), op=hvd.Sum, average=True)
    with pytest.raises(TypeError, match="handle"):
        hvd.synchronize(3)
    assert torch.equal(hvd.allreduce(torch.ones(3)), torch.ones(3))


def test_core_errors_are_horovod_internal_errors_too():
    error = as_horovod_error(hvd_trainer.MismatchError("ranks disagree"))
    assert isinstance(error, hvd.HorovodInternalError)
    assert isinstance(error, hvd_trainer.MismatchError) and str(error) == "ranks disagree"
    assert isinstance(as_horovod_error(ValueError("v")), ValueError)


def test_fp16_compression_sends_float16_and_returns_the_dtype_with_gradients():
    x = torch.tensor([1.0, 2.5, -3.0], requires_grad=True)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32 and torch.equal(out, x.detach())
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints) == (ints, None)


def test_sparse_allreduce_sums_duplicate_indices():
    t = torch.sparse_coo_tensor([[0, 3, 0], [1, 1, 1]], torch.tensor([1.0, 2.0, 4.0]), (5, 2),
                                check_invariants=True)
    handle = hvd.sparse_allreduce_async(t, "emb", hvd.Sum)
    got = handle()
    assert got.is_sparse and got.is_coalesced() and got.indices().shape[1] == 2
    assert torch.equal(got.to_dense(), t.to_dense())


def test_sync_batch_norm_on_one_rank_is_batch_norm():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 2)
    sync, plain = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    assert torch.allclose(sync(x), plain(x))
    assert torch.allclose(sync.running_var, plain.running_var)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        sync(torch.ones(3))


def test_broadcast_optimizer_state_on_one_rank_keeps_it():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    net(torch.ones(4, 3)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[net.weight].items()}
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.05
    for key, value in before.items():
        assert torch.equal(opt.state[net.weight][key], value)


class EmbeddingAndLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2, sparse=True)
        self.head = torch.nn.Linear(2, 1)


@pytest.mark.parametrize("make, model_given, sparse", [
    (lambda p: torch.optim.SGD(p, lr=0.1), True, {"embed.weight"}),
    (lambda p: torch.optim.SGD(p, lr=0.1), False, set()),
    (lambda p: torch.optim.SparseAdam(p, lr=0.1), False,
     {"embed.weight", "head.weight", "head.bias"})])
def test_broadcast_optimizer_state_leaves_horovods_zero_gradients(make, model_given, sparse):
    # Horovod's rule: sparse zeros for SparseAdam, and for SGD on the model's sparse
    # embeddings (only when the model is given); dense zeros otherwise.
    net = EmbeddingAndLinear()
    opt = make(list(net.parameters()))
    hvd.broadcast_optimizer_state(opt, 0, net if model_given else None)
    for name, p in net.named_parameters():
        assert p.grad.is_sparse == (name in sparse), name
        assert p.grad.shape == p.shape and not p.grad.to_dense().any(), name
        if p.grad.is_sparse:
            assert p.grad.sparse_dim() == 1 and p.grad._nnz() == 0, name
    net.embed(torch.tensor([1, 3])).sum().backward()  # backward adds to them as usual
    assert net.embed.weight.grad.is_sparse == ("embed.weight" in sparse)
    assert net.embed.weight.grad.to_dense()[[1, 3]].eq(1).all()


def test_adasum_tree_combines_pairs_level_by_level():
    from hvd_trainer.collectives.adasum import tree
    vectors = [np.array(v, np.float64) for v in ([1, 0], [0, 1], [2, 0], [2, 0])]
    # Orthogonal (1,0),(0,1) add to (1,1); equal (2,0),(2,0) average to (2,0); then
    # (1,1) and (2,0): a.b = 2, so 0.5 * (1,1) + 0.75 * (2,0).
    np.testing.assert_allclose(tree(vectors), [2.0, 0.5])
    np.testing.assert_allclose(tree([np.zeros(2), np.array([3.0, 4.0])]), [3.0, 4.0])


@pytest.mark.parametrize("scale", [1e-30, 1e-60])
def test_adasum_averages_parallel_gradients_however_small(scale):
    from hvd_trainer.collectives.adasum import tree
    # b = 3a: a.b = 3|a|^2 = |b|^2 / 3, so (1 - 3/2) a + (1 - 1/6) 3a = 2a, the mean of a and
    # b, however small the gradients (|a|^2 is about 5e-60 or 5e-120 here).
    a = np.array([1.0, -2.0, 0.5]) * scale
    np.testing.assert_allclose(tree([a, 3 * a]), 2 * a, rtol=1e-12)


def test_adasum_of_one_rank_is_the_tensor_scaled():
    x = torch.tensor([1.0, -2.0, 3.0])
    assert torch.equal(hvd.allreduce(x, op=hvd.Adasum, postscale_factor=2.0), 2 * x)


def test_join_alone_returns_this_rank():
    assert hvd.join() == 0 and hvd.join(device=3) == 0
    assert hvd_trainer.join() == 0
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.ones(2))


# Run in a fresh interpreter where ml_dtypes cannot be imported (as for a user who installed
# their own torch without the [torch] extra).
WITHOUT_ML_DTYPES = """
import sys
sys.modules["ml_dtypes"] = None
import torch
import hvd_trainer.torch as hvd
hvd.init()
assert hvd.allreduce(torch.tensor([1.5, 2.0]), op=hvd.Sum).tolist() == [1.5, 2.0]
try:
    hvd.allreduce(torch.ones(2, dtype=torch.bfloat16))
except TypeError as error:
    print("REFUSED", error)
"""


def test_without_ml_dtypes_only_bfloat16_tensors_are_refused_naming_the_install():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", WITHOUT_ML_DTYPES], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "pip install ml_dtypes" in proc.stdout, proc.stdout
