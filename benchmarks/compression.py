"""Gradient compression: codec speed, bytes on the wire, 2-rank step time, threshold choice.

Run:  python benchmarks/compression.py [--rounds 2]
In one run, per compressor:
- encode + decode throughput in GB/s of float32 input, one core, on 33.6 M elements (the
  8 x Dense(2048) MLP's 134 MB of gradients), best of 5;
- wire bytes per rank relative to a float32 ring allreduce on 2 ranks;
- the 2-rank training step of that MLP (batch 64 per rank, SGD with momentum) against
  uncompressed, every compressor in the same launches, best repetition of the best launch;
- the 2-bit threshold study: a 20-feature, 4-class softmax task (generated, 4000 training
  rows), MLP with 64 hidden units, summed per-sample losses, SGD lr 0.1, batch 32 per rank,
  10 epochs: test accuracy per threshold, MXNet's own KVStore 2-bit (one process, two
  contexts) next to ours (2 ranks), compressing every tensor as MXNet does ('min_size': 0)
  and by default (the 256-weight output layer and the biases then go uncompressed).
"""
import argparse
import datetime
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_model, dense_mlp, launch, report  # noqa: E402

from hvd_trainer import compression  # noqa: E402

CODECS = {"fp16": {"type": "fp16"}, "2bit": {"type": "2bit", "threshold": 0.5},
          "scaled_2bit": {"type": "scaled_2bit"}, "1bit": {"type": "1bit", "threshold": 0.0},
          "topk 0.01": {"type": "topk", "ratio": 0.01}}
ELEMENTS = 33_574_922  # 8 x Dense(2048) on 2048 inputs plus Dense(10): its gradient elements
THRESHOLDS = [0.5, 0.1, 0.05, 0.01]
STEP_WARMUP, STEP_REPS, STEPS = 2, 3, 3


def codec_speed(params: dict, grad: np.ndarray) -> dict:
    """Best-of-5 encode and decode seconds of one tensor, and the wire bytes."""
    codec = compression.from_params(params)
    best_enc = best_dec = float("inf")
    for _ in range(5):
        if codec is compression.Compression.fp16:
            tic = time.perf_counter()
            payload, ctx = codec.compress(grad)
            mid = time.perf_counter()
            codec.decompress(payload, ctx)
            wire = 2 * (2 - 1) / 2 * payload.nbytes  # ring on 2 ranks
        else:
            residual = np.zeros_like(grad)
            out = np.empty_like(grad)
            tic = time.perf_counter()
            payload = codec.encode(grad, residual)
            mid = time.perf_counter()
            out[...] = 0
            codec.decode_add(payload, out)
            wire = (2 - 1) * payload.nbytes  # allgather on 2 ranks
        best_enc = min(best_enc, mid - tic)
        best_dec = min(best_dec, time.perf_counter() - mid)
    return {"encode": best_enc, "decode": best_dec, "wire": wire / (2 * (2 - 1) / 2 * grad.nbytes)}


def step_times() -> dict:
    """Seconds per training step of the 8 x Dense(2048) MLP, per compressor (2-rank worker)."""
    import mxnet as mx
    from mxnet import autograd, gluon

    import hvd_trainer

    results = {}
    for name, params in [("none", None)] + list(CODECS.items()):
        net = dense_mlp()
        trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd",
                                                 {"learning_rate": 0.01, "momentum": 0.9},
                                                 compression_params=params, prefix=name)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        x = mx.nd.random.uniform(shape=(64, 2048))
        y = mx.nd.array(np.random.RandomState(0).randint(0, 10, 64))

        def step():
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(64)

        for _ in range(STEP_WARMUP):
            step()
        mx.nd.waitall()
        best = float("inf")
        for _ in range(STEP_REPS):
            hvd_trainer.barrier()
            tic = time.perf_counter()
            for _ in range(STEPS):
                step()
            mx.nd.waitall()
            elapsed = np.array([(time.perf_counter() - tic) / STEPS])
            best = min(best, float(hvd_trainer.allreduce(elapsed, op=hvd_trainer.Max)[0]))
        stats = trainer.communication_stats
        results[name] = {"seconds": best, "sent": stats.bytes_sent, "dense": stats.dense_bytes}
        del net, trainer
    return results


def threshold_task():
    """The generated 20-feature, 4-class task: (train x, train y, test x, test y)."""
    from sklearn.datasets import make_classification
    x, y = make_classification(n_samples=6000, n_features=20, n_informative=12, n_redundant=2,
                               n_classes=4, n_clusters_per_class=1, class_sep=1.5,
                               random_state=0)
    x, y = x.astype(np.float32), y.astype(np.float32)
    return x[:4000], y[:4000], x[4000:], y[4000:]


