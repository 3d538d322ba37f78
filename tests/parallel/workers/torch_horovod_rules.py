"""Rules of horovod.torch that its own test suite checks, on this job's ranks, each against
a hand derivation or one process (every rank rebuilds every rank's inputs from seeds).

reducescatter_grad      the gradient of reducescatter and grouped_reducescatter, Sum and
                        Average, with scale factors, on even and uneven row counts
alltoall_float_splits   float splits raise ValueError on every rank, also when one rank
                        alone passes them; the next alltoall works
optimizer_state_grads   broadcast_optimizer_state leaves zero gradients where the rank's
                        optimizer had no state, and the next step is the global batch's
sparse_as_dense_adam    SparseAdam behind DistributedOptimizer(sparse_as_dense=True) steps as
                        one process on the global batch
adasum_optimizer        DistributedOptimizer(op=Adasum) on 2 ranks against a NumPy Adasum of
                        the updates that single-process optimizers make; refused on 3
Run as: worker.py [case ...] (default: all).
"""
import copy

import numpy as np
import torch

import hvd_trainer.torch as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_default_dtype(torch.float64)
failures = []


def data(seed: int, rank: int, *shape) -> np.ndarray:
    return np.random.default_rng([seed, rank]).normal(size=shape)


def close(got: torch.Tensor, want, what: str, rtol: float = 1e-12) -> None:
    """Record a failure unless ``got`` equals ``want`` (NumPy or torch) to ``rtol``."""
    want = np.asarray(want.detach() if isinstance(want, torch.Tensor) else want)
    got = got.detach().to(torch.float64).numpy()
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=rtol):
        failures.append(f"{what}: got {got.tolist()}, want {want.tolist()}")


def expect(error: type, fragments, call) -> None:
    """Record a failure unless ``call()`` raises ``error`` with every fragment."""
    try:
        call()
    except error as e:
        missing = [f for f in fragments if f not in str(e)]
        if missing:
            failures.append(f"{type(e).__name__} lacks {missing}: {e}")
        return
    failures.append(f"no {error.__name__} (expected one naming {fragments})")


