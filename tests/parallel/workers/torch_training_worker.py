"""hvd_trainer.torch's autograd functions, broadcast_parameters, broadcast_optimizer_state and
SyncBatchNorm on this job's ranks, against hand computations and single-process torch.

Every rank rebuilds every rank's inputs from seeds, so each reference is computed locally,
without the implementation. Each section is a case of its own (case_runner.py).
"""
import numpy as np
import torch

import hvd_trainer.torch as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_default_dtype(torch.float64)


def data(seed: int, rank: int, *shape) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1000 * seed + rank).normal(size=shape))


def close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-10) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, msg=what)


def weights(seed: int, *shape):
    """Each rank's loss weights: rank r's loss is sum(weights[r] * output)."""
    return [data(seed, r, *shape) for r in range(SIZE)]


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.Linear(3, 2))


def stepped(kind: str, seed: int, lr: float, steps: int):
    """A model and optimizer after ``steps`` steps on seed-made data."""
    net = model(seed)
    opt = (torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
           if kind == "sgd" else torch.optim.Adam(net.parameters(), lr=lr, betas=(0.8, 0.99)))
    for step in range(steps):
        opt.zero_grad()
        net(data(300 + step, seed, 5, 4)).pow(2).sum().backward()
        opt.step()
    return net, opt


def same_state(got: torch.optim.Optimizer, want: torch.optim.Optimizer, what: str) -> None:
    g, w = got.state_dict(), want.state_dict()
    assert g["param_groups"] == w["param_groups"], f"{what}: {g['param_groups']}"
    assert g["state"].keys() == w["state"].keys(), f"{what}: {g['state'].keys()}"
    for pid, entries in w["state"].items():
        for key, value in entries.items():
            close(g["state"][pid][key], value, f"{what}: state {pid}.{key}", 0)


def case_allreduce():
    """allreduce: d(sum_r L_r)/dx = op over the ranks' incoming gradients"""
    x = data(1, RANK, 3, 2).requires_grad_()
    w = weights(2, 3, 2)
    (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0) * w[RANK]).sum().backward()
    close(x.grad, 2.0 * sum(w), "allreduce Sum gradient")
    x.grad = None
    (hvd.allreduce(x) * w[RANK]).sum().backward()
    close(x.grad, sum(w) / SIZE, "allreduce Average gradient")
    x.grad = None
    outs = hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)
    (outs[0] * w[RANK] + outs[1]).sum().backward()
    close(x.grad, sum(w) + 2.0 * SIZE, "grouped_allreduce gradient")
    x.grad = None
    try:
        hvd.allreduce(x, op=hvd.Max).sum().backward()
        raise AssertionError("allreduce Max backward did not raise")
    except RuntimeError as e:
        assert "no gradient" in str(e), e


