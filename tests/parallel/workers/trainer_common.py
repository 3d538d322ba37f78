"""Helpers shared by the DistributedTrainer workers: a small net, data, snapshots, checks.

Every rank draws the same global batches from a fixed seed and trains on its own block of
rows; a reference on rank 0 trains a plain gluon.Trainer on the whole global batch, starting
from the weights the distributed run started from.
"""
from typing import Callable, List, Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer

IN, HIDDEN, OUT = 8, 16, 4
loss_fn = gluon.loss.L2Loss()


class BroadcastDense(gluon.HybridBlock):
    """A dense layer from elementwise ops: MXNet's CPU matrix products have no float16 kernels."""

    def __init__(self, units: int, in_units: int, activation: str = None):
        super().__init__()
        self.activation = activation
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(in_units, units))
            self.bias = self.params.get("bias", shape=(units,), init="zeros")

    def hybrid_forward(self, F, x, weight, bias):
        y = F.sum(F.broadcast_mul(F.expand_dims(x, 2), F.expand_dims(weight, 0)), axis=1)
        y = F.broadcast_add(y, bias)
        return F.Activation(y, self.activation) if self.activation else y


def make_net(deferred: bool = False, dtype: str = "float32") -> gluon.nn.HybridSequential:
    """Two dense layers; with ``deferred`` the input widths are left for the first forward.

    float16 nets use :class:`BroadcastDense` (no deferred shapes) so that they run on a CPU.
    """
    net = gluon.nn.HybridSequential()
    if dtype == "float16":
        net.add(BroadcastDense(HIDDEN, IN, "tanh"), BroadcastDense(OUT, HIDDEN))
        net.cast(dtype)
    else:
        net.add(gluon.nn.Dense(HIDDEN, activation="tanh", in_units=0 if deferred else IN),
                gluon.nn.Dense(OUT, in_units=0 if deferred else HIDDEN))
    return net


def seed_per_rank() -> None:
    """Different random initial weights on every rank: the trainer's broadcast must fix them."""
    mx.random.seed(1000 + hvd_trainer.rank())
    np.random.seed(1000 + hvd_trainer.rank())


def global_batches(steps: int, rows: int, seed: int = 42):
    """The same ``steps`` batches of ``rows`` rows on every rank."""
    rng = np.random.RandomState(seed)
    return [(rng.uniform(-1, 1, (rows, IN)).astype(np.float32),
             rng.uniform(-1, 1, (rows, OUT)).astype(np.float32)) for _ in range(steps)]


def my_rows(array: np.ndarray) -> np.ndarray:
    """This rank's block of a global batch."""
    per = array.shape[0] // hvd_trainer.size()
    return array[hvd_trainer.rank() * per:(hvd_trainer.rank() + 1) * per]


def params(net: gluon.Block) -> List[gluon.Parameter]:
    """The net's parameters in registration order (the same order for every instance)."""
    return list(net.collect_params().values())


def snapshot(net: gluon.Block) -> List[np.ndarray]:
    """Copies of every parameter on every context, first context first."""
    return [d.asnumpy() for p in params(net) for d in p.list_data()]


def first_context(net: gluon.Block) -> List[np.ndarray]:
    """Copies of every parameter's first-context value."""
    return [p.list_data()[0].asnumpy() for p in params(net)]


def load(net: gluon.Block, values: Sequence[np.ndarray]) -> None:
    """Set every parameter of ``net`` (all contexts) to ``values``."""
    for p, v in zip(params(net), values):
        p.set_data(mx.nd.array(v, dtype=v.dtype))


def forward_backward(net: gluon.Block, x: np.ndarray, y: np.ndarray,
                     ctxs: Sequence[mx.Context], dtype: str = "float32") -> None:
    """Split the rows over the contexts, forward, and backward the summed per-sample losses."""
    xs, ys = np.array_split(x, len(ctxs)), np.array_split(y, len(ctxs))
    with autograd.record():
        losses = [loss_fn(net(mx.nd.array(a, ctx=c, dtype=dtype)),
                          mx.nd.array(b, ctx=c, dtype=dtype))
                  for a, b, c in zip(xs, ys, ctxs)]
    autograd.backward(losses)


def same_on_all_ranks(values: Sequence[np.ndarray], what: str) -> None:
    """Every rank holds bit-identical ``values``."""
    every = hvd_trainer.allgather_object([np.asarray(v) for v in values])
    for r, theirs in enumerate(every):
        for i, (a, b) in enumerate(zip(every[0], theirs)):
            assert np.array_equal(a, b), f"{what}: tensor {i} differs between rank 0 and rank {r}"


def close(got: Sequence[np.ndarray], want: Sequence[np.ndarray], rtol: float, atol: float,
          what: str) -> float:
    """Assert elementwise closeness; return the largest absolute difference."""
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.allclose(g, w, rtol=rtol, atol=atol), \
            f"{what}: tensor {i} max |diff| {np.abs(g - w).max():.3g}"
        worst = max(worst, float(np.abs(g - w).max()))
    return worst


def reference(make: Callable[[], gluon.Block], start: Sequence[np.ndarray], optimizer: str,
              optimizer_params: dict, batches, steps_hook=None, dtype: str = "float32",
              split: bool = False) -> List[np.ndarray]:
    """One process, plain gluon.Trainer, the whole global batch, step(global rows)."""
    net = make()
    net.initialize(ctx=mx.cpu())
    load(net, start)
    trainer = gluon.Trainer(net.collect_params(), optimizer, optimizer_params)
    for step, (x, y) in enumerate(batches):
        forward_backward(net, x, y, [mx.cpu()], dtype)
        if split:
            trainer.allreduce_grads()
            trainer.update(x.shape[0])
        else:
            trainer.step(x.shape[0])
        if steps_hook:
            steps_hook(step, trainer)
    return first_context(net)
