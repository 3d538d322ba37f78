"""A horovod.mxnet-style Gluon script; only its import line differs from the Horovod original.

Trains a small MLP on scikit-learn's digits (bundled, no download), each rank on its own shard,
and averages the test metrics across ranks with hvd.allreduce. Run it with

    hvdrun -np 2 python examples/horovod_api.py
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvd_trainer.mxnet as hvd  # the Horovod original: import horovod.mxnet as hvd

EPOCHS, BATCH, LR = 8, 32, 0.05

hvd.init()
mx.random.seed(hvd.rank())  # different on every rank: broadcast_parameters makes them agree
np.random.seed(hvd.rank())  # the DataLoader's shuffling
ctx = mx.cpu(hvd.local_rank())

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    (digits.data / 16.0).astype(np.float32), digits.target.astype(np.float32),
    test_size=0.25, random_state=0)
shard = slice(hvd.rank(), None, hvd.size())  # every rank trains and tests on its own part
train = gluon.data.DataLoader(gluon.data.ArrayDataset(x_train[shard], y_train[shard]),
                              batch_size=BATCH, shuffle=True)
test = gluon.data.DataLoader(gluon.data.ArrayDataset(x_test[shard], y_test[shard]),
                             batch_size=256)

net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(64, activation="relu", in_units=64), gluon.nn.Dense(10, in_units=64))
net.initialize(mx.init.Xavier(), ctx=ctx)
net.hybridize()
params = net.collect_params()
hvd.broadcast_parameters(params, root_rank=0)

# Horovod's recipe: scale the learning rate by the number of workers.
opt = mx.optimizer.create("sgd", learning_rate=LR * hvd.size(), momentum=0.9)
trainer = hvd.DistributedTrainer(params, opt)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

for epoch in range(EPOCHS):
    total_loss = mx.nd.zeros(1, ctx=ctx)
    for data, label in train:
        data, label = data.as_in_context(ctx), label.as_in_context(ctx)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(data.shape[0])
        total_loss += loss.sum()

    correct, seen = mx.nd.zeros(1, ctx=ctx), mx.nd.zeros(1, ctx=ctx)
    for data, label in test:
        pred = net(data.as_in_context(ctx)).argmax(axis=1)
        correct += (pred == label.as_in_context(ctx)).sum()
        seen += data.shape[0]
    # Metric averaging across ranks, the Horovod way.
    mean_loss = hvd.allreduce(total_loss / len(x_train[shard]), name="loss", op=hvd.Average)
    correct, seen = hvd.grouped_allreduce([correct, seen], name="accuracy", op=hvd.Sum)
    if hvd.rank() == 0:
        print(f"epoch {epoch}: train loss {mean_loss.asscalar():.4f}, "
              f"test accuracy {(correct / seen).asscalar():.4f} on {int(seen.asscalar())} "
              f"samples, {hvd.size()} ranks", flush=True)
