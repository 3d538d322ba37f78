"""The model and data of the elastic Gluon and torch tests, shared by their workers and
their references (each framework is imported only by its own model)."""
import numpy as np

NUM_SAMPLES, BATCH, EPOCHS = 36, 2, 2


def data():
    """Inputs (NUM_SAMPLES x 5) and targets (NUM_SAMPLES x 3), fixed."""
    rng = np.random.RandomState(11)
    inputs = rng.randn(NUM_SAMPLES, 5).astype(np.float32)
    return inputs, rng.randn(NUM_SAMPLES, 3).astype(np.float32)


def initial_weights():
    """The fixed initial weight (3 x 5) and bias (3)."""
    rng = np.random.RandomState(7)
    return [rng.randn(*shape).astype(np.float32) * 0.3 for shape in ((3, 5), (3,))]


def make_net():
    """A Gluon Dense(3) layer with the fixed initial weights."""
    import mxnet as mx
    net = mx.gluon.nn.Dense(3, in_units=5)
    net.initialize(mx.init.Xavier(rnd_type="gaussian"))
    for param, values in zip(net.collect_params().values(), initial_weights()):
        param.set_data(mx.nd.array(values))
    return net


def make_torch_net():
    """A torch Linear(5, 3) layer with the fixed initial weights."""
    import torch
    net = torch.nn.Linear(5, 3)
    with torch.no_grad():
        for param, values in zip((net.weight, net.bias), initial_weights()):
            param.copy_(torch.from_numpy(values))
    return net


def torch_step(state, optimizer, x, y, position: int, batch, commit_every: int) -> bool:
    """One step of the elastic torch trainings (the worker and the engines' function): the
    squared loss's backward and update on ``x, y``, the global batch noted in
    ``state.history``, the sampler told; commits every ``commit_every`` steps and says whether
    it did."""
    import hvd_trainer.torch as hvd
    optimizer.zero_grad()
    ((state.model(x) - y) ** 2).sum().backward()
    optimizer.step()
    state.history.append([state.epoch, hvd.size(), hvd.allgather_object(batch, name="batch")])
    state.sampler.record_batch(position, BATCH)
    state.step += 1
    if state.step % commit_every:
        return False
    state.commit()
    return True
