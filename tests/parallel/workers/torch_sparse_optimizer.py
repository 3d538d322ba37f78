"""hvd_trainer.torch.DistributedOptimizer with nn.Embedding(sparse=True) on this job's ranks
against one process on the global batch: N ranks with batch B each must reach the weights,
and after synchronize() the sparse gradients (values and touched rows), that plain PyTorch
reaches with batch N*B. Every rank computes the reference itself, from the same seeds.

Each step also checks the path the rows took: the dense allreduce exactly when the ranks
together touched more rows than the table has (docs/sparse.md's rule, counted here from the
batches). Cases with a 40-row table take the row allgather; those with a 6-row table
(which every rank nearly covers), the dense fallback. Each case reports on its own
(case_runner.py).
"""
import copy

import numpy as np
import torch

import hvd_trainer.torch as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_default_dtype(torch.float64)
B, STEPS, IDS = 4, 3, 2


class Net(torch.nn.Module):
    """A sparse embedding bag of IDS ids per sample, added to a dense layer's output."""

    def __init__(self, table: int):
        super().__init__()
        self.embed = torch.nn.Embedding(table, 3, sparse=True)
        self.dense = torch.nn.Linear(5, 3)

    def loss(self, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss over one rank's samples; ``ids`` None: the embedding is not used."""
        out = self.dense(x)
        if ids is not None:
            out = out + self.embed(ids).sum(1)
        return torch.nn.functional.cross_entropy(out, y)


def batch(step: int, rank: int, idle: bool, table: int):
    """Rank ``rank``'s batch. With ``idle``, the last rank does not use the embedding in
    step 0 (no gradient at all), and rank 0's samples have no ids in step 2."""
    rng = np.random.default_rng(100 * step + rank)
    x = torch.from_numpy(rng.normal(size=(B, 5)))
    ids = torch.from_numpy(rng.integers(0, table, size=(B, IDS)))
    y = torch.from_numpy(rng.integers(0, 3, size=B))
    if idle and rank == SIZE - 1 and step == 0:
        ids = None
    elif idle and rank == 0 and step == 2:
        ids = ids[:, :0]
    return x, ids, y


def touched(step: int, rank: int, idle: bool, table: int) -> set:
    """The table rows that rank ``rank``'s batch touches."""
    ids = batch(step, rank, idle, table)[1]
    return set() if ids is None else set(ids.reshape(-1).tolist())


def run(case: str, make_opt, *, passes: int = 1, idle: bool = False, frozen_dense=False,
        make_ref=None, table: int = 40, **kwargs) -> None:
    torch.manual_seed(0)
    ref = Net(table)
    if frozen_dense:
        ref.dense.requires_grad_(False)
    model = copy.deepcopy(ref)
    ref_opt = (make_ref or make_opt)([p for p in ref.parameters() if p.requires_grad])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = hvd.DistributedOptimizer(
        make_opt(params), named_parameters=[(n, p) for n, p in model.named_parameters()
                                            if p.requires_grad],
        backward_passes_per_step=passes, **kwargs)
    scale = SIZE if kwargs.get("op") == hvd.Sum else 1
    dense_steps = 0
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad(set_to_none=step % 2 == 0)  # None, and emptied sparse gradients
        for p in range(passes):
            # One process on the global batch: the mean over all N*B samples.
            sum(ref.loss(*batch(passes * step + p, r, idle, table)) for r in range(SIZE)).div(
                SIZE).backward()
            loss = model.loss(*batch(passes * step + p, RANK, idle, table))
            if loss.requires_grad:  # not when this rank uses no trainable parameter
                loss.backward()
        opt.synchronize()
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            if not b.requires_grad:
                continue
            assert a.grad.layout == b.grad.layout, f"{case} {name}: {a.grad.layout}"
            want = b.grad.coalesce() if b.grad.is_sparse else b.grad
            if a.grad.is_sparse:
                assert a.grad.is_coalesced(), f"{case} {name}: not coalesced"
                torch.testing.assert_close(a.grad.indices(), want.indices(),
                                           msg=f"{case} step {step} {name}: touched rows")
            torch.testing.assert_close(a.grad.to_dense() / scale, want.to_dense(), rtol=1e-10,
                                       atol=1e-10, msg=f"{case} step {step} {name} gradient")
        gathered = sum(len(set().union(*(touched(passes * step + p, r, idle, table)
                                         for p in range(passes)))) for r in range(SIZE))
        exchange = opt.sparse_exchanges["embed.weight"]
        assert exchange.gathered_rows == gathered, f"{case} step {step}: {exchange}"
        assert exchange.dense == (gathered > table), f"{case} step {step}: {exchange}"
        dense_steps += exchange.dense
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{case}: {name}")
    assert not torch.equal(model.embed.weight, Net(table).embed.weight), f"{case}: did not move"
    assert (dense_steps > 0) == (table < 40), f"{case}: {dense_steps} dense steps"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


run_cases({
    "sgd": lambda: run("sgd", sgd),
    "sgd_idle_ranks": lambda: run("sgd, idle ranks", sgd, idle=True),
    "sum_with_lr_over_size": lambda: run(
        "sum with lr / size", lambda p: torch.optim.SGD(p, lr=0.1 / SIZE), op=hvd.Sum,
        make_ref=sgd),
    "predivide": lambda: run("predivide", sgd, gradient_predivide_factor=2.0),
    "backward_passes_per_step_2": lambda: run("backward_passes_per_step=2", sgd, passes=2),
    "adagrad_idle_ranks": lambda: run("adagrad, idle ranks",
                                      lambda p: torch.optim.Adagrad(p, lr=0.1), idle=True),
    "sparse_adam_idle_ranks": lambda: run("sparse adam, idle ranks",
                                          lambda p: torch.optim.SparseAdam(p, lr=0.01),
                                          idle=True, frozen_dense=True),
    "fp16_leaves_sparse_gradients_exact": lambda: run(
        "fp16 compression leaves sparse gradients exact", sgd,
        compression=hvd.Compression.fp16, frozen_dense=True),
    "dense_fallback_sgd": lambda: run("dense fallback: sgd", sgd, table=6),
    "dense_fallback_adagrad_idle_ranks": lambda: run(
        "dense fallback: adagrad, idle ranks", lambda p: torch.optim.Adagrad(p, lr=0.1),
        idle=True, table=6)})
