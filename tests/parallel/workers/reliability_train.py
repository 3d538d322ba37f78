"""Fault injection around DistributedTrainer; ``reliability_train.py CASE [DIR]``.

mismatch   nets built differently, a parameter missing from a step, a dtype differing: every
           rank raises the same MismatchError and the job carries on; a steady-state step
           makes one agreement exchange
exception  rank 1 raises at step 3 (uncaught)
timeline   train under HVD_TIMELINE, then stop and start the timeline at run time (DIR/late.json)
full       train STEPS steps; rank 0 saves the final weights to DIR/full.npy
crash      checkpoint after every step to DIR/checkpoint; rank 1 kills itself (SIGKILL) in step 5
resume     load DIR/checkpoint, train to STEPS; rank 0 saves the final weights to DIR/resumed.npy
"""
import os
import signal
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvd_trainer as hvd
from hvd_trainer.coordination import scheduler
from hvd_trainer.runtime import runtime
from trainer_common import IN, OUT, global_batches, loss_fn, my_rows, seed_per_rank

case = sys.argv[1]
folder = sys.argv[2] if len(sys.argv) > 2 else None
R, N = hvd.rank(), hvd.size()
STEPS = 8
SGD = ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3})


def built(hidden: int = 16, hidden_rank1: int = None) -> gluon.nn.HybridSequential:
    """Two dense layers; rank 1 gets another hidden width when asked."""
    net = gluon.nn.HybridSequential()
    if R == 1 and hidden_rank1 is not None:
        hidden = hidden_rank1
    net.add(gluon.nn.Dense(hidden, activation="tanh", in_units=IN), gluon.nn.Dense(OUT, in_units=hidden))
    net.initialize(mx.init.Xavier())
    return net


def step(net, trainer, s: int) -> None:
    x, y = global_batches(STEPS, 4 * N, seed=s)[s % STEPS]
    dtype = next(iter(net.collect_params().values())).dtype
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(my_rows(x), dtype=dtype)),
                       mx.nd.array(my_rows(y), dtype=dtype))
    loss.backward()
    trainer.step(x.shape[0])


def expect_mismatch(label: str, call, words) -> None:
    """``call`` raises MismatchError on this rank, with ``words`` and the same text on all."""
    try:
        call()
    except hvd.MismatchError as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f"{label}: {str(e)!r} lacks {missing}"
        assert len(set(hvd.allgather_object(str(e)))) == 1, f"{label}: messages differ"
        print(f"rank {R} {label}: MismatchError: {e}")
        return
    raise AssertionError(f"{label}: no MismatchError")


seed_per_rank()
if case == "mismatch":
    expect_mismatch("model shapes",
                    lambda: hvd.DistributedTrainer(built(hidden_rank1=17).collect_params(), *SGD),
                    ["broadcast", "shape", "rank 0: (16,)", "rank 1: (17,)"])
    net = built()
    trainer = hvd.DistributedTrainer(net.collect_params(), *SGD)
    step(net, trainer, 0)
    names = sorted(net.collect_params().keys())
    if R == 1:
        net.collect_params()[names[1]].grad_req = "null"
    expect_mismatch("tensor missing", lambda: step(net, trainer, 1),
                    ["trainer step 'step'", "number of tensors", "rank 0: 4, rank 1: 3",
                     "tensor 'grad.1' is missing on rank 1"])
    net.collect_params()[names[1]].grad_req = "write"
    step(net, trainer, 2)
    if R == 1:
        net.cast("float64")
    expect_mismatch("dtype", lambda: step(net, trainer, 3),
                    ["dtype of tensor 0 'grad.0'", "rank 0: '<f4'", "rank 1: '<f8'"])
    net.cast("float32")
    comm = runtime.communicator(hvd.global_process_set)
    for groups in (0, 2):
        net = built()
        trainer = hvd.DistributedTrainer(net.collect_params(), *SGD, num_groups=groups,
                                         prefix=f"g{groups}.")
        step(net, trainer, 0)
        before = scheduler.of(comm).exchanges
        for s in range(1, 4):
            step(net, trainer, s)
        made = scheduler.of(comm).exchanges - before
        assert made == 3, f"num_groups={groups}: {made} agreement exchanges in 3 steps"
    print(f"rank {R}: every mismatch raised on every rank; one agreement per step")
elif case == "exception":
    net = built()
    trainer = hvd.DistributedTrainer(net.collect_params(), *SGD)
    for s in range(1, STEPS + 1):
        if s == 3 and R == 1:
            raise RuntimeError("rank 1 fails at step 3")
        step(net, trainer, s)
elif case == "timeline":
    net = built()
    trainer = hvd.DistributedTrainer(net.collect_params(), *SGD,
                                     compression_params={"type": "fp16"})
    for s in range(3):
        step(net, trainer, s)
    hvd.stop_timeline()
    step(net, trainer, 3)
    hvd.start_timeline(os.path.join(folder, "late.json"))
    for s in range(4, 6):
        step(net, trainer, s)
    hvd.stop_timeline()
    print(f"rank {R}: timeline steps done")
elif case in ("full", "crash", "resume"):
    net = built(hidden=128)  # 1024 weights in the first layer: enough for 2-bit compression
    trainer = hvd.DistributedTrainer(net.collect_params(), *SGD,
                                     compression_params={"type": "2bit", "threshold": 0.05})
    path = os.path.join(folder, "checkpoint")
    done = trainer.load_checkpoint(path)["step"] if case == "resume" else 0
    for s in range(done + 1, STEPS + 1):
        if case == "crash" and s == 5 and R == 1:
            print(f"rank 1 kills itself in step 5 at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        step(net, trainer, s)
        if case == "crash":
            trainer.save_checkpoint(path, extra={"step": s})
    if R == 0:
        weights = np.concatenate([p.data().asnumpy().ravel() for p in net.collect_params().values()])
        np.save(os.path.join(folder, f"{case}.npy"), weights)
    print(f"rank {R}: {case} done after step {STEPS}")
else:
    raise SystemExit(f"unknown case {case!r}")
