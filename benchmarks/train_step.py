"""Training-step time, memory and overhead: gluon.Trainer in one process vs DistributedTrainer.

Run:  python benchmarks/train_step.py [--rounds 2] [--threads 1] [--buckets]
      python benchmarks/train_step.py --against REV [--rounds 3]
      python benchmarks/train_step.py --autotune [--rounds 2]
It launches its own measurements as subprocesses. Per model, launches alternate between one
process with gluon.Trainer and 2 ranks (through hvdrun) with DistributedTrainer with the
overlap on and off (HVD_OVERLAP), each at the same per-rank batch, so that machine noise hits
all alike; every launch keeps its best repetition and the table keeps each variant's best
launch. Scaling efficiency is t_single / t_2ranks (1.0 = perfect). Each launch also reports
its peak RSS (the largest over the ranks), against the target single + 1.2 x gradient bytes.

Plugin overhead: on 2 ranks, 100 gradients (50 x Dense(64)) already computed, the time of
``trainer.allreduce_grads()`` minus the time of the same buckets' bare ``allreduce`` calls on
the same communicator (the wire time), alternating, median of the repetitions; the bytes that
fusion copies per step are counted by wrapping ``fusion.pack`` and ``fusion.unpack``.

``--buckets`` adds the 2-rank step time at several HVD_BUCKET_THRESHOLD values. A last table
prices the safety checks on the 40 x Dense(256) step, on 2 ranks in one job: repetitions
alternate between the real step and the same step with the agreement replaced by the bare
exchange of freshness flags that the step needs anyway (no description, no digest, blocking
allreduce), and the timeline hooks (off) are counted and timed per call.

``--against REV`` instead compares this tree's 2-rank step with commit REV's, overlap off and
on, and the same for hvd_trainer.torch's DistributedOptimizer on torch_ddp.py's models (its
step reduces during backward whatever HVD_OVERLAP says, so once): a detached worktree of REV
is imported through PYTHONPATH, launches alternate between the two trees, and each variant
keeps its best launch.

``--autotune`` instead compares, per model, the 2-rank step with HVD_AUTOTUNE=1 (timed after
its tuning steps, which are reported apart) against every fixed setting of its grid (bucket
threshold x overlap); launches alternate between all of them, each keeps its best launch.
"""
import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# name: (input width, layer width, layers, timed steps per repetition)
MODELS = {"40 x Dense(256)": (64, 256, 40, 30), "8 x Dense(2048)": (2048, 2048, 8, 4)}
BATCH, WARMUP, REPETITIONS = 64, 3, 3
HOROVOD = {"40 x Dense(256)": 0.45, "8 x Dense(2048)": 0.56}  # Horovod 0.28.1, same kind of machine
# (label, ranks, extra environment) of the step table's columns
VARIANTS = [("1 process", 1, {}), ("overlap on", 2, {"HVD_OVERLAP": "1"}),
            ("overlap off", 2, {"HVD_OVERLAP": "0"}), ("2 independent", 2, {})]
BUCKET_THRESHOLDS_MIB = [1, 4, 16, 64]
# HVD_AUTOTUNE_WARMUP_SAMPLES, HVD_AUTOTUNE_STEPS_PER_SAMPLE per model: Horovod's defaults for
# the small model; fewer for the large one, whose 110 default steps would take half a minute.
AUTOTUNE_SAMPLES = {"40 x Dense(256)": (3, 10), "8 x Dense(2048)": (1, 5)}


