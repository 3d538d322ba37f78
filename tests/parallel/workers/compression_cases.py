"""DistributedTrainer with compression_params, each case against an independent reference.

- 2bit equals MXNet's own: one process, plain gluon.Trainer, kvstore='device',
  update_on_kvstore=False, the same compression_params, one context per rank holding that
  rank's rows. MXNet quantizes each context's gradient with its own residual and sums the
  dequantized values, so the weights must agree bit for bit;
- topk with ratio 1 sends everything: equal to uncompressed gluon.Trainer on the global batch;
- every type leaves bit-identical weights on every rank;
- save_checkpoint / load_checkpoint keep the residuals (PowerSGD's factors and counts too): a
  resumed run continues bit-identically;
- communication_stats count the bytes of each transport;
- a user's comm hook (register_comm_hook) that sums sums like the built-in hook.
Run with the pytest temporary directory as the only argument.
"""
import math
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer
from case_runner import run_cases
from hvd_trainer.compression import GatherCompressor
from hvd_trainer.training import hooks

FEATURES, HIDDEN, CLASSES, PER_RANK, STEPS = 20, 64, 16, 8, 6
SGD = {"learning_rate": 0.1, "momentum": 0.9}
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def say(message):
    if hvd_trainer.rank() == 0:
        print(message, flush=True)


def make_net(bias=False):
    """Two dense layers of 1280 and 1024 weights: both at or above the default min_size."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HIDDEN, activation="tanh", in_units=FEATURES, use_bias=bias),
            gluon.nn.Dense(CLASSES, in_units=HIDDEN, use_bias=bias))
    return net


def batches(seed=7):
    rng = np.random.RandomState(seed)
    rows = PER_RANK * hvd_trainer.size()
    return [(rng.randn(rows, FEATURES).astype(np.float32),
             rng.randint(0, CLASSES, rows).astype(np.float32)) for _ in range(STEPS)]


def weights(net):
    return [p.list_data()[0].asnumpy() for p in net.collect_params().values()]


def load(net, values):
    for p, v in zip(net.collect_params().values(), values):
        p.set_data(mx.nd.array(v))


def backward(net, x, y, ctxs):
    """Forward and backward of block r of the rows on context r (one context: all rows)."""
    with autograd.record():
        losses = [loss_fn(net(mx.nd.array(a, ctx=c)), mx.nd.array(b, ctx=c))
                  for a, b, c in zip(np.array_split(x, len(ctxs)), np.array_split(y, len(ctxs)),
                                     ctxs)]
    autograd.backward(losses)


def mine(array):
    r = hvd_trainer.rank()
    return array[r * PER_RANK:(r + 1) * PER_RANK]


def distributed(params, data, bias=False, start=None, trainer_kwargs=None):
    """Train on this rank's rows; returns (start weights, end weights, trainer, net)."""
    mx.random.seed(100 + hvd_trainer.rank())
    net = make_net(bias)
    net.initialize(mx.init.Xavier())
    if start is not None:
        load(net, start)
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", dict(SGD),
                                             compression_params=params, **(trainer_kwargs or {}))
    first = weights(net)
    for x, y in data:
        backward(net, mine(x), mine(y), [mx.cpu()])
        trainer.step(PER_RANK)
    return first, weights(net), trainer, net


def same_on_all_ranks(values, what):
    every = hvd_trainer.allgather_object(values)
    for r, theirs in enumerate(every):
        for i, (a, b) in enumerate(zip(every[0], theirs)):
            assert np.array_equal(a, b), f"{what}: tensor {i} differs on rank {r}"


def mxnet_reference(start, data, params, bias=False):
    """MXNet's own KVStore compression: one context per rank, each with that rank's rows."""
    ctxs = [mx.cpu(r) for r in range(hvd_trainer.size())]
    net = make_net(bias)
    net.initialize(ctx=ctxs)
    load(net, start)
    kwargs = {} if params is None else {"compression_params": params}
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(SGD), kvstore="device",
                            update_on_kvstore=False, **kwargs)
    for x, y in data:
        backward(net, x, y, ctxs)
        trainer.step(x.shape[0])
    return weights(net)


def equals_mxnet_2bit():
    data = batches()
    for threshold in (0.05, 0.01):
        params = {"type": "2bit", "threshold": threshold}
        start, end, _, _ = distributed(params, data)
        same_on_all_ranks(end, f"2bit {threshold}")
        if hvd_trainer.rank() == 0:
            want = mxnet_reference(start, data, params)
            plain = mxnet_reference(start, data, None)
            for i, (got, ref, dense) in enumerate(zip(end, want, plain)):
                assert np.array_equal(got, ref), \
                    f"2bit {threshold}: tensor {i} max |diff| vs MXNet {np.abs(got - ref).max()}"
                assert not np.allclose(ref, dense, atol=1e-4), "the reference did not compress"
    say("2bit equals MXNet's KVStore 2bit bit for bit")


def topk_everything_is_uncompressed():
    data = batches(8)
    start, end, _, _ = distributed({"type": "topk", "ratio": 1.0}, data, bias=True)
    if hvd_trainer.rank() == 0:
        net = make_net(bias=True)
        net.initialize()
        load(net, start)
        trainer = gluon.Trainer(net.collect_params(), "sgd", dict(SGD))
        for x, y in data:
            backward(net, x, y, [mx.cpu()])
            trainer.step(x.shape[0])
        for i, (got, want) in enumerate(zip(end, weights(net))):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"tensor {i}")
    say("topk ratio 1 equals uncompressed training")


