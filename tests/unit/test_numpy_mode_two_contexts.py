"""numpy-mode Gluon in one process with two contexts: the trainer's gradient buckets hold
mx.np.ndarray views, and training equals one context on the whole batch."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.util import use_np

from hvd_trainer import DistributedTrainer


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(5, activation="tanh", in_units=3), gluon.nn.Dense(2, in_units=5))
    return net


def train(net, trainer, ctxs, steps=3):
    rng = np.random.RandomState(0)
    for _ in range(steps):
        x = rng.uniform(-1, 1, (8, 3)).astype(np.float32)
        y = rng.uniform(-1, 1, (8, 2)).astype(np.float32)
        with autograd.record():
            losses = [gluon.loss.L2Loss()(net(mx.np.array(a, ctx=c)), mx.np.array(b, ctx=c))
                      for a, b, c in zip(np.split(x, len(ctxs)), np.split(y, len(ctxs)), ctxs)]
        autograd.backward(losses)
        trainer.step(8)


@use_np
def test_two_contexts_in_numpy_mode_match_one_context():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = make_net()
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    start = [p.data(ctxs[0]).asnumpy() for p in net.collect_params().values()]
    trainer = DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1,
                                                               "momentum": 0.9})
    train(net, trainer, ctxs)
    ref = make_net()
    ref.initialize(ctx=mx.cpu())
    for p, v in zip(ref.collect_params().values(), start):
        p.set_data(mx.np.array(v))
    train(ref, gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1,
                                                            "momentum": 0.9}), [mx.cpu()])
    for p, want in zip(net.collect_params().values(), ref.collect_params().values()):
        for ctx in ctxs:
            assert isinstance(p.grad(ctx), mx.np.ndarray), type(p.grad(ctx))
            np.testing.assert_allclose(p.data(ctx).asnumpy(), want.data().asnumpy(),
                                       rtol=1e-5, atol=1e-6)
