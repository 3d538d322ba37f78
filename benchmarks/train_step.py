"""Training-step time: plain gluon.Trainer in one process vs DistributedTrainer on 2 ranks.

Run:  python benchmarks/train_step.py [--rounds 2] [--threads 1]
It launches its own measurements as subprocesses, alternating one process with gluon.Trainer
and 2 ranks (through hvdrun) with DistributedTrainer, each at the same per-rank batch, so
that machine noise hits both alike; every launch keeps its best repetition and the table
keeps each side's best launch. Scaling efficiency is t_single / t_2ranks (1.0 = perfect).
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

# name: (input width, layer width, layers, timed steps per repetition)
MODELS = {"40 x Dense(256)": (64, 256, 40, 30), "8 x Dense(2048)": (2048, 2048, 8, 4)}
BATCH, WARMUP, REPETITIONS = 64, 3, 3
HOROVOD = {"40 x Dense(256)": 0.45, "8 x Dense(2048)": 0.56}  # Horovod 0.28.1, same kind of machine


def measure(distributed: bool) -> dict:
    """Seconds per training step of each model, best of the repetitions (run in a worker)."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon
    if distributed:
        import hvd_trainer

    results = {}
    for name, (inputs, width, layers, steps) in MODELS.items():
        net = gluon.nn.HybridSequential()
        for i in range(layers):
            net.add(gluon.nn.Dense(width, activation="relu", in_units=inputs if i == 0 else width))
        net.add(gluon.nn.Dense(10, in_units=width))
        net.initialize(mx.init.Xavier())
        net.hybridize()
        args = (net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})
        trainer = hvd_trainer.DistributedTrainer(*args) if distributed else gluon.Trainer(*args)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        x = mx.nd.random.uniform(shape=(BATCH, inputs))
        y = mx.nd.array(np.random.randint(0, 10, BATCH))

        def step():
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(BATCH)

        for _ in range(WARMUP):
            step()
        mx.nd.waitall()
        best = float("inf")
        for _ in range(REPETITIONS):
            if distributed:
                hvd_trainer.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            mx.nd.waitall()
            elapsed = (time.perf_counter() - start) / steps
            if distributed:  # the slowest rank sets the pace
                elapsed = float(hvd_trainer.allreduce(np.array([elapsed]), op=hvd_trainer.Max)[0])
            best = min(best, elapsed)
        grads = [p.grad() for p in net.collect_params().values()]
        results[name] = {"seconds": best, "tensors": len(grads),
                         "megabytes": sum(g.size * 4 for g in grads) / 1e6}
    return results


def launch(distributed: bool, threads: int) -> dict:
    """Run one measurement in fresh processes and return rank 0's results."""
    worker = [sys.executable, os.path.abspath(__file__), "--worker",
              "distributed" if distributed else "single"]
    cmd = ([sys.executable, "-m", "hvd_trainer_launch.hvdrun", "-np", "2"] + worker
           if distributed else worker)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    found = re.search(r"RESULT (\{.*\})", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return json.loads(found.group(1))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches of each side, alternating (default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every process (default 1: one core per worker)")
    parser.add_argument("--worker", choices=["single", "distributed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        results = measure(args.worker == "distributed")
        if args.worker == "single" or __import__("hvd_trainer").rank() == 0:
            print("RESULT " + json.dumps(results), flush=True)
        return

    best = {"single": {}, "distributed": {}}
    for _ in range(args.rounds):
        for side in best:
            for name, r in launch(side == "distributed", args.threads).items():
                if name not in best[side] or r["seconds"] < best[side][name]["seconds"]:
                    best[side][name] = r
    print(f"# train step, batch {BATCH} per rank, SGD momentum: {datetime.date.today()}, "
          f"{os.cpu_count()} cores ({cpu_model()}), OMP_NUM_THREADS={args.threads}, "
          f"best of {args.rounds} launches x {REPETITIONS} repetitions")
    print("| model | tensors | gradients MB | 1 process ms/step | 2 ranks ms/step | "
          "efficiency t_1/t_2 | Horovod 0.28.1 |")
    print("|---|---|---|---|---|---|---|")
    for name in MODELS:
        one, two = best["single"][name], best["distributed"][name]
        print(f"| {name} | {one['tensors']} | {one['megabytes']:.1f} | "
              f"{one['seconds'] * 1e3:.1f} | {two['seconds'] * 1e3:.1f} | "
              f"{one['seconds'] / two['seconds']:.2f} | "
              f"{HOROVOD[name]:.2f} |")


if __name__ == "__main__":
    main()