def case_reducescatter_grad() -> None:
    # By hand: rank r's loss is sum(w_r * y_r), y_r its share of rows. Horovod's rule takes
    # the input x as one tensor that every rank holds alike, so with the scale factors
    # s = pre * post, Sum makes y_r = s * SIZE * x[rows of r] and Average y_r = s * x[rows
    # of r]: d(sum_r loss_r)/dx[rows of r] = s * SIZE * w_r (Sum) or s * w_r (Average).
    for rows in (4 * SIZE, 2 * SIZE + 1):  # uneven: the lower ranks take one row more
        shares = [rows // SIZE + (r < rows % SIZE) for r in range(SIZE)]
        for op, times in ((hvd.Sum, SIZE), (hvd.Average, 1)):
            for dtype in (torch.float32, torch.float64):
                x = torch.tensor(data(1, RANK, rows, 3), dtype=dtype, requires_grad=True)
                w = [data(2, r, shares[r], 3) for r in range(SIZE)]
                share = hvd.reducescatter(x, op=op, prescale_factor=0.5, postscale_factor=3.0)
                (share * torch.tensor(w[RANK], dtype=dtype)).sum().backward()
                close(x.grad, 1.5 * times * np.concatenate(w),
                      f"reducescatter {op.name} {dtype} {rows} rows", rtol=1e-6)
            a = torch.tensor(data(3, RANK, rows, 2), requires_grad=True)
            b = torch.tensor(data(4, RANK, rows), requires_grad=True)
            wa = [data(5, r, shares[r], 2) for r in range(SIZE)]
            wb = [data(6, r, shares[r]) for r in range(SIZE)]
            ya, yb = hvd.grouped_reducescatter([a, b], op=op)
            ((ya * torch.tensor(wa[RANK])).sum() + (yb * torch.tensor(wb[RANK])).sum()).backward()
            close(a.grad, times * np.concatenate(wa), f"grouped_reducescatter {op.name} [0]")
            close(b.grad, times * np.concatenate(wb), f"grouped_reducescatter {op.name} [1]")


def case_alltoall_float_splits() -> None:
    inputs = [data(10, r, 2 * SIZE, 2) for r in range(SIZE)]
    tensor = torch.tensor(inputs[RANK])
    ints = torch.full((SIZE,), 2, dtype=torch.int32)
    for bad in (0, SIZE - 1):  # one rank alone: every rank raises, naming it
        splits = ints.to(torch.float32) if RANK == bad else ints
        expect(ValueError, [f"on rank {bad}", "splits must hold integers"],
               lambda: hvd.alltoall(tensor, splits))
        # The async form: the bad rank raises at the call, the others at synchronize.
        expect(ValueError, [f"on rank {bad}", "integers"],
               lambda: hvd.synchronize(hvd.alltoall_async(tensor, splits)))
    # Every rank (Horovod's own case), as a float tensor and as a list of floats.
    expect(ValueError, ["integers", "float32"],
           lambda: hvd.alltoall(tensor, torch.empty(SIZE, dtype=torch.float32)))
    expect(ValueError, ["integers", "float64"], lambda: hvd.alltoall(tensor, [2.0] * SIZE))
    out, received = hvd.alltoall(tensor, splits=ints)
    close(out, np.concatenate([x[2 * RANK:2 * RANK + 2] for x in inputs]), "alltoall after")
    close(received, np.full(SIZE, 2.0), "received splits after")


class Frozen(torch.nn.Module):
    """Horovod's case: an integer index that is a frozen parameter, and a trainable one."""

    def __init__(self) -> None:
        super().__init__()
        self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                        requires_grad=False)
        self.b = torch.nn.Parameter(torch.tensor(data(20, 0, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.index.long()) * x


def case_optimizer_state_grads() -> None:
    model = Frozen()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, 0, model)  # Horovod's order: optimizer, root, model
    if model.index.grad is not None:
        failures.append("a frozen parameter got a gradient")
    if model.b.grad is None or model.b.grad.is_sparse:
        failures.append(f"b's gradient is {model.b.grad}, not dense zeros")
    else:
        close(model.b.grad, np.zeros(4), "b's zero gradient", 0)
    close(model.b, data(20, 0, 4), "weights untouched", 0)
    # Backward adds to the zeros; the step is the global batch's: the average over ranks of
    # each rank's x at rows 1 and 3 (momentum's first step is the gradient itself).
    xs = [data(21, r, 2) for r in range(SIZE)]
    model(torch.tensor(xs[RANK])).sum().backward()
    opt.step()
    want = data(20, 0, 4)
    want[[1, 3]] -= 0.1 * np.mean(xs, axis=0)
    close(model.b, want, "the step after broadcast_optimizer_state")
    # A rank whose optimizer has state keeps its gradients; the others get zeros.
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.tensor(data(22, RANK, 4, 3))).sum().backward()
    mine = [p.grad.clone() for p in net.parameters()]
    root = SIZE - 1
    if RANK == root:
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    for p, before in zip(net.parameters(), mine):
        close(p.grad, before if RANK == root else torch.zeros_like(before),
              "gradient kept by the root, zeroed elsewhere", 0)


def case_sparse_as_dense_adam() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Embedding(12, 3, sparse=True)
    emb = copy.deepcopy(ref)
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=True)

    def batch(step: int, rank: int):
        """Ids and loss weights; the last rank skips the embedding in step 2."""
        if step == 2 and rank == SIZE - 1:
            return None
        rng = np.random.default_rng([30, step, rank])
        ids = torch.from_numpy(rng.integers(0, 12, size=(2, 3)))
        return ids, torch.from_numpy(rng.normal(size=(2, 3, 3)))

    for step in range(4):
        ref_opt.zero_grad()
        opt.zero_grad(set_to_none=step % 2 == 0)
        # One process on the global batch: the mean of the ranks' losses.
        sum((ref(ids) * w).sum() for ids, w in filter(None, (batch(step, r)
                                                           for r in range(SIZE)))).div(
            SIZE).backward()
        mine = batch(step, RANK)
        if mine is not None:
            (emb(mine[0]) * mine[1]).sum().backward()
        opt.synchronize()
        grad, want = emb.weight.grad, ref.weight.grad.coalesce()
        if not grad.is_sparse:
            failures.append(f"step {step}: the gradient came back {grad.layout}")
            return
        close(grad.coalesce().indices(), want.indices(), f"step {step}: touched rows", 0)
        close(grad.to_dense(), want.to_dense(), f"step {step}: gradient")
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
    close(emb.weight, ref.weight, "SparseAdam weights after 4 steps")


