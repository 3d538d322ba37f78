"""N ranks with batch B calling step(B) == one process with batch N*B calling step(N*B).

Each case starts every rank from different random weights, trains a few steps with
DistributedTrainer, checks that the weights were identical on all ranks before the first
update and after the last, and compares them with a plain gluon.Trainer reference on rank 0.
Each case reports on its own (case_runner.py).
"""
import mxnet as mx

import hvd_trainer
from case_runner import run_cases
from trainer_common import (close, first_context, forward_backward, global_batches, make_net,
                            my_rows, reference, same_on_all_ranks, seed_per_rank, snapshot)

STEPS, PER_RANK = 5, 6


def halve_lr_at_3(step, trainer):
    if step == 2:
        trainer.set_learning_rate(trainer.learning_rate / 2)


CASES = [
    # name, optimizer, optimizer_params factory, options
    ("sgd momentum wd, deferred init, set_learning_rate", "sgd",
     lambda: {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
     dict(deferred=True, hook=halve_lr_at_3)),
    ("adam, num_groups=2", "adam",
     lambda: {"learning_rate": 0.01},
     dict(trainer_kwargs={"num_groups": 2})),
    ("clip_gradient with allreduce_grads() + update()", "sgd",
     lambda: {"learning_rate": 0.5, "clip_gradient": 0.02},
     dict(split=True)),
    ("lr_scheduler, gradient_predivide_factor=3, num_groups=3", "sgd",
     lambda: {"learning_rate": 0.2, "momentum": 0.5,
              "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.2)},
     dict(trainer_kwargs={"gradient_predivide_factor": 3.0, "num_groups": 3})),
    ("multi_precision float16 weights", "sgd",
     lambda: {"learning_rate": 0.1, "momentum": 0.9, "multi_precision": True},
     dict(dtype="float16", rtol=1e-2, atol=2e-3)),
    ("two contexts per process", "sgd",
     lambda: {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
     dict(ctxs=[mx.cpu(0), mx.cpu(1)], deferred=True)),
    ("fp16 compression via compression_params", "sgd",
     lambda: {"learning_rate": 0.1, "momentum": 0.9},
     dict(trainer_kwargs={"compression_params": {"type": "fp16"}}, rtol=1e-3, atol=1e-3)),
]


def run_case(index, name, optimizer, make_params, deferred=False, hook=None, split=False,
             dtype="float32", ctxs=(mx.cpu(),), trainer_kwargs=None, rtol=1e-5, atol=1e-5):
    batches = global_batches(STEPS, PER_RANK * hvd_trainer.size(), seed=index)
    seed_per_rank()
    net = make_net(deferred, dtype)
    net.initialize(mx.init.Xavier(), ctx=list(ctxs))
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), optimizer, make_params(),
                                 prefix=f"case{index}.", **(trainer_kwargs or {}))
    for step, (x, y) in enumerate(batches):
        forward_backward(net, my_rows(x), my_rows(y), ctxs, dtype)
        if step == 0:
            start = first_context(net)
            same_on_all_ranks(snapshot(net), f"{name}: weights before the first update")
        if split:
            trainer.allreduce_grads()
            trainer.update(PER_RANK)
        else:
            trainer.step(PER_RANK)
        if hook:
            hook(step, trainer)
    same_on_all_ranks(snapshot(net), f"{name}: weights after training")
    if hvd_trainer.rank() == 0:
        want = reference(lambda: make_net(False, dtype), start, optimizer, make_params(), batches,
                         hook, dtype, split)
        worst = close(first_context(net), want, rtol, atol, name)
        print(f"{name}: max |diff| vs single process {worst:.2g}", flush=True)


def case(index):
    name, optimizer, make_params, options = CASES[index]
    return lambda: run_case(index, name, optimizer, make_params, **options)


def main():
    run_cases({"sgd_momentum_wd_deferred_init_set_learning_rate": case(0),
               "adam_num_groups_2": case(1), "clip_gradient_allreduce_grads_update": case(2),
               "lr_scheduler_predivide_num_groups_3": case(3),
               "multi_precision_float16": case(4), "two_contexts_per_process": case(5),
               "fp16_compression_params": case(6)}, rank=hvd_trainer.rank())


if __name__ == "__main__":
    main()
