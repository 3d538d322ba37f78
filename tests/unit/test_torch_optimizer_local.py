"""hvd_trainer.torch.DistributedOptimizer in a size-1 world: the same steps as the plain
optimizer, Horovod's synchronize()/skip_synchronize()/zero_grad rules, gradients kept in the
buckets, and the refused arguments."""
import copy
import warnings

import pytest
import torch

import hvd_trainer
import hvd_trainer.torch as hvd


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    return model, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def plain_and_distributed(make, ref: torch.nn.Module):
    """A copy of ``ref``, ``make``'s optimizer of ``ref`` and a DistributedOptimizer of the
    copy."""
    model = copy.deepcopy(ref)
    return model, make(ref.parameters()), hvd.DistributedOptimizer(make(model.parameters()),
                                                                   model.named_parameters())


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.RMSprop(p, lr=0.01)])
def test_steps_equal_the_plain_optimizer(make):
    ref, loss = model_and_data()
    model, ref_opt, opt = plain_and_distributed(make, ref)
    assert isinstance(opt, type(ref_opt))
    for _ in range(3):
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            loss(m).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    loss(model).backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.parametrize("kwargs, match", [
    (dict(op=hvd.Adasum), "op=Adasum"), (dict(op=hvd.Max), "op=hvd.Average or op=hvd.Sum"),
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


def test_sparse_as_dense_makes_sparse_gradients_dense():
    emb, ids = embedding_and_ids()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   sparse_as_dense=True)
    emb(ids).sum().backward()
    opt.synchronize()
    assert emb.weight.grad.layout == torch.strided and opt.sparse_exchanges == {}
    torch.testing.assert_close(emb.weight.grad.sum(), torch.tensor(8.0))


def test_top_level_name_points_to_the_torch_class():
    with pytest.raises(AttributeError, match="hvd_trainer.torch.DistributedOptimizer"):
        hvd_trainer.DistributedOptimizer
    assert callable(hvd_trainer.torch.DistributedOptimizer)
