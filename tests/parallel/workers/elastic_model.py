"""The model and data of the elastic Gluon test, shared by its worker and its reference."""
import mxnet as mx
import numpy as np

NUM_SAMPLES, BATCH, EPOCHS = 36, 2, 2


def data():
    """Inputs (NUM_SAMPLES x 5) and targets (NUM_SAMPLES x 3), fixed."""
    rng = np.random.RandomState(11)
    inputs = rng.randn(NUM_SAMPLES, 5).astype(np.float32)
    return inputs, rng.randn(NUM_SAMPLES, 3).astype(np.float32)


def make_net() -> mx.gluon.nn.Dense:
    """A Dense(3) layer with fixed initial weights."""
    net = mx.gluon.nn.Dense(3, in_units=5)
    net.initialize(mx.init.Xavier(rnd_type="gaussian"))
    rng = np.random.RandomState(7)
    for param in net.collect_params().values():
        param.set_data(mx.nd.array(rng.randn(*param.shape).astype(np.float32) * 0.3))
    return net