def mlp(inputs: int, width: int, layers: int, head: bool = True):
    """A hybridized MLP of ``layers`` Dense(width, relu) layers (and a Dense(10) head)."""
    import mxnet as mx
    from mxnet import gluon
    net = gluon.nn.HybridSequential()
    for i in range(layers):
        net.add(gluon.nn.Dense(width, activation="relu", in_units=inputs if i == 0 else width))
    if head:
        net.add(gluon.nn.Dense(10, in_units=width))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def measure(distributed: bool, name: str, independent: bool = False) -> dict:
    """Seconds per training step of one model, best of the repetitions, and peak RSS.

    ``independent``: every rank trains alone with gluon.Trainer (no communication), timed
    together: what sharing the machine's cores and memory bus alone costs each rank.
    """
    import mxnet as mx
    import numpy as np
    from mxnet import gluon
    if distributed:
        import hvd_trainer

    inputs, width, layers, steps = MODELS[name]
    net = mlp(inputs, width, layers)
    args = (net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})
    trainer = (hvd_trainer.DistributedTrainer(*args) if distributed and not independent
               else gluon.Trainer(*args))
    x = mx.nd.random.uniform(shape=(BATCH, inputs))
    y = mx.nd.array(np.random.randint(0, 10, BATCH))
    step = common.training_step(net, trainer, x, y)

    tuned = {}
    tuner = trainer._reducer.autotuner if distributed and not independent else None
    if tuner is not None:  # the tuning steps, timed apart; then the chosen setting is timed
        import hvd_trainer
        hvd_trainer.barrier()
        start = time.perf_counter()
        for _ in range(tuner.last_step + 1):
            step()
        mx.nd.waitall()
        tuned = {"tuning_seconds": common.slowest_rank(time.perf_counter() - start, True),
                 "tuning_steps": tuner.last_step + 1, "chosen": list(tuner.chosen)}
    seconds = common.seconds_per_step(step, steps, REPETITIONS, WARMUP, distributed)
    grads = [p.grad() for p in net.collect_params().values()]
    results = {"seconds": seconds, **tuned, "tensors": len(grads), "rss_mb": common.peak_rss_mb(distributed),
               "megabytes": sum(g.size * 4 for g in grads) / 1e6,
               "file": hvd_trainer.__file__ if distributed else None}
    if distributed and not independent:
        results["wire"] = bare_allreduce(trainer)
    return results


def buckets_of(trainer) -> list:
    """The trainer's gradient buckets: its reducer's, or (commits before the reducer, for
    ``--against``) its own."""
    reducer = getattr(trainer, "_reducer", None)
    return reducer.buckets if reducer is not None else trainer._buckets


def bare_allreduce(trainer) -> float:
    """Best seconds of allreducing the trainer's buckets with nothing else running."""
    import hvd_trainer
    try:
        from hvd_trainer.runtime import runtime
    except ImportError:  # --against a commit from before the core's subpackages
        from hvd_trainer import runtime
    comm = runtime.communicator(hvd_trainer.global_process_set)
    best = float("inf")
    for _ in range(REPETITIONS * 2):
        hvd_trainer.barrier()
        start = time.perf_counter()
        for bucket in buckets_of(trainer):
            comm.allreduce(bucket.host, "sum")
        best = min(best, common.slowest_rank(time.perf_counter() - start, True))
    return best


OVERHEAD_LAYERS, OVERHEAD_ROUNDS = 50, 40


