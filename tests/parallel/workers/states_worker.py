"""save_states / load_states are local (as in Gluon and Horovod), called mid-training.

- one rank alone saves (rank 0, Horovod's habit; then the last rank) while the others step
  on: no hang, no MismatchError, and the file resumes every rank exactly where the
  uninterrupted run went; a plain gluon.Trainer loading it on the global batch agrees;
- every rank saves to and loads from a folder of its own (Gluon's CheckpointHandler).
Run with the pytest temporary directory as the only argument.
"""
import os
import sys

import mxnet as mx
from mxnet import gluon

import hvd_trainer
from case_runner import run_cases
from trainer_common import (close, first_context, forward_backward, global_batches, load,
                            make_net, my_rows, seed_per_rank)

PER_RANK = 4


def make_trainer(net, prefix):
    scheduler = mx.lr_scheduler.FactorScheduler(step=1, factor=0.9, base_lr=0.01)
    return hvd_trainer.DistributedTrainer(net.collect_params(), "adam",
                                          {"learning_rate": 0.01, "lr_scheduler": scheduler},
                                          prefix=prefix)


def train(net, trainer, batches):
    for x, y in batches:
        forward_backward(net, my_rows(x), my_rows(y), [mx.cpu()])
        trainer.step(PER_RANK)


def resume(fname, middle, batches, prefix):
    """A fresh net and trainer at the saved weights, states loaded from ``fname``, trained on."""
    net = make_net()
    net.initialize()
    load(net, middle)
    trainer = make_trainer(net, prefix)
    trainer.load_states(fname)
    train(net, trainer, batches)
    return first_context(net)


def one_rank_saves(directory, saver):
    rank = hvd_trainer.rank()
    fname = os.path.join(directory, f"saved-by-{saver}.states")
    batches = global_batches(5, PER_RANK * hvd_trainer.size(), seed=20 + saver)
    seed_per_rank()
    net = make_net()
    net.initialize(mx.init.Xavier())
    trainer = make_trainer(net, f"solo{saver}.")
    train(net, trainer, batches[:2])
    middle = first_context(net)
    if rank == saver:
        trainer.save_states(fname)
        trainer.load_states(fname)  # also local: the others are already in the next step
    train(net, trainer, batches[2:])  # its collectives order the save before the reads below
    uninterrupted = first_context(net)
    assert os.path.exists(fname), f"rank {saver} did not write {fname}"
    close(resume(fname, middle, batches[2:], f"solo{saver}.r."), uninterrupted, 0, 0,
          f"resumed from rank {saver}'s file")
    if rank == 0:  # one process, plain Gluon, the global batch, from the same file
        ref = make_net()
        ref.initialize()
        load(ref, middle)
        ref_trainer = gluon.Trainer(ref.collect_params(), "adam", {"learning_rate": 0.01})
        ref_trainer.load_states(fname)
        for x, y in batches[2:]:
            forward_backward(ref, x, y, [mx.cpu()])
            ref_trainer.step(x.shape[0])
        close(first_context(ref), uninterrupted, 1e-5, 1e-5, "gluon.Trainer from the file")
        print(f"save_states on rank {saver} alone mid-training; load_states resumes exactly",
              flush=True)


def every_rank_own_path(directory):
    rank = hvd_trainer.rank()
    mine = os.path.join(directory, f"rank{rank}")
    os.makedirs(mine)
    fname = os.path.join(mine, "trainer.states")
    batches = global_batches(4, PER_RANK * hvd_trainer.size(), seed=30)
    seed_per_rank()
    net = make_net()
    net.initialize(mx.init.Xavier())
    trainer = make_trainer(net, "own.")
    train(net, trainer, batches[:2])
    middle = first_context(net)
    trainer.save_states(fname)
    assert os.listdir(mine) == ["trainer.states"], f"rank {rank}: {os.listdir(mine)}"
    train(net, trainer, batches[2:])
    close(resume(fname, middle, batches[2:], "own.r."), first_context(net), 0, 0,
          f"rank {rank} resumed from its own file")
    if rank == 0:
        print("every rank saves and loads its own path", flush=True)


def main():
    directory = sys.argv[1]
    run_cases({"first_rank_saves": lambda: one_rank_saves(directory, 0),
               "last_rank_saves": lambda: one_rank_saves(directory, hvd_trainer.size() - 1),
               "every_rank_own_path": lambda: every_rank_own_path(directory)},
              rank=hvd_trainer.rank(), selected=sys.argv[2:])


if __name__ == "__main__":
    main()
