"""DistributedTrainer features beyond plain equivalence, each against an independent reference.

- two trainers with different prefixes in one process;
- a parameter used on one rank only (stale elsewhere): no hang, and its gradient is the fresh
  rank's gradient over the global batch; a parameter used nowhere is left to ignore_stale_grad;
- save_states / load_states: a resumed run continues exactly like an uninterrupted one;
- broadcast_parameters on a dict of NDArrays and on a ParameterDict with deferred shapes.
Run with the pytest temporary directory as the first argument (then, optionally, case names);
each case reports on its own (case_runner.py).
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer
from case_runner import run_cases
from trainer_common import (IN, OUT, close, first_context, forward_backward, global_batches, load,
                            loss_fn, make_net, my_rows, params, reference, same_on_all_ranks,
                            seed_per_rank, snapshot)

PER_RANK = 4
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}


def say(message):
    if hvd_trainer.rank() == 0:
        print(message, flush=True)


def two_prefixes():
    """Two models trained side by side, each by its own trainer, match their references."""
    batches_a = global_batches(4, PER_RANK * hvd_trainer.size(), seed=1)
    batches_b = global_batches(4, PER_RANK * hvd_trainer.size(), seed=2)
    seed_per_rank()
    nets = [make_net(), make_net(deferred=True)]
    for net in nets:
        net.initialize(mx.init.Xavier())
    trainers = [
        hvd_trainer.DistributedTrainer(nets[0].collect_params(), "sgd", dict(SGD), prefix="a."),
        hvd_trainer.DistributedTrainer(nets[1].collect_params(), "adam", {"learning_rate": 0.01},
                                       prefix="b.")]
    starts = []
    for step, batch_pair in enumerate(zip(batches_a, batches_b)):
        for net, trainer, (x, y) in zip(nets, trainers, batch_pair):
            forward_backward(net, my_rows(x), my_rows(y), [mx.cpu()])
            if step == 0:
                starts.append(first_context(net))
            trainer.step(PER_RANK)
    for net in nets:
        same_on_all_ranks(snapshot(net), "two prefixes")
    if hvd_trainer.rank() == 0:
        close(first_context(nets[0]), reference(make_net, starts[0], "sgd", dict(SGD), batches_a),
              1e-5, 1e-5, "prefix a.")
        close(first_context(nets[1]), reference(make_net, starts[1], "adam",
                                                {"learning_rate": 0.01}, batches_b),
              1e-5, 1e-5, "prefix b.")
    say("two trainers with different prefixes")


class Heads(gluon.Block):
    """A trunk and three heads: 'shared' used by every rank, 'only' by rank 1, 'unused' by none."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.trunk = gluon.nn.Dense(8, activation="tanh", in_units=IN)
            self.shared = gluon.nn.Dense(OUT, in_units=8)
            self.only = gluon.nn.Dense(OUT, in_units=8)
            self.unused = gluon.nn.Dense(OUT, in_units=8)

    def loss(self, x, y, only_rows):
        """Summed loss of the shared head on all rows plus the 'only' head on ``only_rows``."""
        h = self.trunk(x)
        total = loss_fn(self.shared(h), y).sum()
        if only_rows is not None:
            total = total + loss_fn(self.only(h[only_rows[0]:only_rows[1]]),
                                    y[only_rows[0]:only_rows[1]]).sum()
        return total


def stale_gradients():
    """At step s only rank (s + 1) % size uses 'only'; 'unused' is stale everywhere.

    The other ranks are stale for 'only', some holding an old gradient from an earlier step.
    Expected: 'only' moves by the fresh rank's gradient divided by the global batch (what one
    process computes when 'only' sees just that rank's rows), old gradients never mixed in;
    'unused' never moves with ignore_stale_grad=True and makes every rank raise without it.
    """
    size, rank = hvd_trainer.size(), hvd_trainer.rank()
    batches = global_batches(3, PER_RANK * size, seed=3)
    seed_per_rank()
    net = Heads()
    net.initialize(mx.init.Xavier())
    unused_before = net.unused.weight.data().asnumpy()
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", dict(SGD),
                                             prefix="stale.")
    for step, (x, y) in enumerate(batches):
        with autograd.record():
            loss = net.loss(mx.nd.array(my_rows(x)), mx.nd.array(my_rows(y)),
                            (0, PER_RANK) if rank == (step + 1) % size else None)
        loss.backward()
        if step == 0:
            start = first_context(net)
            unused_start = net.unused.weight.data().asnumpy()
        trainer.step(PER_RANK, ignore_stale_grad=True)
    same_on_all_ranks(snapshot(net), "stale gradients")
    assert np.array_equal(net.unused.weight.data().asnumpy(), unused_start), \
        "a parameter fresh on no rank was updated"
    assert not np.array_equal(unused_start, unused_before) or rank == 0, \
        "the broadcast did not reach the unused head"
    with autograd.record():
        loss = net.loss(mx.nd.array(my_rows(x)), mx.nd.array(my_rows(y)), None)
    loss.backward()
    try:
        trainer.step(PER_RANK)
    except UserWarning as e:
        assert "has not been updated by backward" in str(e), e
    else:
        raise AssertionError("step() without ignore_stale_grad accepted a gradient fresh nowhere")
    if rank == 0:
        ref = Heads()
        ref.initialize()
        load(ref, start)
        ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", dict(SGD))
        for step, (x, y) in enumerate(batches):
            fresh_rank = (step + 1) % size
            with autograd.record():
                loss = ref.loss(mx.nd.array(x), mx.nd.array(y),
                                (fresh_rank * PER_RANK, (fresh_rank + 1) * PER_RANK))
            loss.backward()
            ref_trainer.step(x.shape[0], ignore_stale_grad=True)
        close(first_context(net), first_context(ref), 1e-5, 1e-5, "stale gradients")
    say("parameter fresh on one rank per step; parameter fresh nowhere")


