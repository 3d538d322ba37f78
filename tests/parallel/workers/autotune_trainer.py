"""Autotuning DistributedTrainer (HVD_AUTOTUNE=1, small samples) against one gluon.Trainer.

Through every switch of bucket threshold and overlap the weights must track one process on
the global batch; at every step all ranks must use the same setting; after the samples every
rank must use the fastest candidate of rank 0's log, and the log must hold one row per sample.
argv[1]: the log path (HVD_AUTOTUNE_LOG, set by the test).
"""
import csv
import sys

import mxnet as mx
from mxnet import gluon

import hvd_trainer
from case_runner import run_cases
from hvd_trainer.runtime import runtime
from trainer_common import (IN, OUT, close, first_context, forward_backward, global_batches,
                            my_rows, reference, same_on_all_ranks, seed_per_rank, snapshot)

WIDE = 640  # a 640x640 float32 weight is 1.6 MB: 1 MiB and 4 MiB buckets lay out differently
PER_RANK, AFTER = 4, 3
OPTIMIZER, PARAMS = "sgd", {"learning_rate": 0.05, "momentum": 0.9}


def make_net() -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(WIDE, activation="tanh", in_units=IN),
            gluon.nn.Dense(WIDE, activation="tanh", in_units=WIDE),
            gluon.nn.Dense(WIDE, activation="tanh", in_units=WIDE),
            gluon.nn.Dense(OUT, in_units=WIDE))
    return net


def autotuned_training(log_path):
    seed_per_rank()
    net = make_net()
    net.initialize(mx.init.Xavier())
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), OPTIMIZER, dict(PARAMS))
    tuner = trainer._reducer.autotuner
    assert tuner is not None, "HVD_AUTOTUNE=1 but the reducer has no autotuner"
    steps = tuner.last_step + 1 + AFTER
    batches = global_batches(steps, PER_RANK * hvd_trainer.size())
    layouts = set()
    for step, (x, y) in enumerate(batches):
        forward_backward(net, my_rows(x), my_rows(y), [mx.cpu()])
        if step == 0:
            start = first_context(net)
        trainer.step(PER_RANK)
        # The setting the next step uses: the same on every rank.
        reducer = trainer._reducer
        mine = (reducer.bucket_threshold, reducer.overlap, len(reducer.buckets))
        every = hvd_trainer.allgather_object(mine)
        assert all(s == every[0] for s in every), f"step {step}: ranks differ: {every}"
        layouts.add(len(reducer.buckets))
    assert len(layouts) > 1, f"the autotuner never changed the bucket layout: {layouts}"
    same_on_all_ranks(snapshot(net), "weights after autotuning")
    final = (trainer._reducer.bucket_threshold, trainer._reducer.overlap)
    if hvd_trainer.rank() == 0:
        with open(log_path) as f:
            rows = list(csv.DictReader(f))
        samples = [r for r in rows if r["kind"] in ("warmup", "candidate")]
        assert len(samples) == len(tuner.samples), rows
        assert [int(r["sample"]) for r in samples] == list(range(len(tuner.samples)))
        assert all(int(r["steps"]) == tuner.steps_per_sample for r in samples)
        candidates = [r for r in samples if r["kind"] == "candidate"]
        fastest = min(candidates, key=lambda r: float(r["mean_seconds_per_step"]))
        want = (int(fastest["bucket_threshold"]), bool(int(fastest["overlap"])))
        assert final == want, f"rank 0 uses {final}, its log's fastest sample is {want}"
        chosen = [r for r in rows if r["kind"] == "chosen"]
        assert len(chosen) == 1 and (int(chosen[0]["bucket_threshold"]),
                                     bool(int(chosen[0]["overlap"]))) == want
        thresholds = {int(r["bucket_threshold"]) for r in candidates}
        overlaps = {r["overlap"] for r in candidates}
        assert thresholds == {1 << 20, 4 << 20, 16 << 20, 64 << 20}, thresholds
        assert len(overlaps) == (2 if runtime.mpi_threads_supported() else 1), overlaps
        want_weights = reference(make_net, start, OPTIMIZER, dict(PARAMS), batches)
        worst = close(first_context(net), want_weights, 1e-5, 1e-5, "autotuned training")
        print(f"autotune: {len(samples)} samples, chosen {final}, layouts {sorted(layouts)}, "
              f"max |diff| vs single process {worst:.2g}", flush=True)


def main():
    run_cases({"autotuned_training": lambda: autotuned_training(sys.argv[1])},
              rank=hvd_trainer.rank(), selected=sys.argv[2:])


if __name__ == "__main__":
    main()
