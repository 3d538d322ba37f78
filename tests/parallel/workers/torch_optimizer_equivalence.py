"""hvd_trainer.torch.DistributedOptimizer on this job's ranks against one process on the global
batch: N ranks with batch B each must reach the weights that plain PyTorch reaches with batch
N*B, for each case below. Every rank computes the reference itself, from the same seeds.

Each case reports on its own (see case_runner.py).
"""
import copy

import numpy as np
import torch

import hvd_trainer.torch as hvd
from case_runner import run_cases
from hvd_trainer.compression import TopK

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_default_dtype(torch.float64)
B, STEPS = 4, 4


class Net(torch.nn.Module):
    """An MLP with an embedding; ``extra`` (with ``use_extra``) is used only on ranks other
    than 0. (A parameter that no rank uses gets a zero gradient, as in Horovod, which weight
    decay and momentum would apply where one process would not.)"""

    def __init__(self, sparse: bool = False, use_extra: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 3, sparse=sparse)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 4))
        if use_extra:
            self.extra = torch.nn.Parameter(torch.ones(4))

    def loss(self, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, rank: int,
             use_extra: bool) -> torch.Tensor:
        """The mean loss over one rank's samples."""
        h = torch.cat([x, self.embed(ids).sum(1)], 1)[:, :8]
        out = self.body(h)
        if use_extra and rank != 0:
            out = out * self.extra
        return torch.nn.functional.cross_entropy(out, y)


def batch(step: int, rank: int):
    rng = np.random.default_rng(100 * step + rank)
    return (torch.from_numpy(rng.normal(size=(B, 5))).to(torch.get_default_dtype()),
            torch.from_numpy(rng.integers(0, 10, size=(B, 2))),
            torch.from_numpy(rng.integers(0, 4, size=B)))


def global_loss(model: Net, step: int, use_extra: bool) -> torch.Tensor:
    """One process on the global batch: the mean over all N*B samples (the unused parameter
    applies to the samples of ranks other than 0)."""
    if not use_extra:
        xs, ids, ys = zip(*(batch(step, r) for r in range(SIZE)))
        return model.loss(torch.cat(xs), torch.cat(ids), torch.cat(ys), 0, False)
    return sum(model.loss(*batch(step, r), r, True) for r in range(SIZE)) / SIZE


def run(case: str, make_opt, *, passes: int = 1, clip: float = 0.0, sched: bool = False,
        use_extra: bool = False, sparse: bool = False, tol: float = 1e-10, make_ref=None,
        **kwargs) -> None:
    torch.manual_seed(0)
    ref = Net(sparse, use_extra)
    model = copy.deepcopy(ref)
    ref_opt = (make_ref or make_opt)(ref.parameters())
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5) if sched else None
    my_sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if sched else None
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad(set_to_none=step % 2 == 0)  # both: views kept, and fresh gradients
        for p in range(passes):
            global_loss(ref, passes * step + p, use_extra).backward()
            model.loss(*batch(passes * step + p, RANK), RANK, use_extra).backward()
        if clip:
            opt.synchronize()
            for (name, a), b in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense(),
                                           rtol=tol, atol=tol, msg=f"{case} {name} grad")
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.step()
        if sched:
            ref_sched.step()
            my_sched.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{case}: {name}")
    moved = sum(float((a - b).abs().sum().detach()) for a, b in zip(model.parameters(),
                                                          Net(sparse, use_extra).parameters()))
    assert moved > 0, f"{case}: the weights did not move"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def packed_top_k() -> None:
    """The core's packed path (allgather with error feedback, float32 tensors only): top-k of
    every entry is exact."""
    every_entry = TopK(1.0)
    every_entry.min_size = 1
    torch.set_default_dtype(torch.float32)
    try:
        run("packed top-k, ratio 1", sgd, compression=every_entry, tol=1e-5)
    finally:
        torch.set_default_dtype(torch.float64)


def sync_batch_norm() -> None:
    """SyncBatchNorm between two layers (its backward allreduce comes after the last layer's
    gradients are ready) against BatchNorm1d on the global batch."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 4))
    model = copy.deepcopy(ref)
    model[1] = hvd.SyncBatchNorm(6)
    model[1].load_state_dict(ref[1].state_dict())
    ref_opt = sgd(ref.parameters())
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters())
    loss = torch.nn.functional.cross_entropy
    for step in range(STEPS):
        xs, _, ys = zip(*(batch(step, r) for r in range(SIZE)))
        ref_opt.zero_grad()
        loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        opt.zero_grad()
        loss(model(xs[RANK]), ys[RANK]).backward()
        opt.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"SyncBatchNorm: {name}")


run_cases({
    "sgd_momentum_weight_decay": lambda: run("sgd momentum weight decay", sgd),
    "adam": lambda: run("adam", lambda p: torch.optim.Adam(p, lr=0.01)),
    "adamw": lambda: run("adamw", lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "clipping": lambda: run("clipping", sgd, clip=0.05),
    "lr_scheduler": lambda: run("lr scheduler", sgd, sched=True),
    "backward_passes_per_step_2": lambda: run("backward_passes_per_step=2", sgd, passes=2),
    "unused_on_rank_0": lambda: run("unused on rank 0", sgd, use_extra=True),
    "sum_with_lr_over_size": lambda: run(
        "sum with lr / size", lambda p: torch.optim.SGD(p, lr=0.1 / SIZE), op=hvd.Sum,
        make_ref=lambda p: torch.optim.SGD(p, lr=0.1)),
    "predivide": lambda: run("predivide", sgd, gradient_predivide_factor=2.0),
    "one_parameter_per_bucket": lambda: run("one parameter per bucket", sgd, num_groups=4),
    "sparse_as_dense": lambda: run("sparse as dense", lambda p: torch.optim.SGD(p, lr=0.1),
                                   sparse=True, sparse_as_dense=True),
    "fp16": lambda: run("fp16", sgd, compression=hvd.Compression.fp16, tol=2e-3),
    "packed_top_k": packed_top_k,
    "sync_batch_norm": sync_batch_norm})
