"""hvd_trainer.torch.DistributedOptimizer in a size-1 world: the same steps as the plain
optimizer, Horovod's synchronize()/skip_synchronize()/zero_grad rules, gradients kept in the
buckets, and the refused arguments."""
import copy
import warnings

import pytest
import torch

import hvd_trainer
import hvd_trainer.torch as hvd
from hvd_trainer.compression import TopK


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    return model, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def plain_and_distributed(make, ref: torch.nn.Module, **kwargs):
    """A copy of ``ref``, ``make``'s optimizer of ``ref`` and a DistributedOptimizer of the
    copy (with ``kwargs``)."""
    model = copy.deepcopy(ref)
    return model, make(ref.parameters()), hvd.DistributedOptimizer(
        make(model.parameters()), model.named_parameters(), **kwargs)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.RMSprop(p, lr=0.01)])
# Adasum of one rank's update is that update (as Horovod's one-rank optimizer steps plainly);
# weights + (stepped - weights) may round differently from stepped.
@pytest.mark.parametrize("op, tol", [(hvd.Average, 0), (hvd.Adasum, 1e-6)])
def test_steps_equal_the_plain_optimizer(make, op, tol):
    ref, loss = model_and_data()
    model, ref_opt, opt = plain_and_distributed(make, ref, op=op)
    assert isinstance(opt, type(ref_opt))
    for _ in range(3):
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            loss(m).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_backward_accumulates_into_the_bucket_without_copies():
    model, loss = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss(model).backward()
    opt.step()
    where = [p.grad.data_ptr() for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    loss(model).backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == where
    want = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert [p.grad.data_ptr() for p in model.parameters()] == where
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def test_zero_grad_between_backward_and_step_is_refused():
    model, loss = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss(model).backward()
    with pytest.raises(RuntimeError, match="before optimizer.step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_more_passes_than_backward_passes_per_step_raise():
    model, loss = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), backward_passes_per_step=2)
    loss(model).backward()
    loss(model).backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2"):
        loss(model).backward()
    opt.step()


def test_set_backward_passes_per_step_accumulates_that_many_passes():
    ref, loss = model_and_data()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.set_backward_passes_per_step(3)
    for o, m in ((ref_opt, ref), (opt, model)):
        for _ in range(3):
            loss(m).backward()
        o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_step_after_synchronize_warns_outside_skip_synchronize():
    model, loss = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss(model).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    # Horovod's words, which its own test looks for.
    assert [str(w.message).startswith("optimizer.step() called without "
                                      "optimizer.skip_synchronize() context after "
                                      "optimizer.synchronize()") for w in caught] == [True]
    opt.zero_grad()
    loss(model).backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.parametrize("kwargs, match", [
    (dict(op=hvd.Max), "op=hvd.Average, op=hvd.Sum or op=hvd.Adasum"),
    (dict(op=hvd.Adasum, compression=TopK(0.5)), "Compression.none or Compression.fp16"),
    (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "needs op=hvd.Average"),
    (dict(groups=2), "num_groups"), (dict(backward_passes_per_step=0), "positive integer"),
    (dict(named_parameters=[("a", None), ("a", None)]), "duplicate names"),
    (dict(named_parameters=[]), "does not name 4")])
def test_bad_arguments_are_refused(kwargs, match):
    model, _ = model_and_data()
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def embedding_and_ids():
    torch.manual_seed(0)
    return torch.nn.Embedding(6, 2, sparse=True), torch.tensor([[1, 4], [4, 2]])


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1),
                                  lambda p: torch.optim.SparseAdam(p, lr=0.1)])
def test_sparse_gradients_stay_sparse_and_step_as_the_plain_optimizer(make):
    ref, ids = embedding_and_ids()
    emb, ref_opt, opt = plain_and_distributed(make, ref)
    for step in range(3):
        for o, m in ((ref_opt, ref), (opt, emb)):
            o.zero_grad(set_to_none=step != 1)
            m(ids[:, :step]).sum().backward()  # no rows in the first step
        opt.synchronize()
        assert emb.weight.grad.is_sparse
        torch.testing.assert_close(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())
        touched = set(ids[:, :step].reshape(-1).tolist())
        assert opt.sparse_exchanges["weight"].gathered_rows == len(touched)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
    torch.testing.assert_close(emb.weight, ref.weight)


def test_a_parameter_without_any_gradient_yet_keeps_none():
    emb, ids = embedding_and_ids()
    unused = torch.nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*emb.parameters(), *unused.parameters()],
                                                   lr=0.1))
    emb(ids).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse and unused.weight.grad is None


def test_a_dense_gradient_of_a_sparse_parameter_travels_as_every_row():
    emb, ids = embedding_and_ids()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(ids).sum().backward()
    opt.step()
    emb.weight.grad = torch.ones(6, 2)
    opt.synchronize()
    assert emb.weight.grad.is_sparse and emb.weight.grad.indices().shape == (1, 6)
    torch.testing.assert_close(emb.weight.grad.to_dense(), torch.ones(6, 2))


def test_sparse_as_dense_reduces_densely_and_hands_the_gradient_back_sparse():
    emb, ids = embedding_and_ids()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   sparse_as_dense=True)
    for _ in range(2):  # the second step's gradient accumulates into the bucket's view
        opt.zero_grad(set_to_none=False)
        emb(ids).sum().backward()
        opt.synchronize()
        assert opt.sparse_exchanges == {}  # no row allgather: it went as a dense allreduce
        grad = emb.weight.grad
        assert grad.is_sparse and grad.sparse_dim() == 1
        assert grad.coalesce().indices().tolist() == [[1, 2, 4]]
        want = torch.zeros(6, 2)
        want[[1, 2, 4]] = torch.tensor([[1.0], [1.0], [2.0]])
        torch.testing.assert_close(grad.to_dense(), want)
        with opt.skip_synchronize():
            opt.step()  # SparseAdam takes only sparse gradients


def test_parameter_names_are_horovods_attribute():
    model, _ = model_and_data()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    params = list(model.parameters())
    assert opt._parameter_names == {
        params[0]: "allreduce.noname.0.0", params[1]: "allreduce.noname.0.1",
        params[2]: "allreduce.noname.1.0", params[3]: "allreduce.noname.1.1"}
    model, _ = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert sorted(opt._parameter_names.values()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_adasum_optimizer_cannot_skip_synchronize():
    model, _ = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    with pytest.raises(RuntimeError, match="cannot skip"):
        with opt.skip_synchronize():
            pass


def test_top_level_name_points_to_the_torch_class():
    with pytest.raises(AttributeError, match="hvd_trainer.torch.DistributedOptimizer"):
        hvd_trainer.DistributedOptimizer
    assert callable(hvd_trainer.torch.DistributedOptimizer)
