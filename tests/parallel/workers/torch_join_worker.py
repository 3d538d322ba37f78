"""hvd_trainer.torch.join on this job's ranks, against NumPy.

Each rank in turn joins first. The others then run allreduce, its async form and
grouped_allreduce (several dtypes, one tensor larger than the fusion threshold), Min/Max,
Adasum on 2 ranks, barrier, a step of the core's reducer with more freshness flags than
the agreement record carries, and an allreduce on a process set that may hold the joined
rank: each result must equal the NumPy reduction of the ranks that
have not joined, with zeros for the joined ones and Average dividing by the full size
(Horovod 0.28's rule). Collectives a joined rank cannot serve must raise on every rank that
called them; an argument error and a disagreement among the active ranks too. The rest join
one at a time, and join must return the last of them on every rank. After join, unnamed
collectives on every rank work as before.

Then DistributedOptimizer with unequal numbers of batches: rank r trains on 2 + (size-1-r)
batches (rank 0 the most), then joins. After join, rank 0 (the last to join, as join must
return) broadcasts its weights, and every rank's weights must equal a single-process run of
the same rule: at step s, SGD (momentum, weight decay) on the sum of the gradients of the
ranks that still have batch s, over the full size. Small buckets (HVD_BUCKET_THRESHOLD, set by
the test) give several reductions per step. Each of the three parts is a case of its own
(case_runner.py).
"""
import numpy as np
import torch
from torch import nn

import hvd_trainer
import hvd_trainer.torch as hvd
from case_runner import run_cases
from hvd_trainer.training.buckets import Gradient
from hvd_trainer.training.reducer import Reducer

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
# A process set that a joined rank may belong to (on 2 ranks, the world).
PAIR = hvd.add_process_set([0, SIZE - 1]) if SIZE > 2 else hvd.global_process_set


def data(seed: int, rank: int, shape) -> np.ndarray:
    """Rank ``rank``'s input for check ``seed``: small integers, exact in every dtype."""
    return np.random.default_rng(1000 * seed + rank).integers(-4, 5, size=shape).astype(np.float64)


def check(got: torch.Tensor, want: np.ndarray, what: str, rtol: float = 1e-6) -> None:
    assert tuple(got.shape) == np.shape(want), f"{what}: shape {tuple(got.shape)}"
    np.testing.assert_allclose(got.to(torch.float64).numpy(), want, rtol=rtol, atol=0,
                               err_msg=f"rank {RANK}: {what}")


