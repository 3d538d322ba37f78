"""DistributedTrainer with row-sparse gradients in a one-rank world: two contexts are summed
locally like one process on one context. (row_sparse weights: test_sparse_weight_trainer.py.)"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from hvd_trainer.mxnet.trainer import DistributedTrainer


def bag_of_words():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Embedding(20, 3, sparse_grad=True), gluon.nn.Dense(2, in_units=12))
    return net


@pytest.mark.parametrize("optimizer, params", [
    ("sgd", {"learning_rate": 0.5, "momentum": 0.9, "wd": 0.01}),
    ("adam", {"learning_rate": 0.05, "lazy_update": False}),
])
def test_two_contexts_match_one_context(optimizer, params):
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net, ref = bag_of_words(), bag_of_words()
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    ref.initialize(ctx=mx.cpu())
    for p, q in zip(net.collect_params().values(), ref.collect_params().values()):
        q.set_data(p.data(mx.cpu(0)))
    trainer = DistributedTrainer(net.collect_params(), optimizer, dict(params))
    ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(params))
    rng = np.random.RandomState(0)
    for _ in range(3):
        tokens = rng.randint(0, 10, (6, 4)).astype(np.float32)
        tokens[:, 0] = 3  # row 3 on both contexts
        with autograd.record():
            losses = [net(mx.nd.array(t, ctx=c)).sum() for t, c in zip(np.split(tokens, 2), ctxs)]
        autograd.backward(losses)
        trainer.step(6)
        with autograd.record():
            loss = ref(mx.nd.array(tokens)).sum()
        loss.backward()
        ref_trainer.step(6)
    assert not trainer.sparse_exchanges[net[0].weight.name].dense
    for p, q in zip(net.collect_params().values(), ref.collect_params().values()):
        for data in p.list_data():
            np.testing.assert_allclose(data.asnumpy(), q.data().asnumpy(), rtol=1e-5, atol=1e-6)
    grads = net[0].weight.list_grad()
    assert all(g.stype == "row_sparse" for g in grads)
    assert np.array_equal(grads[0].indices.asnumpy(), grads[1].indices.asnumpy())

