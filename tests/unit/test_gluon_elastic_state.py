"""GluonState in a one-process world: commit and restore (in memory, and from disk in a
fresh model and trainer) against a plain gluon.Trainer replay of the same batches."""
import mxnet as mx
import numpy as np

import hvd_trainer.mxnet as hvd
from hvd_trainer_launch import protocol


def make_net():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(6, activation="tanh", in_units=4),
            mx.gluon.nn.BatchNorm(in_channels=6), mx.gluon.nn.Dense(2, in_units=6))
    net.initialize(mx.init.Xavier(rnd_type="gaussian", magnitude=1.0))
    for param in net.collect_params().values():  # the same start for every copy
        param.set_data(mx.nd.array(np.random.default_rng(len(param.name)).standard_normal(
            param.shape), dtype=param.dtype))
    return net


def step(net, trainer, batch):
    x, y = batch
    with mx.autograd.record():
        loss = ((net(mx.nd.array(x)) - mx.nd.array(y)) ** 2).sum()
    loss.backward()
    trainer.step(x.shape[0])


def values(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def test_restore_and_recovery_take_the_steps_of_a_plain_replay(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ELASTIC_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv(protocol.SECRET_VARIABLE, "the job's secret")
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((5, 4)), rng.standard_normal((5, 2))) for _ in range(5)]
    options = {"learning_rate": 0.05, "momentum": 0.9, "wd": 0.01}

    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", options)
    state = hvd.elastic.GluonState(net, trainer, batch=0)
    state.recover()
    for state.batch in (0, 1):
        step(net, trainer, batches[state.batch])
    state.batch = 2
    state.commit()
    for batch in batches[3:5]:  # work after the commit, lost by the restore
        step(net, trainer, batch)
    state.restore()
    assert state.batch == 2
    step(net, trainer, batches[2])

    reference = make_net()
    plain = mx.gluon.Trainer(reference.collect_params(), "sgd", options)
    for batch in batches[:3]:
        step(reference, plain, batch)
    for got, want in zip(values(net), values(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    # A new process: a fresh model and trainer recover the commit from disk, momentum and
    # the optimizer's update counts included, and take the next step as the replay does.
    fresh = make_net()
    fresh_trainer = hvd.DistributedTrainer(fresh.collect_params(), "sgd", options)
    recovered = hvd.elastic.GluonState(fresh, fresh_trainer, batch=0)
    recovered.recover()
    assert recovered.batch == 2
    step(fresh, fresh_trainer, batches[2])
    for got, want in zip(values(fresh), values(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert fresh_trainer._optimizer.num_update == plain._optimizer.num_update