def measure_overhead() -> dict:
    """allreduce_grads() minus the bare allreduce of its buckets, overlap on and off (2 ranks)."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd
    import hvd_trainer
    from hvd_trainer.collectives import fusion
    from hvd_trainer.runtime import runtime

    net = mlp(64, 64, OVERHEAD_LAYERS, head=False)
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    comm = runtime.communicator(hvd_trainer.global_process_set)
    x = mx.nd.random.uniform(shape=(BATCH, 64))
    copied = []
    real_pack, real_unpack = fusion.pack, fusion.unpack

    def counting(real):
        def wrapper(a, b, *rest):
            copied.append(sum(t.nbytes for t in (a if isinstance(a, (list, tuple)) else b)))
            return real(a, b, *rest)
        return wrapper

    def backward():
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        mx.nd.waitall()

    times = {"on": [], "off": [], "wire": []}
    for rounds in range(OVERHEAD_ROUNDS + 3):
        for variant in ("on", "off"):
            trainer._reducer.overlap = variant == "on"
            backward()
            hvd_trainer.barrier()
            start = time.perf_counter()
            fusion.pack, fusion.unpack = counting(real_pack), counting(real_unpack)
            trainer.allreduce_grads()
            fusion.pack, fusion.unpack = real_pack, real_unpack
            plugin = time.perf_counter() - start
            hvd_trainer.barrier()
            start = time.perf_counter()
            for bucket in trainer._reducer.buckets:
                comm.allreduce(bucket.host, "sum")
            wire = time.perf_counter() - start
            trainer.update(BATCH)
            if rounds >= 3:  # the first rounds lay out the buckets and warm up
                times[variant].append(common.slowest_rank(plugin - wire, True))
                times["wire"].append(common.slowest_rank(wire, True))
    grads = [p.grad() for p in net.collect_params().values()]
    return {"on": float(np.median(times["on"])), "off": float(np.median(times["off"])),
            "wire": float(np.median(times["wire"])), "tensors": len(grads),
            "buckets": len(trainer._reducer.buckets), "copied_per_step": sum(copied) / (2 * (OVERHEAD_ROUNDS + 3)),
            "megabytes": sum(g.size * 4 for g in grads) / 1e6}


# Many short alternating repetitions: on a shared machine the ratio of neighbouring on/off
# repetitions is steadier than either side's best.
CHECKS_MODEL, CHECKS_ROUNDS, CHECKS_STEPS = "40 x Dense(256)", 30, 10


def exchange_only(comm, describe, flags=None):  # same signature as agreement.agree
    """agreement.agree without the checks: just or the freshness flags (when given)."""
    from hvd_trainer.coordination import records
    from hvd_trainer.runtime import timeline
    if flags is None or comm.size == 1:
        return flags
    words = records.pack_flags(flags)
    comm.allreduce(words, "bor")
    return records.unpack_flags(words, len(flags))


def measure_checks() -> dict:
    """ms/step with the agreement on and off, alternating; timeline hook calls per step and
    their cost while the timeline is off (run on 2 ranks)."""
    import mxnet as mx
    import numpy as np
    import hvd_trainer
    from hvd_trainer.coordination import agreement
    from hvd_trainer.runtime import runtime, timeline

    inputs, width, layers, _ = MODELS[CHECKS_MODEL]
    net = mlp(inputs, width, layers)
    trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd",
                                             {"learning_rate": 0.01, "momentum": 0.9})
    x = mx.nd.random.uniform(shape=(BATCH, inputs))
    y = mx.nd.array(np.random.randint(0, 10, BATCH))
    step = common.training_step(net, trainer, x, y)

    checked = agreement.agree
    times = {"on": [], "off": []}
    for _ in range(WARMUP):
        step()
    for _ in range(CHECKS_ROUNDS):
        for variant in times:
            agreement.agree = checked if variant == "on" else exchange_only
            hvd_trainer.barrier()
            mx.nd.waitall()
            start = time.perf_counter()
            for _ in range(CHECKS_STEPS):
                step()
            mx.nd.waitall()
            elapsed = (time.perf_counter() - start) / CHECKS_STEPS
            times[variant].append(float(hvd_trainer.allreduce(np.array([elapsed]),
                                                              op=hvd_trainer.Max)[0]))
    agreement.agree = checked
    # The step's agreement alone, the same two ways, in a tight loop: robust to machine noise.
    comm = runtime.communicator(hvd_trainer.global_process_set)
    flags = np.ones(len(trainer._params), bool)
    exchange = {"on": [], "off": []}
    for _ in range(CHECKS_ROUNDS):
        for variant, agree in (("on", checked), ("off", exchange_only)):
            hvd_trainer.barrier()
            start = time.perf_counter()
            for _ in range(200):
                agree(comm, trainer._reducer.description, flags)
            exchange[variant].append(float(hvd_trainer.allreduce(
                np.array([(time.perf_counter() - start) / 200]), op=hvd_trainer.Max)[0]))
    # Timeline hooks: how many span() calls a step makes, and what one costs while off.
    real_span, calls = timeline.span, []
    timeline.span = lambda *a: calls.append(a) or real_span(*a)
    step()
    timeline.span = real_span
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(100000):
        with timeline.span("grad.0", "WAIT_FOR_GRADIENT"):
            pass
    span_seconds = (time.perf_counter() - start) / 100000
    return {"on": times["on"], "off": times["off"], "span_calls": len(calls),
            "span_seconds": span_seconds, "exchange_on": min(exchange["on"]),
            "exchange_off": min(exchange["off"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches of each variant, alternating (default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every process (default 1: one core per worker)")
    parser.add_argument("--buckets", action="store_true",
                        help="also time the 2-rank step at several bucket thresholds")
    parser.add_argument("--against", metavar="REV",
                        help="compare this tree's 2-rank step with commit REV's instead")
    parser.add_argument("--autotune", action="store_true",
                        help="compare the autotuned 2-rank step with every fixed setting instead")
    parser.add_argument("--worker", choices=["single", "distributed", "independent", "overhead",
                                             "checks"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.model)
        return
    if args.against:
        compare(args.against, args.rounds, args.threads)
        return
    if args.autotune:
        compare_autotune(args.rounds, args.threads)
        return

    best = {name: {} for name in MODELS}
    for _ in range(args.rounds):
        for name in MODELS:
            for label, ranks, env in VARIANTS:
                mode = ("single" if ranks == 1 else
                        "independent" if label == "2 independent" else "distributed")
                r = common.launch(__file__, ranks, ["--worker", mode, "--model", name],
                                  args.threads, env)
                if label not in best[name] or r["seconds"] < best[name][label]["seconds"]:
                    best[name][label] = r
    print(common.header(f"train step, batch {BATCH} per rank, SGD momentum",
                        f"OMP_NUM_THREADS={args.threads}, best of {args.rounds} launches x "
                        f"{REPETITIONS} repetitions"))
    print("| model | tensors | gradients MB | 1 process ms/step | 2 ranks, overlap on | "
          "efficiency | 2 ranks, overlap off | efficiency | Horovod 0.28.1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        one, on, off, _ = (best[name][label] for label, _, _ in VARIANTS)
        print(f"| {name} | {one['tensors']} | {one['megabytes']:.1f} | "
              f"{one['seconds'] * 1e3:.1f} | {on['seconds'] * 1e3:.1f} | "
              f"{one['seconds'] / on['seconds']:.2f} | {off['seconds'] * 1e3:.1f} | "
              f"{one['seconds'] / off['seconds']:.2f} | {HOROVOD[name]:.2f} |")
    print("\n# what 2 ranks on this machine can reach: the step of 2 independent processes (no "
          "communication) plus the bare allreduce of the gradient buckets")
    print("| model | 2 independent ms/step | efficiency ceiling without communication | bare "
          "allreduce ms | ceiling with communication not overlapped |")
    print("|---|---|---|---|---|")
    for name in MODELS:
        one, _, off, alone = (best[name][label] for label, _, _ in VARIANTS)
        print(f"| {name} | {alone['seconds'] * 1e3:.1f} | "
              f"{one['seconds'] / alone['seconds']:.2f} | {off['wire'] * 1e3:.1f} | "
              f"{one['seconds'] / (alone['seconds'] + off['wire']):.2f} |")
    print("\n# peak RSS per process, MB (the largest rank, in each variant's fastest launch)")
    print("| model | gradients MB | 1 process | 2 independent (MPI loaded, gluon.Trainer) | "
          "2 ranks, overlap on | 2 ranks, overlap off | target: 1 process + 1.2 x gradients | "
          "met |")
    print("|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        one, on, off, alone = (best[name][label] for label, _, _ in VARIANTS)
        target = one["rss_mb"] + 1.2 * one["megabytes"]
        print(f"| {name} | {one['megabytes']:.1f} | {one['rss_mb']:.0f} | {alone['rss_mb']:.0f} | "
              f"{on['rss_mb']:.0f} | {off['rss_mb']:.0f} | {target:.0f} | "
              f"{'yes' if max(on['rss_mb'], off['rss_mb']) <= target else 'no'} |")
    r = common.launch(__file__, 2, ["--worker", "overhead"], args.threads)
    print(f"\n# plugin overhead, 2 ranks, {r['tensors']} gradients ({r['megabytes']:.2f} MB) "
          f"in {r['buckets']} bucket(s), median of {OVERHEAD_ROUNDS} repetitions")
    print(f"allreduce_grads() minus the bare allreduce of its buckets ({r['wire'] * 1e3:.3f} ms):"
          f" overlap on {r['on'] * 1e3:.3f} ms, overlap off {r['off'] * 1e3:.3f} ms; "
          f"bytes copied by fusion per step: {r['copied_per_step']:.0f}")
    if args.buckets:
        print_buckets(args.threads)
    print_checks(common.launch(__file__, 2, ["--worker", "checks"], args.threads))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare(rev: str, rounds: int, threads: int) -> None:
    """The 2-rank step of this tree against commit ``rev``'s, launches alternating."""
    best: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, rev)
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-f", old, rev],
                       check=True, capture_output=True)
        try:
            torch_script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "torch_ddp.py")
            variants = [(name, overlap, [__file__, ["--worker", "distributed", "--model", name]])
                        for name in MODELS for overlap in ("0", "1")]
            variants += [(f"torch {name}", "-", [torch_script, ["--worker", "hvd", name]])
                         for name in torch_models()]
            for _ in range(rounds):
                for name, overlap, (script, args) in variants:
                    for label, tree in (("before", old), ("after", REPO)):
                        env = {"PYTHONPATH": tree}
                        if overlap != "-":
                            env["HVD_OVERLAP"] = overlap
                        r = common.launch(script, 2, args, threads, env)
                        if not r["file"].startswith(tree):
                            raise RuntimeError(f"the worker imported {r['file']}, not {tree}")
                        key = (name, overlap, label)
                        best[key] = min(best.get(key, float("inf")), r["seconds"])
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old],
                           capture_output=True)
    print(f"# {datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, 2 ranks, "
          f"batch {BATCH} per rank, OMP_NUM_THREADS={threads}; before = {rev}, after = this "
          f"tree; launches alternate, best of {rounds} launches x {REPETITIONS} repetitions")
    print("| model | overlap | before ms/step | after ms/step | after / before |")
    print("|---|---|---|---|---|")
    for name, overlap, _ in variants:
        b, a = best[(name, overlap, "before")], best[(name, overlap, "after")]
        shown = {"1": "on", "0": "off"}.get(overlap, "-")
        print(f"| {name} | {shown} | {b * 1e3:.2f} | {a * 1e3:.2f} | {a / b:.3f} |")