def adasum(vectors):
    """NumPy reference: Adasum of a power of two of vectors, paired (0, 1), (2, 3), ... then
    pairs of those; a coefficient stays 1 where its vector's squared norm is below 1e-8."""
    while len(vectors) > 1:
        pairs = []
        for a, b in zip(vectors[::2], vectors[1::2]):
            ab, aa, bb = np.vdot(a, b), np.vdot(a, a), np.vdot(b, b)
            pairs.append((1 - ab / (2 * aa) if aa >= 1e-8 else 1.0) * a
                         + (1 - ab / (2 * bb) if bb >= 1e-8 else 1.0) * b)
        vectors = pairs
    return vectors[0]


def case_adasum_optimizer() -> None:
    def net() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2),
                                   torch.nn.Linear(2, 1))

    def make(params):
        return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01)

    def loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
        rng = np.random.default_rng([40, step, rank])
        x = torch.from_numpy(rng.normal(size=(5, 4)))
        out = model[:3](x)
        if step % 2 == 1 and rank == 0:
            # The last layer only here: the other ranks' update of it is zero (no gradient),
            # and in even steps every rank's is.
            return model[3](out).sum()
        return out.pow(2).mean() * (rank + 1)

    model = net()
    if SIZE & (SIZE - 1):  # Horovod's rule: a power of two of ranks; refused on every rank
        for kind in (ValueError, NotImplementedError):  # NotImplementedError: Horovod's
            expect(kind, ["power-of-two", f"has {SIZE}"],
                   lambda: hvd.DistributedOptimizer(make(model.parameters()), op=hvd.Adasum))
        close(hvd.allreduce(torch.ones(2), op=hvd.Sum), np.full(2, SIZE), "allreduce after")
        return
    opt = hvd.DistributedOptimizer(make(model.parameters()), op=hvd.Adasum,
                                   named_parameters=model.named_parameters())
    # Reference: one copy of model and optimizer per rank in this process. Each step, every
    # copy starts from the common weights, steps on its rank's loss (its momentum follows
    # its own gradients), and the common weights move by the Adasum of the copies' updates.
    weights = [p.detach().clone() for p in net().parameters()]
    copies = [net() for _ in range(SIZE)]
    optimizers = [make(c.parameters()) for c in copies]
    for step in range(3):
        updates = []
        for r, (c, o) in enumerate(zip(copies, optimizers)):
            with torch.no_grad():
                for p, w in zip(c.parameters(), weights):
                    p.copy_(w)
            o.zero_grad()
            loss(c, step, r).backward()
            o.step()
            updates.append([(p - w).detach().numpy() for p, w in zip(c.parameters(), weights)])
        weights = [w + torch.from_numpy(adasum([u[i] for u in updates]))
                   for i, w in enumerate(weights)]
        opt.zero_grad()
        loss(model, step, RANK).backward()
        opt.synchronize()  # nothing to wait for with Adasum, as in Horovod
        opt.step()
        for i, (p, w) in enumerate(zip(model.parameters(), weights)):
            close(p, w, f"Adasum step {step} parameter {i}")


run_cases({"reducescatter_grad": case_reducescatter_grad,
           "alltoall_float_splits": case_alltoall_float_splits,
           "optimizer_state_grads": case_optimizer_state_grads,
           "sparse_as_dense_adam": case_sparse_as_dense_adam,
           "adasum_optimizer": case_adasum_optimizer}, failures, RANK)
