"""Slow link: the 2-rank training step across two hosts, compressed or not, as the link slows.

Run (as root):  python benchmarks/slow_link.py [--rounds 1] [--rates 1gbit,10gbit] [--delay-ms D]
It builds the 2-host test bed of tests/multihost/testbed.py (network namespaces joined by a
veth link, each host with its own sshd) and takes it down at the end. Per link setting (the
bare veth link, then tc tbf at each rate on both hosts' lan0, with netem delay D ms added
where the kernel has sch_netem) and per gradient bucket threshold (hvd_trainer's 16 MiB, and
64 MiB, Horovod's fusion buffer), one launch per framework on h1:1,h2:1
(--network-interface lan0, so that UCX does not spread the data over the unshaped lan1)
times the step of the 8 x Dense(2048) MLP: MXNet Gluon with DistributedTrainer, and the same
MLP in PyTorch with DistributedOptimizer; batch 64 per rank, SGD with momentum, one thread
per rank; no compression, fp16, 2-bit (threshold 0.5) and top-k 0.01, in the same launch.
Each time is the best repetition (the slowest rank's), the best over --rounds launches.

The crossover: per codec, t = a + b / rate through the two shaped rates (compute and codec
work plus bytes over the link), and the rate below which the codec's step beats the
uncompressed one.
"""
import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "multihost"))
from common import cpu_model, dense_mlp, hvdrun, report  # noqa: E402

CODECS = {"none": None, "fp16": {"type": "fp16"}, "2-bit": {"type": "2bit", "threshold": 0.5},
          "top-k 0.01": {"type": "topk", "ratio": 0.01}}
BUCKETS = {"16 MiB (ours)": 16 << 20, "64 MiB (Horovod's)": 64 << 20}
FRAMEWORKS = ("mxnet", "torch")
BATCH, WIDTH, LAYERS = 64, 2048, 8
WARMUP, REPETITIONS, STEPS = 1, 2, 2


def timed(step, distributed_max) -> float:
    """Best seconds per step over the repetitions, the slowest rank's."""
    for _ in range(WARMUP):
        step()
    best = float("inf")
    for _ in range(REPETITIONS):
        tic = time.perf_counter()
        for _ in range(STEPS):
            step()
        best = min(best, distributed_max((time.perf_counter() - tic) / STEPS))
    return best


def mxnet_steps() -> Dict[str, float]:
    """Seconds per step of the MXNet MLP, per codec (a rank of a 2-rank job)."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import hvd_trainer

    def slowest(value: float) -> float:
        mx.nd.waitall()
        return float(hvd_trainer.allreduce(np.array([value]), op=hvd_trainer.Max)[0])

    results = {}
    for name, params in CODECS.items():
        net = dense_mlp(LAYERS, WIDTH)
        trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd",
                                                 {"learning_rate": 0.01, "momentum": 0.9},
                                                 compression_params=params, prefix=name)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        x = mx.nd.random.uniform(shape=(BATCH, WIDTH))
        y = mx.nd.array(np.random.RandomState(0).randint(0, 10, BATCH))

        def step():
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(BATCH)
            mx.nd.waitall()

        hvd_trainer.barrier()
        results[name] = timed(step, slowest)
        del net, trainer
    return results


def torch_steps() -> Dict[str, float]:
    """Seconds per step of the PyTorch MLP, per codec (a rank of a 2-rank job)."""
    import torch

    import hvd_trainer.torch as hvd
    from hvd_trainer import compression

    torch.set_num_threads(1)
    hvd.init()

    def slowest(value: float) -> float:
        return hvd.allreduce(torch.tensor([value]), op=hvd.Max).item()

    results = {}
    for name, params in CODECS.items():
        torch.manual_seed(0)
        layers = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
        codec = (hvd.Compression.none if params is None else hvd.Compression.fp16
                 if params["type"] == "fp16" else compression.from_params(params))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{name}.{n}", p) for n, p in net.named_parameters()],
            compression=codec)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        x, y = torch.rand(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))

        def step():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()

        hvd.barrier()
        results[name] = timed(step, slowest)
        del net, optimizer
    return results


def bits_per_second(rate: str) -> float:
    """tc's rate ('1gbit', '500mbit', '100kbit') in bits per second."""
    number, unit = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower()).groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def shape(bed, rate: Optional[str], delay_ms: float) -> None:
    """Shape both hosts' lan0 going out: tbf at ``rate`` (None: bare link), then netem delay."""
    for host in bed.hosts:
        netns = bed.netns(host)
        subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", "lan0", "root"],
                       capture_output=True)
        if rate is None:
            continue
        burst = max(int(bits_per_second(rate) / 8 / 250), 256 << 10)  # 4 ms of traffic, and over a GSO packet
        subprocess.run(["tc", "-n", netns, "qdisc", "add", "dev", "lan0", "root", "handle", "1:",
                        "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"], check=True)
        if delay_ms:
            delay = subprocess.run(["tc", "-n", netns, "qdisc", "add", "dev", "lan0", "parent",
                                    "1:1", "handle", "10:", "netem", "delay", f"{delay_ms}ms"],
                                   capture_output=True, text=True)
            if delay.returncode:
                raise SystemExit(f"slow_link: netem delay failed ({delay.stderr.strip()}): this "
                                 "kernel has no sch_netem; run without --delay-ms")


