"""A DistributedTrainer and a DistributedOptimizer on a process set of all ranks but the last.

Members train together: their weights equal one process with a plain gluon.Trainer on the
members' global batch, from the set's first rank's initial weights. The last rank is outside
the set: as in Horovod, both do nothing there (no collectives), so its weights equal a plain
gluon.Trainer on its own rows from its own initial weights. broadcast_parameters on the set
leaves it alone too. save_checkpoint / load_checkpoint are collectives of the members (the
set's first rank writes, the others read through it) and local outside the set.
Run with the pytest temporary directory as the only argument.
"""
import os
import sys

import mxnet as mx
from mxnet import gluon

import hvd_trainer
import hvd_trainer.mxnet as hvd
from case_runner import run_cases
from trainer_common import close, first_context, forward_backward, global_batches, make_net, \
    reference, seed_per_rank

PER_RANK, STEPS = 4, 4
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}


def rows(array, index):
    return array[index * PER_RANK:(index + 1) * PER_RANK]


def run(case, make_trainer, ps, members, directory=None):
    rank = hvd.rank()
    member = rank in members
    batches = global_batches(STEPS, PER_RANK * len(members), seed=40 + case)
    own = [(rows(x, 0), rows(y, 0)) for x, y in global_batches(STEPS, PER_RANK, seed=50 + case)]
    seed_per_rank()
    net = make_net()
    net.initialize(mx.init.Xavier())
    initial = hvd.allgather_object(first_context(net), name=f"initial.{case}")
    trainer = make_trainer(net)
    for step in range(STEPS):
        if member:
            x, y = batches[step]
            index = members.index(rank)
            forward_backward(net, rows(x, index), rows(y, index), [mx.cpu()])
        else:
            forward_backward(net, *own[step], [mx.cpu()])
        trainer.step(PER_RANK)
    if member:
        want = reference(make_net, initial[members[0]], "sgd", dict(SGD), batches)
    else:
        want = reference(make_net, initial[rank], "sgd", dict(SGD), own)
    worst = close(first_context(net), want, 1e-5, 1e-5, f"case {case} on rank {rank}")
    print(f"rank {rank} ({'member' if member else 'outside the set'}) case {case}: "
          f"max |diff| {worst:.2g}", flush=True)
    if directory is not None:
        checkpoint_round_trip(net, trainer, make_trainer, directory, member, members)


def checkpoint_round_trip(net, trainer, make_trainer, directory, member, members):
    """A fresh net and trainer loading the checkpoint hold the saved weights; the members'
    file is written by the set's first rank only, the outsider's by itself."""
    rank = hvd.rank()
    fname = os.path.join(directory, "set.checkpoint" if member else f"own{rank}.checkpoint")
    trainer.save_checkpoint(fname, extra={"rank": rank})
    saved = first_context(net)
    fresh = make_net()
    fresh.initialize(mx.init.Uniform(5.0))
    extra = make_trainer(fresh).load_checkpoint(fname)
    writer = members[0] if member else rank
    assert extra == {"rank": writer}, (extra, writer)
    close(first_context(fresh), saved, 0, 0, f"rank {rank}: weights after load_checkpoint")


def main():
    size = hvd.size()
    members = list(range(size - 1))
    ps = hvd.add_process_set(members)

    def optimizer_trainer(net):
        hvd.broadcast_parameters(net.collect_params(), root_rank=0, process_set=ps)
        optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(**SGD), process_set=ps)
        return gluon.Trainer(net.collect_params(), optimizer, kvstore=None)

    def members_reduce_afterwards():
        """The set's members still reduce together afterwards; the last rank takes no part."""
        if hvd.rank() in members:
            total = hvd.allreduce(mx.nd.array([hvd.rank() + 1.0]), op=hvd.Sum, process_set=ps)
            assert total.asscalar() == sum(r + 1 for r in members), total
        hvd_trainer.barrier()

    run_cases({"distributed_trainer_and_checkpoints": lambda: run(
                   0, lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd", dict(SGD),
                                                         process_set=ps, prefix="ps."),
                   ps, members, sys.argv[1]),
               "distributed_optimizer": lambda: run(1, optimizer_trainer, ps, members),
               "members_reduce_afterwards": members_reduce_afterwards},
              rank=hvd.rank(), selected=sys.argv[2:])

if __name__ == "__main__":
    main()