def torch_models() -> list:
    """The models of torch_ddp.py (the torch step of ``--against``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_ddp
    return list(torch_ddp.MODELS)


def compare_autotune(rounds: int, threads: int) -> None:
    """Per model, the autotuned 2-rank step against each fixed setting, launches alternating."""
    fixed = [(t, o) for t in BUCKET_THRESHOLDS_MIB for o in ("0", "1")]
    best: dict = {}
    for _ in range(rounds):
        for name in MODELS:
            warmup, per_sample = AUTOTUNE_SAMPLES[name]
            variants = [((t, o), {"HVD_BUCKET_THRESHOLD": str(t << 20), "HVD_OVERLAP": o})
                        for t, o in fixed]
            variants.append(("autotune", {"HVD_AUTOTUNE": "1",
                                          "HVD_AUTOTUNE_WARMUP_SAMPLES": str(warmup),
                                          "HVD_AUTOTUNE_STEPS_PER_SAMPLE": str(per_sample)}))
            for label, env in variants:
                r = common.launch(__file__, 2, ["--worker", "distributed", "--model", name],
                                  threads, env)
                key = (name, label)
                if key not in best or r["seconds"] < best[key]["seconds"]:
                    best[key] = r
                if label == "autotune":
                    best.setdefault((name, "choices"), []).append(r["chosen"])

    def setting(t, o):
        return f"{t} MiB, overlap {'on' if o == '1' else 'off'}"
    print(common.header(f"autotuned vs fixed settings, 2 ranks, batch {BATCH} per rank",
                        f"OMP_NUM_THREADS={threads}, launches alternate, best of {rounds} "
                        f"launches x {REPETITIONS} repetitions"))
    print("| model | best fixed setting | best fixed ms/step | worst fixed ms/step | default "
          "(16 MiB, off) ms/step | autotuned ms/step | autotuned / best fixed | choices "
          "(each launch) | tuning steps, s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        times = {label: best[(name, label)]["seconds"] for label in fixed}
        fastest, slowest = min(times, key=times.get), max(times.values())
        tuned = best[(name, "autotune")]
        choices = "; ".join(setting(t >> 20, "1" if o else "0")
                            for t, o in best[(name, "choices")])
        print(f"| {name} | {setting(*fastest)} | {times[fastest] * 1e3:.1f} | "
              f"{slowest * 1e3:.1f} | {times[(16, '0')] * 1e3:.1f} | "
              f"{tuned['seconds'] * 1e3:.1f} | {tuned['seconds'] / times[fastest]:.3f} | "
              f"{choices} | {tuned['tuning_steps']}, {tuned['tuning_seconds']:.1f} |")


def run_worker(mode: str, model: str) -> None:
    """Measure in this process (one of the launched workers) and report on rank 0."""
    if mode == "single":
        common.report(measure(False, model))
        return
    import hvd_trainer
    results = {"distributed": lambda: measure(True, model),
               "independent": lambda: measure(True, model, independent=True),
               "overhead": measure_overhead,
               "checks": measure_checks}[mode]()
    if hvd_trainer.rank() == 0:
        common.report(results)


def print_buckets(threads: int) -> None:
    """2-rank step time per bucket threshold, overlap on, one launch per model and value."""
    print(f"\n# 2-rank step ms by HVD_BUCKET_THRESHOLD (best of {REPETITIONS} repetitions)")
    print("| model | overlap | " + " | ".join(f"{t} MiB" for t in BUCKET_THRESHOLDS_MIB) + " |")
    print("|---|---|" + "---|" * len(BUCKET_THRESHOLDS_MIB))
    for name in MODELS:
        for overlap in ("1", "0"):
            cells = [common.launch(__file__, 2, ["--worker", "distributed", "--model", name],
                                   threads, {"HVD_BUCKET_THRESHOLD": str(t << 20),
                                             "HVD_OVERLAP": overlap})["seconds"]
                     for t in BUCKET_THRESHOLDS_MIB]
            print(f"| {name} | {'on' if overlap == '1' else 'off'} | "
                  + " | ".join(f"{c * 1e3:.1f}" for c in cells) + " |")


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