def raises(kind, fragments, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except kind as e:
        for fragment in fragments:
            assert fragment in str(e), f"rank {RANK}: {kind.__name__} without {fragment!r}: {e}"
        return
    raise AssertionError(f"rank {RANK}: {fn.__name__} did not raise {kind.__name__}")


def reductions(seed: int, active) -> None:
    """The servable collectives, made by the ranks in ``active`` while the others are joined."""
    zeros_for = [r for r in range(SIZE) if r not in active]

    def inputs(k, shape):
        return [data(seed + k, r, shape) if r in active else np.zeros(shape)
                for r in range(SIZE)]

    x = inputs(0, (7,))
    check(hvd.allreduce(torch.tensor(x[RANK], dtype=torch.float32)), sum(x) / SIZE,
          f"Average with {zeros_for} joined: divided by the full size")
    x = inputs(1, (2, 3))
    check(hvd.allreduce(torch.tensor(x[RANK], dtype=torch.int32), op=hvd.Sum), sum(x),
          "int32 Sum")
    x = inputs(2, (5,))
    handle = hvd.allreduce_async_(torch.tensor(x[RANK], dtype=torch.float64), name="scaled",
                                  op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    check(hvd.synchronize(handle), sum(x), "allreduce_async_ with scale factors")
    shapes = [(3, 4), (40000,), (5,), (6,)]
    dtypes = [torch.float32, torch.float32, torch.int64, torch.bfloat16]
    xs = [inputs(3 + i, s) for i, s in enumerate(shapes)]
    got = hvd.grouped_allreduce([torch.tensor(x[RANK]).to(d) for x, d in zip(xs, dtypes)],
                                op=hvd.Sum)
    for i, (g, x, d) in enumerate(zip(got, xs, dtypes)):
        assert g.dtype == d, f"grouped tensor {i}: {g.dtype}"
        check(g, sum(x), f"grouped_allreduce tensor {i} ({d})")
    x = inputs(8, (4,))
    negative = [v - 10 if r in active else v for r, v in enumerate(x)]
    check(hvd.allreduce(torch.tensor(negative[RANK]), op=hvd.Max), np.max(negative, axis=0),
          "Max: the joined ranks' zeros count")
    if SIZE == 2:  # Adasum needs a power of two; the joined rank's zeros leave the sum alone
        x = inputs(9, (6,))
        check(hvd.allreduce(torch.tensor(x[RANK]), op=hvd.Adasum), x[active[0]], "Adasum")
    hvd.barrier()
    checks_reducer(seed, active)
    if RANK in PAIR.ranks:  # a joined member of a process set serves its calls too
        x = inputs(10, (3,))
        check(hvd.allreduce(torch.tensor(x[RANK]), process_set=PAIR),
              sum(x[r] for r in PAIR.ranks) / 2, "Average on a process set")
        if any(r not in active for r in PAIR.ranks):
            raises(hvd.HorovodInternalError, ["cannot run while", "joined"], hvd.allgather,
                   torch.ones(1), process_set=PAIR)


def checks_reducer(seed: int, active) -> None:
    """A step-time (flagged) step of the core's reducer: 400 gradients need more flags than
    the agreement record carries, so the joined ranks take part in the second exchange."""
    reducer = Reducer(prefix=f"join{seed}.")
    reducer.set_gradients([Gradient(k, (2,), "<f4") for k in range(400)])
    views = {}
    for bucket in reducer.buckets:
        flat = np.zeros(bucket.bounds[-1], bucket.dtype)
        for key, a, b in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
            views[key] = flat[a:b]
        bucket.open = lambda flat=flat: flat
    stale = 7 if RANK == active[0] else -1  # fresh on the other active ranks only
    ready = []
    for key in range(400):
        if key != stale:
            views[key][...] = data(seed + 20, RANK, (2,)) + key
            ready.append((key, None))
    reducer.mark_all(ready)
    reducer.finish(reducer.close()[0])
    for key in (0, 7, 399):
        want = sum(data(seed + 20, r, (2,)) + key for r in active
                   if not (key == 7 and r == active[0]))
        if key == 7 and len(active) == 1:
            want = data(seed + 20, RANK, (2,)) * 0  # fresh nowhere: left as it was
        np.testing.assert_allclose(views[key], want, rtol=1e-6, err_msg=f"reducer key {key}")


def refused(active) -> None:
    """Calls a joined rank cannot serve raise on every active rank; the next call works."""
    joined = [r for r in range(SIZE) if r not in active]
    who = f"rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))}"
    t = torch.ones(2 * SIZE)
    for fn, args in ((hvd.allgather, (t,)), (hvd.broadcast, (t, active[0])),
                     (hvd.reducescatter, (t,)), (hvd.alltoall, (t,)),
                     (hvd.broadcast_object, ("x", active[0]))):
        raises(hvd.HorovodInternalError, [f"cannot run while {who}", "joined"], fn, *args)
    # An argument error on one active rank raises on each of them.
    raises(TypeError, ["prescale_factor", f"rank {active[0]}"], hvd.allreduce, torch.ones(3),
           prescale_factor="x" if RANK == active[0] else 1.0)
    if len(active) > 1:  # active ranks that disagree raise MismatchError
        raises(hvd_trainer.MismatchError, ["disagree on shape"], hvd.allreduce,
               torch.ones(RANK + 1), name="mismatched")


def join_in_turn(first: int, seed: int) -> None:
    """``first`` joins; the rest make calls, then join one at a time, the lowest rank last."""
    order = [first] + [r for r in reversed(range(SIZE)) if r != first]
    for position, rank in enumerate(order):
        active = sorted(order[position:])
        if RANK == rank:
            last = hvd.join()
            assert last == order[-1], f"rank {RANK}: join returned {last}, not {order[-1]}"
            return
        if position == 0:
            reductions(seed, [r for r in active if r != first])
            refused([r for r in active if r != first])
        else:
            rest = [r for r in active if r != rank]
            x = [data(seed + 30 + position, r, (3,)) if r in rest else np.zeros(3)
                 for r in range(SIZE)]
            check(hvd.allreduce(torch.tensor(x[RANK]), op=hvd.Sum), sum(x),
                  f"allreduce with {position + 1} ranks joined")


def each_rank_joins_first_in_turn() -> None:
    for first in range(SIZE):
        join_in_turn(first, 100 * first)
        # After join every rank takes part again; unnamed calls name alike on every rank.
        x = [data(77 + first, r, (4,)) for r in range(SIZE)]
        check(hvd.allreduce(torch.tensor(x[RANK]), op=hvd.Sum), sum(x), "allreduce after join")
        assert hvd.allgather_object(RANK) == list(range(SIZE))
    if SIZE > 2:
        hvd.remove_process_set(PAIR)


def ranks_joining_together() -> None:
    """Ranks joining together: the highest of them is last."""
    assert hvd.join() == SIZE - 1
    assert hvd.join(device=0) == SIZE - 1


# -- DistributedOptimizer with unequal numbers of batches ------------------------------------
BATCHES = [2 + (SIZE - 1 - r) for r in range(SIZE)]


def batch(rank: int, step: int):
    rng = np.random.default_rng(100 * rank + step)
    x = torch.tensor(rng.normal(size=(5, 4)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, size=5))
    return x, y


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def optimizer_with_unequal_batches() -> None:
    loss_fn = nn.CrossEntropyLoss()

    net = model()
    opt = hvd.DistributedOptimizer(sgd(net.parameters()), named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    for step in range(BATCHES[RANK]):
        opt.zero_grad()
        x, y = batch(RANK, step)
        loss_fn(net(x), y).backward()
        opt.step()
    last = hvd.join()
    assert last == 0, f"rank {RANK}: join returned {last}, not 0 (the rank with most batches)"
    hvd.broadcast_parameters(net.state_dict(), root_rank=last)

    # The single-process reference.
    ref = model()
    ref_opt = sgd(ref.parameters())
    for step in range(max(BATCHES)):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(SIZE):
            if step < BATCHES[r]:
                ref.zero_grad()
                x, y = batch(r, step)
                loss_fn(ref(x), y).backward()
                total = [t + p.grad for t, p in zip(total, ref.parameters())]
        for p, t in zip(ref.parameters(), total):
            p.grad = t / SIZE
        ref_opt.step()

    for (name, got), want in zip(net.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=f"rank {RANK}: {name}")


run_cases({"each_rank_joins_first_in_turn": each_rank_joins_first_in_turn,
           "ranks_joining_together": ranks_joining_together,
           "optimizer_with_unequal_batches": optimizer_with_unequal_batches}, rank=RANK)