def case_allgather():
    """allgather (Horovod's rule): each rank's rows of the averaged incoming gradients"""
    x = data(3, RANK, RANK + 1, 2).requires_grad_()
    w = weights(4, SIZE * (SIZE + 1) // 2, 2)
    (hvd.allgather(x) * w[RANK]).sum().backward()
    lo = RANK * (RANK + 1) // 2
    close(x.grad, (sum(w) / SIZE)[lo:lo + RANK + 1], "allgather gradient")
    y = data(5, RANK, 2, 3).requires_grad_()
    x.grad = None
    gathered = hvd.grouped_allgather([x, y])
    w2 = weights(6, 2 * SIZE, 3)
    ((gathered[0] * w[RANK]).sum() + (gathered[1] * w2[RANK]).sum()).backward()
    close(x.grad, (sum(w) / SIZE)[lo:lo + RANK + 1], "grouped_allgather gradient [0]")
    close(y.grad, (sum(w2) / SIZE)[2 * RANK:2 * RANK + 2], "grouped_allgather gradient [1]")


def case_broadcast():
    """broadcast (Horovod's rule): the root gets the averaged gradients, the others zeros"""
    root = SIZE - 1
    x = data(7, RANK, 4).requires_grad_()
    w = weights(8, 4)
    (hvd.broadcast(x, root) * w[RANK]).sum().backward()
    close(x.grad, sum(w) / SIZE if RANK == root else torch.zeros(4), "broadcast gradient")


def case_alltoall():
    """alltoall: each row's gradient comes back from where the row went"""
    sent = [[(r + j) % 3 + 1 for j in range(SIZE)] for r in range(SIZE)]
    x = data(9, RANK, sum(sent[RANK]), 2).requires_grad_()
    received = sum(sent[r][RANK] for r in range(SIZE))
    w = [data(10, r, sum(sent[k][r] for k in range(SIZE)), 2) for r in range(SIZE)]
    out, splits = hvd.alltoall(x, splits=sent[RANK])
    assert out.shape[0] == received, f"alltoall: {out.shape[0]} rows, {received} sent here"
    (out * w[RANK]).sum().backward()
    want = torch.cat([w[j][sum(sent[k][j] for k in range(RANK)):][:sent[RANK][j]]
                      for j in range(SIZE)])
    close(x.grad, want, "alltoall gradient")

    # (reducescatter's gradient: workers/torch_horovod_rules.py)


def case_broadcast_parameters():
    """broadcast_parameters: every rank ends with the root's model"""
    root = SIZE - 1
    mine, reference = model(100 + RANK), model(100 + root)
    with torch.no_grad():
        mine[1].running_mean.add_(RANK)  # buffers travel too in a state_dict
        reference[1].running_mean.add_(root)
    hvd.broadcast_parameters(mine.state_dict(), root_rank=root)
    for (name, got), want in zip(mine.state_dict().items(), reference.state_dict().values()):
        close(got, want, f"broadcast_parameters(state_dict) {name}", 0)
    mine = model(200 + RANK)
    hvd.broadcast_parameters(mine.named_parameters(), root_rank=0)
    for got, want in zip(mine.parameters(), model(200).parameters()):
        close(got.detach(), want.detach(), "broadcast_parameters(named_parameters)", 0)


def case_broadcast_optimizer_state():
    """broadcast_optimizer_state from the last rank"""
    root = SIZE - 1
    for kind in ("sgd", "adam"):
        # Ranks at different points (the root two steps in, others none or one) with other lrs:
        # afterwards every rank holds the root's state and options exactly.
        _, opt = stepped(kind, 400 + RANK, lr=0.1 * (RANK + 1), steps=2 if RANK == root else RANK % 2)
        hvd.broadcast_optimizer_state(opt, root_rank=root)
        same_state(opt, stepped(kind, 400 + root, lr=0.1 * (root + 1), steps=2)[1],
                   f"{kind} state after the root's steps")
        # The root has no state yet (it is created lazily at the first step): the others' is
        # cleared, the options are the root's, and no weight moves.
        net, opt = stepped(kind, 500 + RANK, lr=0.01 * (RANK + 1), steps=0 if RANK == 0 else 1)
        before = [p.detach().clone() for p in net.parameters()]
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        same_state(opt, stepped(kind, 500, lr=0.01, steps=0)[1], f"{kind} fresh root")
        for got, want in zip(net.parameters(), before):
            close(got.detach(), want, f"{kind}: broadcast_optimizer_state leaves weights alone", 0)
        # With the root's weights, a step then equals the root's first step: the state the
        # optimizer creates lazily is created alike (a stale momentum buffer would show here).
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        opt.zero_grad()
        net(data(300, 500, 5, 4)).pow(2).sum().backward()
        opt.step()
        for got, want in zip(net.parameters(), stepped(kind, 500, lr=0.01, steps=1)[0].parameters()):
            close(got.detach(), want.detach(), f"{kind}: first step after the broadcast")
    # Different parameter groups on one rank: every rank raises.
    net = model(700)
    groups = [{"params": list(net.parameters())[:2]}, {"params": list(net.parameters())[2:]}]
    opt = torch.optim.SGD(groups if RANK == 1 else net.parameters(), lr=0.1)
    try:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        raise AssertionError("different parameter groups did not raise")
    except ValueError as e:
        assert "on rank 1" in str(e) and "parameter groups" in str(e), e


def case_sync_batch_norm():
    """SyncBatchNorm: the global batch's statistics, forward and backward"""
    for dims, shape in ((2, (3,)), (4, (3, 2, 2))):
        counts = [r + 2 for r in range(SIZE)]
        xs = [data(800 + dims, r, counts[r], *shape) for r in range(SIZE)]
        gs = [data(900 + dims, r, counts[r], *shape) for r in range(SIZE)]
        reference = (torch.nn.BatchNorm1d if dims == 2 else torch.nn.BatchNorm2d)(3, momentum=0.3)
        sync = hvd.SyncBatchNorm(3, momentum=0.3)
        with torch.no_grad():
            for bn in (reference, sync):
                bn.weight.copy_(torch.tensor([0.5, 1.5, -2.0]))
                bn.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
        for step in range(2):
            whole = torch.cat(xs).requires_grad_()
            want = reference(whole)
            (want * torch.cat(gs)).sum().backward()
            x = xs[RANK].clone().requires_grad_()
            got = sync(x)
            (got * gs[RANK]).sum().backward()
            lo = sum(counts[:RANK])
            close(got.detach(), want.detach()[lo:lo + counts[RANK]], f"SyncBatchNorm {dims}d forward")
            close(x.grad, whole.grad[lo:lo + counts[RANK]], f"SyncBatchNorm {dims}d input gradient")
            # Weight and bias gradients are local: their sum over ranks is the global batch's.
            for name in ("weight", "bias"):
                local = getattr(sync, name).grad
                close(hvd.allreduce(local, op=hvd.Sum), getattr(reference, name).grad,
                      f"SyncBatchNorm {dims}d {name} gradient")
                getattr(sync, name).grad = None
                getattr(reference, name).grad = None
        close(sync.running_mean, reference.running_mean, f"SyncBatchNorm {dims}d running mean")
        close(sync.running_var, reference.running_var, f"SyncBatchNorm {dims}d running var")
        sync.eval()
        reference.eval()
        close(sync(xs[RANK]), reference(xs[RANK]), f"SyncBatchNorm {dims}d eval is local")
    # A bad input on one rank raises on every rank.
    sync = hvd.SyncBatchNorm(3)
    try:
        sync(torch.ones(3) if RANK == 1 else torch.ones(2, 3))
        raise AssertionError("a 1-d input did not raise")
    except ValueError as e:
        assert "on rank 1" in str(e) and "2 dimensions" in str(e), e
    out = sync(torch.arange(6.0).reshape(2, 3) * (RANK + 1))
    close(hvd.allreduce(out.detach().sum(0), op=hvd.Sum), torch.zeros(3),
          "SyncBatchNorm works after the error: the global batch's outputs have mean 0")


run_cases({"allreduce": case_allreduce, "allgather": case_allgather, "broadcast": case_broadcast,
           "alltoall": case_alltoall, "broadcast_parameters": case_broadcast_parameters,
           "broadcast_optimizer_state": case_broadcast_optimizer_state,
           "sync_batch_norm": case_sync_batch_norm}, rank=RANK)
