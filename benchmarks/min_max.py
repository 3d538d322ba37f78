"""Float Max: MPI's own MPI_MAX vs hvd_trainer's Max (native and ring), float32, no NaN.

Run on 2 ranks:  hvdrun -np 2 --no-prefix python benchmarks/min_max.py [--quick]
Before a native float Min/Max, hvd_trainer checks each rank's input for NaN and -0 and agrees
on the answer in a one-byte allreduce (hvd_trainer/backends/mpi.py); Sum has no such check.
Each size times, on the same buffer in interleaved rounds: raw mpi4py ``Allreduce(MPI.MAX)``,
``allreduce_(op=Max)`` native and ring, ``allreduce_(op=Sum)`` native, the check alone (the
input scan and the one-byte allreduce) and the scan alone, keeping each variant's best round.
The check's time is what a native float Min/Max adds.
"""
import argparse
import datetime
import os
import platform

import numpy as np
from mpi4py import MPI

import hvd_trainer as hvd
from allreduce import best_of
from hvd_trainer.runtime import runtime
from hvd_trainer.backends.mpi import nan_or_negative_zero


def ours(algorithm, buf, op):
    world = runtime.state().world

    def run():
        world.algorithm = algorithm
        hvd.allreduce_(buf, op=op, name="bench")
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = p.parse_args()
    comm, world = MPI.COMM_WORLD, runtime.state().world
    rounds = 2 if args.quick else 15
    if hvd.rank() == 0:
        print(f"# float32 Max on {hvd.size()} ranks, {os.cpu_count()} cores, "
              f"{platform.processor() or platform.machine()}, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}, {datetime.date.today()}")
        print("| size | raw MPI_MAX µs | native Max µs | ring Max µs | native Sum µs | "
              "check µs | of which scan µs | check / raw |")
        print("|---|---|---|---|---|---|---|---|")
    for size in [4 << 10, 64 << 10, 1 << 20, 4 << 20]:
        # In place, values stay as they are after the first call: Max of the ranks' maxima,
        # and a Sum of zeros.
        buf = np.random.default_rng(hvd.rank()).random(size // 4, np.float32)
        zeros = np.zeros_like(buf)
        iters = max(3, min(200, (16 << 20) // size))
        best = best_of({"raw": lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.MAX),
                        "native": ours("native", buf, hvd.Max),
                        "ring": ours("ring", buf, hvd.Max),
                        "sum": ours("native", zeros, hvd.Sum),
                        "check": lambda: world._order_matters(buf, "max"),
                        "scan": lambda: nan_or_negative_zero(buf)}, rounds, iters)
        if hvd.rank() == 0:
            us = {k: t * 1e6 for k, t in best.items()}
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"| {label} | {us['raw']:.1f} | {us['native']:.1f} | {us['ring']:.1f} | "
                  f"{us['sum']:.1f} | {us['check']:.1f} | {us['scan']:.1f} | "
                  f"{us['check'] / us['raw']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
