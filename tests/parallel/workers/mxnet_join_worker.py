"""DistributedTrainer with unequal numbers of batches per rank, ended by hvd_trainer.join().

Rank r trains on 1 + (size - 1 - r) batches, then joins; the trainer's steps (step-time
freshness flags) are served by the joined ranks with zeros. Every rank then takes rank 0's
weights (rank 0 joined last, as join must return) and they must equal plain Gluon in one
process where each step's gradient is the sum of the gradients of the ranks that still have
a batch, over the full size (Horovod 0.28's Average). One case (case_runner.py).
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer
from case_runner import run_cases

hvd_trainer.init()
RANK, SIZE = hvd_trainer.rank(), hvd_trainer.size()
BATCHES = [1 + (SIZE - 1 - r) for r in range(SIZE)]
B = 4
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
loss_fn = gluon.loss.L2Loss()


def batch(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return mx.nd.array(rng.normal(size=(B, 5))), mx.nd.array(rng.normal(size=(B, 2)))


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(6, activation="tanh", in_units=5), gluon.nn.Dense(2, in_units=6))
    mx.random.seed(7)
    net.initialize(mx.init.Xavier())
    return net


def gradients(net, x, y):
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    return [p.grad().asnumpy() for p in net.collect_params().values()]


def unequal_batches_then_join():
    net = make_net()
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", dict(SGD))
    for step in range(BATCHES[RANK]):
        gradients(net, *batch(RANK, step))
        trainer.step(B)
    last = hvd_trainer.join()
    assert last == 0, f"rank {RANK}: join returned {last}, not 0"
    hvd_trainer.broadcast_parameters(net.collect_params(), root_rank=last)

    ref = make_net()
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", dict(SGD))
    for step in range(max(BATCHES)):
        total = None
        for r in range(SIZE):
            if step < BATCHES[r]:
                grads = gradients(ref, *batch(r, step))
                total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, t in zip(ref.collect_params().values(), total):
            p.grad()[:] = t / SIZE
        ref_trainer.step(B)

    for (name, got), want in zip(net.collect_params().items(), ref.collect_params().values()):
        np.testing.assert_allclose(got.data().asnumpy(), want.data().asnumpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=f"rank {RANK}: {name}")


run_cases({"unequal_batches_then_join": unequal_batches_then_join}, rank=RANK)
