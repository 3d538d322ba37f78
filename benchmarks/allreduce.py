"""Allreduce latency and bus bandwidth: raw mpi4py Allreduce vs hvd_trainer's ring, native, auto.

Both forms: in place (``allreduce_`` against ``Allreduce(IN_PLACE, buf)``) and out of place
(``allreduce``, which returns a new array, against ``Allreduce(buf, out)`` into an output
allocated once).

Run on 2 ranks:  hvdrun -np 2 python benchmarks/allreduce.py [--quick]
Every size times the four variants on the same buffer in interleaved rounds and keeps each
variant's best round, so machine noise hits all variants alike. Also times grouped allreduce
of an MLP's 82 gradients under several fusion thresholds, to choose the default.
busbw = bytes / t * 2 (n - 1) / n, as nccl-tests defines it.
"""
import argparse
import datetime
import os
import platform
import time

import numpy as np
from mpi4py import MPI

import hvd_trainer as hvd
from hvd_trainer.runtime import runtime


def timed(fn, iters):
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    # The slowest rank defines the collective's time.
    return MPI.COMM_WORLD.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def best_of(variants, rounds, iters):
    best = {k: float("inf") for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            best[k] = min(best[k], timed(fn, iters))
    return best


def with_algorithm(name, buf, inplace=True):
    world = runtime.state().world
    reduce = hvd.allreduce_ if inplace else hvd.allreduce

    def run():
        world.algorithm = name
        reduce(buf, op=hvd.Sum, name="bench")
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = p.parse_args()
    comm, n = MPI.COMM_WORLD, hvd.size()
    rounds = 2 if args.quick else 7
    if hvd.rank() == 0:
        print(f"# allreduce on {n} ranks, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}, {datetime.date.today()}")
        print("| size | raw µs | raw GB/s | ring GB/s | native GB/s | auto GB/s | auto/raw busbw | "
              "auto µs - raw µs | out-of-place: raw GB/s | allreduce GB/s | allreduce/raw |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        buf = np.zeros(size // 4, np.float32)
        iters = max(3, min(200, (64 << 20) // size // 4))
        out = np.zeros_like(buf)
        variants = {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
                    "raw out": lambda: comm.Allreduce(buf, out, MPI.SUM),
                    "allreduce": with_algorithm("auto", buf, inplace=False)}
        for algo in ("ring", "native", "auto"):
            variants[algo] = with_algorithm(algo, buf)
        best = best_of(variants, rounds, iters)
        bw = {k: size / t * 2 * (n - 1) / n / 1e9 for k, t in best.items()}
        if hvd.rank() == 0:
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"| {label} | {best['raw'] * 1e6:.1f} | {bw['raw']:.2f} | {bw['ring']:.2f} | "
                  f"{bw['native']:.2f} | {bw['auto']:.2f} | {bw['auto'] / bw['raw']:.2f} | "
                  f"{(best['auto'] - best['raw']) * 1e6:.1f} | {bw['raw out']:.2f} | "
                  f"{bw['allreduce']:.2f} | {bw['allreduce'] / bw['raw out']:.2f} |", flush=True)
    runtime.state().world.algorithm = "auto"

    # Fusion threshold: 82 gradients of a 40 x Dense(256) MLP (10.5 MB).
    shapes = [(256, 256), (256,)] * 40 + [(256, 64), (256,)]
    grads = [np.zeros(s, np.float32) for s in shapes]
    raw_flat = np.zeros(sum(g.size for g in grads), np.float32)
    variants = {"one raw Allreduce of all bytes": lambda: comm.Allreduce(MPI.IN_PLACE, raw_flat, MPI.SUM)}
    for mb in (1, 4, 16, 64):
        def run(mb=mb):
            runtime.state().fusion_threshold = mb << 20
            hvd.grouped_allreduce_(grads, op=hvd.Sum, name="mlp")
        variants[f"grouped, threshold {mb} MiB"] = run
    best = best_of(variants, rounds, 5)
    if hvd.rank() == 0:
        base = best["one raw Allreduce of all bytes"]
        print(f"\n# grouped allreduce of {len(grads)} tensors, {raw_flat.nbytes / 1e6:.1f} MB")
        print("| variant | ms | vs one raw Allreduce |")
        print("|---|---|---|")
        for k, t in best.items():
            print(f"| {k} | {t * 1e3:.2f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