def save_and_resume(directory):
    """Train 2 steps, save, train 2 more; a fresh trainer loading the file redoes the last 2."""
    fname = os.path.join(directory, "trainer.states")
    batches = global_batches(4, PER_RANK * hvd_trainer.size(), seed=4)

    def make_trainer(net):
        scheduler = mx.lr_scheduler.FactorScheduler(step=1, factor=0.9, base_lr=0.01)
        return hvd_trainer.DistributedTrainer(net.collect_params(), "adam",
                                              {"learning_rate": 0.01, "lr_scheduler": scheduler},
                                              prefix="resume.")

    def train(net, trainer, part):
        for x, y in part:
            forward_backward(net, my_rows(x), my_rows(y), [mx.cpu()])
            trainer.step(PER_RANK)

    seed_per_rank()
    net = make_net()
    net.initialize(mx.init.Xavier())
    trainer = make_trainer(net)
    train(net, trainer, batches[:2])
    middle = first_context(net)
    trainer.save_states(fname)
    assert os.path.exists(fname), f"rank {hvd_trainer.rank()} returned before {fname} existed"
    train(net, trainer, batches[2:])
    uninterrupted = first_context(net)

    mx.random.seed(7 + hvd_trainer.rank())
    resumed = make_net()
    resumed.initialize(mx.init.Xavier())
    if hvd_trainer.rank() == 0:
        load(resumed, middle)  # the trainer's broadcast carries rank 0's weights to the others
    resumed_trainer = make_trainer(resumed)
    resumed_trainer.load_states(fname)
    same_on_all_ranks([s.asnumpy() for s in resumed_trainer._updaters[0].states[0]],
                      "Adam state after load_states")
    train(resumed, resumed_trainer, batches[2:])
    close(first_context(resumed), uninterrupted, 0, 0, "resumed run")
    leftovers = [f for f in os.listdir(directory) if f != "trainer.states"]
    assert not leftovers, f"save_states left {leftovers} behind"
    say("save_states / load_states resume exactly")


def broadcast_dicts():
    """Every rank ends with rank 0's values, deferred parameters once the forward sets them."""
    seed_per_rank()
    arrays = {"b": mx.nd.random.uniform(shape=(3, 2)), "a": mx.nd.random.uniform(shape=(5,))}
    mine = {k: v.asnumpy() for k, v in arrays.items()}
    hvd_trainer.broadcast_parameters(arrays, root_rank=0, prefix="arrays.")
    net = make_net(deferred=True)
    net.initialize(mx.init.Xavier(), ctx=[mx.cpu(0), mx.cpu(1)])
    hvd_trainer.broadcast_parameters(net.collect_params(), root_rank=0, prefix="net.")
    net(mx.nd.ones((2, IN), ctx=mx.cpu(1)))
    theirs = hvd_trainer.broadcast_object(
        (mine, first_context(net)) if hvd_trainer.rank() == 0 else None, 0)
    for k, v in arrays.items():
        assert np.array_equal(v.asnumpy(), theirs[0][k]), f"array {k!r} differs from rank 0's"
    for p, want in zip(params(net), theirs[1]):
        for d in p.list_data():
            assert np.array_equal(d.asnumpy(), want), f"{p.name} differs from rank 0's"
    say("broadcast_parameters on NDArrays and on deferred Parameters over two contexts")


def main():
    run_cases({"broadcast_dicts": broadcast_dicts, "two_prefixes": two_prefixes,
               "stale_gradients": stale_gradients,
               "save_and_resume": lambda: save_and_resume(sys.argv[1])},
              rank=hvd_trainer.rank(), selected=sys.argv[2:])


if __name__ == "__main__":
    main()