class Int8(GatherCompressor):
    """The user compressor of docs/compression.md's example."""

    def __init__(self, step=1e-3):
        self.step = np.float32(step)

    def encode(self, grad, residual):
        residual += grad
        q = np.clip(np.rint(residual / self.step), -127, 127).astype(np.int8)
        residual -= q * self.step
        return q.view(np.uint8)

    def decode_add(self, payload, out):
        out += payload.view(np.int8) * self.step

    def wire_bytes(self, size):
        return size


def every_type_same_on_all_ranks():
    for params in ({"type": "1bit", "threshold": 0.0}, {"type": "topk", "ratio": 0.01},
                   {"type": "scaled_2bit"}, {"type": "fp16"}, {"type": "2bit", "min_size": 0},
                   {"type": "powersgd", "rank": 2, "start_iter": 2}, None):
        kwargs = {"compression": Int8()} if params is None else None
        start, end, trainer, _ = distributed(params, batches(9), bias=True,
                                             trainer_kwargs=kwargs)
        same_on_all_ranks(end, str(params))
        assert any(not np.array_equal(a, b) for a, b in zip(start, end)), f"{params}: no update"
        if params is None:  # 1 byte per element of the two weights, by allgather
            n = hvd_trainer.size()
            assert trainer.communication_stats.bytes_sent >= (n - 1) * (1280 + 1024)
    say("1bit, topk, scaled_2bit, fp16, 2bit with biases, powersgd, a user's compressor: "
        "identical weights on every rank")


def resume_keeps_residuals(directory, params):
    data = batches(10)
    _, _, trainer, net = distributed(params, data[:3])
    fname = os.path.join(directory, f"{params['type']}.checkpoint")
    trainer.save_checkpoint(fname)
    middle = weights(net)
    for x, y in data[3:]:
        backward(net, mine(x), mine(y), [mx.cpu()])
        trainer.step(PER_RANK)
    uninterrupted = weights(net)
    net2 = make_net()
    net2.initialize()
    load(net2, middle)
    trainer2 = hvd_trainer.DistributedTrainer(net2.collect_params(), "sgd", dict(SGD),
                                              compression_params=params)
    trainer2.load_checkpoint(fname)
    for x, y in data[3:]:
        backward(net2, mine(x), mine(y), [mx.cpu()])
        trainer2.step(PER_RANK)
    for i, (a, b) in enumerate(zip(weights(net2), uninterrupted)):
        assert np.array_equal(a, b), f"{params}: resumed run differs in tensor {i}"
    say(f"{params}: save_checkpoint / load_checkpoint keep every rank's state")


def stats_count_bytes():
    n = hvd_trainer.size()
    _, _, trainer, net = distributed({"type": "2bit", "threshold": 0.05}, batches(11)[:1],
                                     bias=True)
    sizes = [p.data().size for p in net.collect_params().values()]
    packed = sum(4 * math.ceil(s / 16) for s in sizes if s >= 1024)
    ring = 2 * (n - 1) / n
    dense = sum(4 * s for s in sizes if s < 1024)
    stats = trainer.communication_stats
    assert abs(stats.bytes_sent - ((n - 1) * packed + ring * dense)) <= 1, stats
    assert stats.bytes_received == stats.bytes_sent, stats
    assert abs(stats.dense_bytes - ring * 4 * sum(sizes)) <= 2, stats
    assert stats.encode_seconds > 0 and stats.decode_seconds > 0, stats
    say("communication_stats count allgather and ring bytes")


def summing_hook(calls, bucket):
    """A user's comm hook: the bucket summed by hvd_trainer.allreduce_ in place."""
    calls.append(bucket.index)
    hvd_trainer.allreduce_(bucket.buffer, op=hvd_trainer.Sum, name=f"user.{bucket.index}",
                           prescale_factor=bucket.prescale, process_set=bucket.process_set)
    return hooks.done(bucket.buffer)


def user_comm_hook_sums_like_the_builtin_one():
    data = batches(12)
    calls = []
    _, plain, _, _ = distributed(None, data, bias=True)
    mx.random.seed(100 + hvd_trainer.rank())
    net = make_net(True)
    net.initialize(mx.init.Xavier())
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", dict(SGD),
                                             prefix="hooked.")
    trainer.register_comm_hook(calls, summing_hook)
    for x, y in data:
        backward(net, mine(x), mine(y), [mx.cpu()])
        trainer.step(PER_RANK)
    for i, (a, b) in enumerate(zip(weights(net), plain)):
        assert np.array_equal(a, b), f"comm hook: tensor {i} differs from the built-in sum"
    assert len(calls) == STEPS and set(calls) == {0}, calls
    say("a user's comm hook sums like the built-in one")


if __name__ == "__main__":
    run_cases({"equals_mxnet_2bit": equals_mxnet_2bit,
               "topk_everything_is_uncompressed": topk_everything_is_uncompressed,
               "every_type_same_on_all_ranks": every_type_same_on_all_ranks,
               "resume_keeps_residuals": lambda: resume_keeps_residuals(
                   sys.argv[1], {"type": "2bit", "threshold": 0.02}),
               "resume_keeps_powersgd_state": lambda: resume_keeps_residuals(
                   sys.argv[1], {"type": "powersgd", "rank": 2, "start_iter": 1}),
               "stats_count_bytes": stats_count_bytes,
               "user_comm_hook_sums_like_the_builtin_one":
                   user_comm_hook_sums_like_the_builtin_one},
              rank=hvd_trainer.rank(), selected=sys.argv[2:])
