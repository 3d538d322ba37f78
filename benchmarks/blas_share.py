"""numpy's BLAS threads on ranks that share a host: the torch step with PowerSGD (whose matrix
products run on numpy's OpenBLAS while backward runs) with OpenBLAS's own default, a thread per
core in every rank, against the share that hvdrun's rank wrapper gives each rank (the host's
cores over its ranks, when the user set no BLAS thread count).

Run:  python benchmarks/blas_share.py [--launches 4]

Each launch is ``hvdrun -np 2`` on this machine, with no OMP_NUM_THREADS, as a user's script
runs (the frameworks' OpenMP runtimes share the cores among MPI's local ranks on their own:
torch takes one thread here either way); the default is forced with OPENBLAS_NUM_THREADS set
to the core count. Launches alternate between the two settings so that both see the same
load; the step is the 8 x Linear(2048) MLP, batch 64, SGD with momentum, uncompressed and with
PowerSGD rank 4 (from step 2), median of 7 timed steps after 3, the slowest rank's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import header, hvdrun, report  # noqa: E402

CODECS = ("none", "powersgd")
WARMUP, TIMED = 3, 7
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def worker() -> None:
    """One rank: the median step of each codec, printed by rank 0."""
    import torch

    import hvd_trainer.torch as hvd

    hvd.init()
    results = {"torch threads": torch.get_num_threads(),
               "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}
    for codec in CODECS:
        torch.manual_seed(0)
        layers: List[torch.nn.Module] = []
        for _ in range(8):
            layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))
        compression = (hvd.Compression.none if codec == "none"
                       else hvd.Compression.powersgd(rank=4, start_iter=2))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{codec}.{n}", p) for n, p in net.named_parameters()],
            compression=compression)
        x, y = torch.rand(64, 2048), torch.randint(0, 10, (64,))
        times = []
        for _ in range(WARMUP + TIMED):
            hvd.barrier()
            tic = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            mine = time.perf_counter() - tic
            times.append(hvd.allreduce(torch.tensor([mine]), op=hvd.Max).item())
        results[codec] = statistics.median(times[WARMUP:])
    if hvd.rank() == 0:
        report(results)


def one_launch(default: bool) -> Dict[str, float]:
    """A 2-rank launch: OpenBLAS's default (``default``) or the wrapper's share."""
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    if default:
        env["OPENBLAS_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    out = subprocess.run(hvdrun() + ["-np", "2", "--no-prefix", sys.executable,
                                     os.path.abspath(__file__), "--worker"],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the launch exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=4, help="launches of each setting")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    load = [os.getloadavg()[0]]
    runs: Dict[bool, List[Dict[str, float]]] = {True: [], False: []}
    for _ in range(args.launches):
        for default in (True, False):
            runs[default].append(one_launch(default))
    load.append(os.getloadavg()[0])
    print(header("numpy's BLAS threads on 2 ranks of one host, the torch step",
                 f"load average {load[0]:.1f}-{load[1]:.1f}, {args.launches} launches each"))
    shares = {run["OPENBLAS_NUM_THREADS"] for run in runs[False]}
    threads = {run["torch threads"] for run in runs[True] + runs[False]}
    print(f"OpenBLAS threads: default {len(os.sched_getaffinity(0))}, share {sorted(shares)}; "
          f"torch threads {sorted(threads)}")
    print("| codec | OpenBLAS default ms | share ms | share / default |")
    print("|---|---|---|---|")
    for codec in CODECS:
        before = [run[codec] * 1e3 for run in runs[True]]
        after = [run[codec] * 1e3 for run in runs[False]]
        print(f"| {codec} | {statistics.median(before):.0f} ({min(before):.0f}-{max(before):.0f}) "
              f"| {statistics.median(after):.0f} ({min(after):.0f}-{max(after):.0f}) "
              f"| {statistics.median(after) / statistics.median(before):.2f} |")


if __name__ == "__main__":
    main()
