"""Training-step time: plain gluon.Trainer in one process vs DistributedTrainer on 2 ranks.

Run:  python benchmarks/train_step.py [--rounds 2] [--threads 1]
It launches its own measurements as subprocesses, alternating one process with gluon.Trainer
and 2 ranks (through hvdrun) with DistributedTrainer, each at the same per-rank batch, so
that machine noise hits both alike; every launch keeps its best repetition and the table
keeps each side's best launch. Scaling efficiency is t_single / t_2ranks (1.0 = perfect).

A second table prices the safety checks on the 40 x Dense(256) step, on 2 ranks in one job:
repetitions alternate between the real step and the same step with the agreement replaced by
the bare exchange of freshness flags that the step needs anyway (no description, no digest,
blocking allreduce), and the timeline hooks (off) are counted and timed per call.
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


# Many short alternating repetitions: on a shared machine the ratio of neighbouring on/off
# repetitions is steadier than either side's best.
CHECKS_MODEL, CHECKS_ROUNDS, CHECKS_STEPS = "40 x Dense(256)", 30, 10


def exchange_only(comm, describe, flags=None):  # same signature as diagnostics.agree
    """diagnostics.agree without the checks: just or the freshness flags (when given)."""
    from hvd_trainer import diagnostics
    if flags is None or comm.size == 1:
        return flags
    words = diagnostics.pack_flags(flags)
    comm.allreduce(words, "bor")
    return diagnostics.unpack_flags(words, len(flags))


def measure_checks() -> dict:
    """ms/step with the agreement on and off, alternating; timeline hook calls per step and
    their cost while the timeline is off (run on 2 ranks)."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon
    import hvd_trainer
    from hvd_trainer import diagnostics, runtime

    inputs, width, layers, _ = MODELS[CHECKS_MODEL]
    net = gluon.nn.HybridSequential()
    for i in range(layers):
        net.add(gluon.nn.Dense(width, activation="relu", in_units=inputs if i == 0 else width))
    net.add(gluon.nn.Dense(10, in_units=width))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd",
                                             {"learning_rate": 0.01, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.random.uniform(shape=(BATCH, inputs))
    y = mx.nd.array(np.random.randint(0, 10, BATCH))

    def step():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH)

    checked = diagnostics.agree
    times = {"on": [], "off": []}
    for _ in range(WARMUP):
        step()
    for _ in range(CHECKS_ROUNDS):
        for variant in times:
            diagnostics.agree = checked if variant == "on" else exchange_only
            hvd_trainer.barrier()
            mx.nd.waitall()
            start = time.perf_counter()
            for _ in range(CHECKS_STEPS):
                step()
            mx.nd.waitall()
            elapsed = (time.perf_counter() - start) / CHECKS_STEPS
            times[variant].append(float(hvd_trainer.allreduce(np.array([elapsed]),
                                                              op=hvd_trainer.Max)[0]))
    diagnostics.agree = checked
    # The step's agreement alone, the same two ways, in a tight loop: robust to machine noise.
    comm = runtime.communicator(hvd_trainer.global_process_set)
    indices = list(range(len(trainer._params)))
    flags = np.ones(len(indices), bool)
    exchange = {"on": [], "off": []}
    for _ in range(CHECKS_ROUNDS):
        for variant, agree in (("on", checked), ("off", exchange_only)):
            hvd_trainer.barrier()
            start = time.perf_counter()
            for _ in range(200):
                agree(comm, lambda: trainer._step_description(indices), flags)
            exchange[variant].append(float(hvd_trainer.allreduce(
                np.array([(time.perf_counter() - start) / 200]), op=hvd_trainer.Max)[0]))
    # Timeline hooks: how many span() calls a step makes, and what one costs while off.
    real_span, calls = diagnostics.span, []
    diagnostics.span = lambda *a: calls.append(a) or real_span(*a)
    step()
    diagnostics.span = real_span
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(100000):
        with diagnostics.span("grad.0", "WAIT_FOR_GRADIENT"):
            pass
    span_seconds = (time.perf_counter() - start) / 100000
    return {"on": times["on"], "off": times["off"], "span_calls": len(calls),
            "span_seconds": span_seconds, "exchange_on": min(exchange["on"]),
            "exchange_off": min(exchange["off"])}


def launch_worker(mode: str, threads: int) -> dict:
    """Run one measurement (``--worker mode``) in fresh processes; return rank 0's results.

    "single" runs one plain process, the others 2 ranks through hvdrun.
    """
    worker = [sys.executable, os.path.abspath(__file__), "--worker", mode]
    cmd = ([sys.executable, "-m", "hvd_trainer_launch.hvdrun", "-np", "2"] + worker
           if mode != "single" else worker)
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
    parser.add_argument("--worker", choices=["single", "distributed", "checks"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        results = measure_checks() if args.worker == "checks" else measure(args.worker == "distributed")
        if args.worker == "single" or __import__("hvd_trainer").rank() == 0:
            print("RESULT " + json.dumps(results), flush=True)
        return

    best = {"single": {}, "distributed": {}}
    for _ in range(args.rounds):
        for side in best:
            for name, r in launch_worker(side, args.threads).items():
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
    print_checks(launch_worker("checks", args.threads))


def print_checks(r: dict) -> None:
    """The agreement-on/off and timeline-hook table of measure_checks()."""
    def median(values):
        return sorted(values)[len(values) // 2]

    on, off = min(r["on"]), min(r["off"])
    paired = median([a / b for a, b in zip(r["on"], r["off"])])
    hooks = r["span_calls"] * r["span_seconds"]
    print(f"\n# safety checks, {CHECKS_MODEL}, 2 ranks, {len(r['on'])} alternating "
          f"repetitions of {CHECKS_STEPS} steps")
    print("| variant | best ms/step | median ms/step |")
    print("|---|---|---|")
    print(f"| agreement on (shipped) | {on * 1e3:.2f} | {median(r['on']) * 1e3:.2f} |")
    print(f"| agreement off (flags exchange only) | {off * 1e3:.2f} | {median(r['off']) * 1e3:.2f} |")
    print(f"agreement cost: best on/off {(on / off - 1) * 100:+.2f}%, median of neighbouring "
          f"on/off ratios {(paired - 1) * 100:+.2f}%")
    extra = r["exchange_on"] - r["exchange_off"]
    print(f"the step's agreement alone: {r['exchange_on'] * 1e6:.1f} us with checks, "
          f"{r['exchange_off'] * 1e6:.1f} us flags only: {extra * 1e6:+.1f} us/step "
          f"({extra / on * 100:.2f}% of the best step)")
    print(f"timeline off: {r['span_calls']} hook calls/step x {r['span_seconds'] * 1e6:.2f} us = "
          f"{hooks * 1e6:.1f} us/step ({hooks / on * 100:.2f}% of the best step)")
    print(f"agreement + timeline hooks, isolated: {(extra + hooks) / on * 100:.2f}% of the best step")


if __name__ == "__main__":
    main()