@contextlib.contextmanager
def two_hosts(who: str) -> Iterator:
    """A 2-host test bed (tests/multihost/testbed.py), taken down and its folder removed at
    the end; SystemExit, naming ``who`` and the reason, where none can be built here."""
    import testbed
    reason = testbed.unavailable()
    if reason:
        raise SystemExit(f"{who}: {reason}")
    bed = testbed.up(2, tied=True)
    try:
        yield bed
    finally:
        bed.down()
        shutil.rmtree(bed.folder, ignore_errors=True)


def bed_result(bed, hvdrun_args: List[str], script: str, worker_args: List[str],
               variables: Dict[str, str], what: str) -> dict:
    """Launch ``script --worker worker_args`` with hvdrun ``hvdrun_args`` from h1 of ``bed``
    (one thread per rank, over lan0) and return the RESULT its rank 0 printed."""
    command = [*hvdrun(variables.get("PYTHONPATH")), *hvdrun_args,
               "--network-interface", "lan0", "--no-prefix", sys.executable,
               os.path.abspath(script), "--worker", *worker_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **variables)
    out = bed.run("h1", command, cwd=bed.shared, env=env, capture_output=True, text=True,
                  timeout=1800)
    found = re.search(r"RESULT (\{.*\})", out.stdout)
    if out.returncode or not found:
        raise RuntimeError(f"{what} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return json.loads(found[1])


def launch(bed, framework: str, bucket: int) -> Dict[str, float]:
    """One 2-rank launch across h1 and h2; the seconds per step rank 0 reports, per codec."""
    return bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__, [framework],
                      {"HVD_BUCKET_THRESHOLD": str(bucket)}, f"{framework} launch")


def crossover(codec: Dict[str, float], base: Dict[str, float], rates: List[str]) -> str:
    """Where ``codec`` beats ``base`` (seconds per step at each of two ``rates``), from
    t = a + b / rate through both: a is the work that does not depend on the link, b / rate
    the time on the link."""
    slow, fast = (bits_per_second(rate) for rate in rates)

    def fit(times):
        b = (times[rates[0]] - times[rates[1]]) / (1 / slow - 1 / fast)
        return times[rates[0]] - b / slow, b
    (a_codec, b_codec), (a_base, b_base) = fit(codec), fit(base)
    extra, saved = a_codec - a_base, b_base - b_codec  # the codec pays when extra * rate < saved
    if extra <= 0:
        return "always" if saved >= 0 else f"above {saved / extra / 1e9:.1f} Gbit/s"
    return f"below {saved / extra / 1e9:.1f} Gbit/s" if saved > 0 else "never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="launches per setting (best kept)")
    parser.add_argument("--rates", default="1gbit,10gbit", help="tbf rates, slow first")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="netem delay on each host")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        results = mxnet_steps() if args.worker == "mxnet" else torch_steps()
        import hvd_trainer
        if hvd_trainer.rank() == 0:
            report(results)
        return

    rates = args.rates.split(",")
    links = ["bare veth"] + rates
    times: Dict[tuple, Dict[str, float]] = {}
    with two_hosts("slow_link") as bed:
        if args.delay_ms:  # fail before measuring, where the kernel has no netem
            shape(bed, rates[0], args.delay_ms)
        for _ in range(args.rounds):
            for link in links:
                shape(bed, None if link == "bare veth" else link, args.delay_ms)
                for bucket_name, bucket in BUCKETS.items():
                    for framework in FRAMEWORKS:
                        got = launch(bed, framework, bucket)
                        key = (link, bucket_name, framework)
                        times[key] = {codec: min(got[codec], times.get(key, got)[codec])
                                      for codec in CODECS}
                        print(f"# {key}: " + ", ".join(f"{c} {t * 1e3:.0f} ms"
                                                       for c, t in times[key].items()),
                              file=sys.stderr, flush=True)

    from mpi4py import MPI
    delay = f", netem delay {args.delay_ms:g} ms each way" if args.delay_ms else ""
    print(f"# slow link: {datetime.date.today()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"{MPI.Get_library_version().splitlines()[0].strip()}, 2 ranks on 2 test-bed hosts"
          f"{delay}, step ms (vs none)")
    print("| link | bucket | framework | " + " | ".join(CODECS) + " |")
    print("|---|---|---|" + "---|" * len(CODECS))
    for (link, bucket, framework), row in times.items():
        base = row["none"]
        cells = [f"{row['none'] * 1e3:.0f}"] + [f"{row[c] * 1e3:.0f} ({row[c] / base:.2f})"
                                               for c in list(CODECS)[1:]]
        print(f"| {link} | {bucket} | {framework} | " + " | ".join(cells) + " |")
    print("\n| bucket | framework | " + " | ".join(list(CODECS)[1:]) + " |")
    print("|---|---|" + "---|" * (len(CODECS) - 1))
    for bucket in BUCKETS:
        for framework in FRAMEWORKS:
            per_rate = {codec: {r: times[r, bucket, framework][codec] for r in rates[:2]}
                        for codec in CODECS}
            cells = [crossover(per_rate[c], per_rate["none"], rates[:2])
                     for c in list(CODECS)[1:]]
            print(f"| {bucket} | {framework} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
