"""numpy-mode Gluon (npx.set_np()): N ranks with batch B calling step(B) == one process with
batch N*B calling step(N*B), and every gradient stays an mx.np.ndarray.

Each case starts the ranks from different random weights, trains a few steps with
DistributedTrainer and compares with a plain gluon.Trainer reference on the global batch.
Each case reports on its own (case_runner.py).
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, npx

import hvd_trainer
from case_runner import run_cases
from trainer_common import close, global_batches, same_on_all_ranks

npx.set_np()
STEPS, PER_RANK = 4, 6
loss_fn = gluon.loss.L2Loss()

CASES = [
    ("sgd momentum wd", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
     [mx.cpu()], {}),
    ("adam, num_groups=2, two contexts per process", "adam", {"learning_rate": 0.01},
     [mx.cpu(0), mx.cpu(1)], {"num_groups": 2}),
]


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="tanh", in_units=8), gluon.nn.Dense(4, in_units=16))
    return net


def values(net):
    return [p.list_data()[0].asnumpy() for p in net.collect_params().values()]


def forward_backward(net, x, y, ctxs):
    xs, ys = np.array_split(x, len(ctxs)), np.array_split(y, len(ctxs))
    with autograd.record():
        losses = [loss_fn(net(mx.np.array(a, ctx=c)), mx.np.array(b, ctx=c))
                  for a, b, c in zip(xs, ys, ctxs)]
    autograd.backward(losses)


def train(net, trainer, batches, ctxs, rows):
    for x, y in batches:
        forward_backward(net, rows(x), rows(y), ctxs)
        trainer.step(rows(x).shape[0])
        for p in net.collect_params().values():
            for g in p.list_grad():
                assert isinstance(g, mx.np.ndarray), f"{p.name}: grad is a {type(g).__name__}"


def run_case(index):
    rank, size = hvd_trainer.rank(), hvd_trainer.size()

    def mine(a):
        return a[rank * PER_RANK:(rank + 1) * PER_RANK]

    name, optimizer, options, ctxs, kwargs = CASES[index]
    batches = global_batches(STEPS, PER_RANK * size, seed=60 + index)
    mx.random.seed(1000 + rank)
    net = make_net()
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), optimizer, dict(options),
                                             prefix=f"np{index}.", **kwargs)
    start = values(net)
    same_on_all_ranks(start, f"{name}: weights after the broadcast")
    train(net, trainer, batches, ctxs, mine)
    for p in net.collect_params().values():
        for d in p.list_data()[1:]:
            assert np.array_equal(d.asnumpy(), p.list_data()[0].asnumpy()), \
                f"{name}: {p.name} differs between contexts"
    same_on_all_ranks(values(net), f"{name}: weights after training")
    if rank == 0:
        ref = make_net()
        ref.initialize(ctx=mx.cpu())
        for p, v in zip(ref.collect_params().values(), start):
            p.set_data(mx.np.array(v))
        ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(options))
        train(ref, ref_trainer, batches, [mx.cpu()], lambda a: a)
        worst = close(values(net), values(ref), 1e-5, 1e-5, name)
        print(f"numpy mode, {name}: max |diff| vs single process {worst:.2g}", flush=True)


def main():
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    run_cases({"sgd_momentum_wd": lambda: run_case(0),
               "adam_num_groups_2_two_contexts": lambda: run_case(1),
               "collectives_keep_numpy_arrays": lambda: collectives_keep_numpy_arrays(rank, size)},
              rank=rank)


def collectives_keep_numpy_arrays(rank, size):
    """horovod.mxnet's collectives on mx.np arrays return mx.np arrays with NumPy's values."""
    import hvd_trainer.mxnet as hvd
    mine = np.arange(6, dtype=np.float32).reshape(3, 2) * (rank + 1)
    every = [np.arange(6, dtype=np.float32).reshape(3, 2) * (r + 1) for r in range(size)]
    results = {
        "allreduce": (hvd.allreduce(mx.np.array(mine), op=hvd.Sum, name="np.sum"), sum(every)),
        "allgather": (hvd.allgather(mx.np.array(mine), name="np.gather"), np.concatenate(every)),
        "broadcast": (hvd.broadcast(mx.np.array(mine), root_rank=size - 1, name="np.bcast"),
                      every[size - 1]),
    }
    for what, (got, want) in results.items():
        assert isinstance(got, mx.np.ndarray), f"{what} returned a {type(got).__name__}"
        assert np.array_equal(got.asnumpy(), want), f"{what}: {got} != {want}"
        got + mx.np.ones(want.shape)  # usable in numpy-mode arithmetic


if __name__ == "__main__":
    main()