def threshold_accuracy(params, distributed: bool) -> float:
    """Test accuracy after 10 epochs; ``distributed``: this rank's half of each batch through
    DistributedTrainer, else two contexts in one process through MXNet's KVStore."""
    import mxnet as mx
    from mxnet import autograd, gluon

    x_train, y_train, x_test, y_test = threshold_task()
    mx.random.seed(0)
    ctxs = [mx.cpu()] if distributed else [mx.cpu(0), mx.cpu(1)]
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, activation="relu", in_units=20), gluon.nn.Dense(4, in_units=64))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    kwargs = {} if params is None else {"compression_params": params}
    if distributed:
        import hvd_trainer
        trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd",
                                                 {"learning_rate": 0.1}, prefix=str(params),
                                                 **kwargs)
        halves = [hvd_trainer.rank()]
    else:
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore="device", update_on_kvstore=False, **kwargs)
        halves = [0, 1]
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)
    for _ in range(10):
        order = rng.permutation(len(x_train))
        for i in range(0, len(order), 64):
            batch = order[i:i + 64]
            with autograd.record():
                losses = [loss_fn(net(mx.nd.array(x_train[batch[h::2]], ctx=c)),
                                  mx.nd.array(y_train[batch[h::2]], ctx=c))
                          for h, c in zip(halves, ctxs)]
            autograd.backward(losses)
            trainer.step(len(batch) // (1 if not distributed else 2))
    out = net(mx.nd.array(x_test, ctx=ctxs[0])).argmax(axis=1).asnumpy()
    return float((out == y_test).mean())


def threshold_cases():
    return ([("none", None)] + [(f"2bit {t}", {"type": "2bit", "threshold": t})
                                for t in THRESHOLDS] + [("scaled_2bit", {"type": "scaled_2bit"})])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="2-rank launches (default 2)")
    parser.add_argument("--worker", choices=["steps", "thresholds"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import hvd_trainer
        if args.worker == "steps":
            results = step_times()
        else:
            results = {}
            for name, p in threshold_cases():
                results[name] = threshold_accuracy(p, True)
                if p is not None:
                    results[f"{name} all"] = threshold_accuracy(dict(p, min_size=0), True)
        if hvd_trainer.rank() == 0:
            report(results)
        return

    grad = np.random.RandomState(0).randn(ELEMENTS).astype(np.float32) * 0.5
    speed = {name: codec_speed(params, grad) for name, params in CODECS.items()}
    steps = None
    for _ in range(args.rounds):
        got = launch(__file__, 2, ["--worker", "steps"])
        steps = got if steps is None else {k: min(steps[k], got[k], key=lambda r: r["seconds"])
                                           for k in got}
    ours = launch(__file__, 2, ["--worker", "thresholds"])
    mxnet = {name: threshold_accuracy(p, False) for name, p in threshold_cases()
             if name != "scaled_2bit"}  # not an MXNet type

    print(f"# compression: {datetime.date.today()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"OMP_NUM_THREADS=1, codec on {ELEMENTS / 1e6:.1f} M float32, 2 ranks")
    print("| compressor | encode GB/s | decode GB/s | encode+decode GB/s | wire / fp32 allreduce "
          "| 2-rank step ms | vs uncompressed |")
    print("|---|---|---|---|---|---|---|")
    base = steps["none"]["seconds"]
    print(f"| none | - | - | - | 1 | {base * 1e3:.1f} | 1.00 |")
    gb = grad.nbytes / 1e9
    for name, s in speed.items():
        t = steps[name]["seconds"]
        print(f"| {name} | {gb / s['encode']:.2f} | {gb / s['decode']:.2f} | "
              f"{gb / (s['encode'] + s['decode']):.2f} | 1/{1 / s['wire']:.1f} | "
              f"{t * 1e3:.1f} | {base / t:.2f} |")
    print("\n# 2-bit threshold study: test accuracy after 10 epochs")
    print("| compression_params | MXNet KVStore, 2 contexts | hvd_trainer 2 ranks, 'min_size': 0 "
          "| hvd_trainer 2 ranks, default min_size |")
    print("|---|---|---|---|")
    for name, _ in threshold_cases():
        theirs = f"{mxnet[name]:.4f}" if name in mxnet else "-"
        every = f"{ours[name + ' all']:.4f}" if name + " all" in ours else "-"
        print(f"| {name} | {theirs} | {every} | {ours[name]:.4f} |")


if __name__ == "__main__":
    main()
