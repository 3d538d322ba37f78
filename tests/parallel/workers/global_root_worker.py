"""Horovod's process-set semantics that rest on the core (issue 12): ``root_rank`` is a global
rank, and alltoall refuses splits that are not integers, with an MXNetError.

The set holds every rank but 0, and the root is the last rank, so a root read as an index
inside the set would be out of range or another rank. Each case reports on its own
(case_runner.py).
"""
import mxnet as mx
import numpy as np
from mxnet.base import MXNetError

import hvd_trainer.mxnet as hvd
from case_runner import run_cases
from trainer_common import first_context, make_net, seed_per_rank


def weights_after(make_trainer_or_broadcast, case):
    """Every rank's initial weights (before anything is broadcast) and its weights after."""
    seed_per_rank()
    net = make_net()
    net.initialize(mx.init.Xavier())
    initial = hvd.allgather_object(first_context(net), name=f"initial.{case}")
    make_trainer_or_broadcast(net)
    return initial, first_context(net)


def expect(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"rank {hvd.rank()}, {what}: tensor {i} differs"


def main():
    rank, size = hvd.rank(), hvd.size()
    members = list(range(1, size))
    root = size - 1
    ps = hvd.add_process_set(members)

    def collectives():
        if rank in members:
            got = hvd.broadcast(mx.nd.array([rank]), root_rank=root, process_set=ps, name="b")
            assert got.asscalar() == root, got
            assert hvd.broadcast_object(rank, root_rank=root, process_set=ps, name="o") == root

    def weights(case, what, source, make):
        initial, after = weights_after(make, case)
        expect(after, initial[source if rank in members else rank], what)

    def fractional_splits():
        for splits in ([0.5] * size, mx.nd.array([1.0] * size)):
            try:
                hvd.alltoall(mx.nd.ones((size, 2)), splits=splits, name="fractional")
            except MXNetError as e:
                assert isinstance(e, (ValueError, TypeError)) and "splits" in str(e), repr(e)
            else:
                raise AssertionError(f"alltoall accepted splits={splits}")

    run_cases({
        "broadcast_and_object_from_the_last_rank": collectives,
        "trainer_root_rank_last": lambda: weights(
            0, "DistributedTrainer(root_rank=last)", root,
            lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd",
                                               {"learning_rate": 0.1}, process_set=ps,
                                               root_rank=root, prefix="t.")),
        "trainer_default_root": lambda: weights(
            1, "DistributedTrainer, default root", members[0],
            lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd",
                                               {"learning_rate": 0.1}, process_set=ps,
                                               prefix="d.")),
        "broadcast_parameters_root_rank_last": lambda: weights(
            2, "broadcast_parameters(root_rank=last)", root,
            lambda net: hvd.broadcast_parameters(net.collect_params(), root_rank=root,
                                                 prefix="p.", process_set=ps)),
        "fractional_splits_refused": fractional_splits}, rank=rank)


if __name__ == "__main__":
    main()
