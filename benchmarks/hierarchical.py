"""Hierarchical allreduce against the flat ring and MPI's own allreduce, 2 hosts x 2 ranks.

Run (as root):  python benchmarks/hierarchical.py [--rates 1gbit,10gbit] [--sizes-mib 1,16,100]
                [--repeats 7]
It builds the 2-host test bed of tests/multihost/testbed.py, shapes both hosts' lan0 with tc
tbf at each rate as benchmarks/slow_link.py does, and per rate launches one job of 4 ranks
(-H h1:2,h2:2 --network-interface lan0 --hierarchical-allreduce, HVD_ALLREDUCE_ALGO=ring)
that times, on the same float32 buffers, interleaved, each repetition's slowest rank:

* hierarchical: the world's hierarchical communicator (backends/hierarchical.py): MPI_Reduce
  within the host, our ring between the hosts' first ranks, MPI_Bcast within the host;
* ring: our flat ring over the 4 ranks (MPICommunicator.ring_allreduce);
* native: mpi4py's ``Comm.Allreduce`` on COMM_WORLD (the MPI library's own algorithm).

Each figure is the median of the repetitions after one warm-up; ratios are against the flat
ring of the same run. The communicators are timed directly, without the agreement that every
hvd_trainer collective adds (the same for all three, see docs/performance.md).
"""
import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "multihost"))
from common import commit, cpu_model, report  # noqa: E402
from slow_link import bed_result, shape, two_hosts  # noqa: E402

MODES = ("hierarchical", "ring", "native")


def worker(sizes_mib, repeats: int) -> None:
    """One rank: per size, seconds of each mode (the slowest rank's), every repetition."""
    import numpy as np
    from mpi4py import MPI

    import hvd_trainer as hvd
    from hvd_trainer.collectives import hierarchical
    from hvd_trainer.runtime import runtime

    hvd.init()
    world = runtime.communicator(hvd.global_process_set)
    hier = hierarchical.mover(hvd.global_process_set)
    if hier is world:
        raise SystemExit("hierarchical allreduce is off: launch with --hierarchical-allreduce "
                         "on 2 hosts of 2 ranks")
    comm = MPI.COMM_WORLD
    results: Dict[str, Dict[str, list]] = {}
    for mib in sizes_mib:
        buf = np.random.default_rng(comm.rank).standard_normal(int(mib * (1 << 20)) // 4) \
            .astype(np.float32)
        out = np.empty_like(buf)
        calls = {"hierarchical": lambda: hier.allreduce(buf, "sum", out),
                 "ring": lambda: world.ring_allreduce(buf, "sum", out),
                 "native": lambda: comm.Allreduce(buf, out, MPI.SUM)}
        times = {mode: [] for mode in MODES}
        for repetition in range(repeats + 1):
            for mode in MODES:
                comm.Barrier()
                start = time.perf_counter()
                calls[mode]()
                took = comm.allreduce(time.perf_counter() - start, MPI.MAX)
                if repetition:  # the first is the warm-up
                    times[mode].append(took)
        results[str(mib)] = times
    if comm.rank == 0:
        report(results)


def launch(bed, sizes: str, repeats: int) -> Dict[str, Dict[str, list]]:
    return bed_result(bed, ["-np", "4", "-H", "h1:2,h2:2", "--hierarchical-allreduce"], __file__,
                      ["--sizes-mib", sizes, "--repeats", str(repeats)],
                      {"HVD_ALLREDUCE_ALGO": "ring"}, "launch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="tbf rates on both hosts' lan0")
    parser.add_argument("--sizes-mib", default="1,16,100", help="buffer sizes in MiB")
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per mode")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker([float(s) for s in args.sizes_mib.split(",")], args.repeats)
        return

    measured = {}
    with two_hosts("hierarchical") as bed:
        for rate in args.rates.split(","):
            shape(bed, rate, 0)
            measured[rate] = launch(bed, args.sizes_mib, args.repeats)
            print(f"# {rate}: done", file=sys.stderr, flush=True)

    from mpi4py import MPI
    print(f"# hierarchical: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"commit {commit()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"{MPI.Get_library_version().splitlines()[0].strip()}, 2 hosts x 2 ranks, float32 sum, "
          f"median of {args.repeats} ms (ratio to the flat ring)")
    print("| link | size | hierarchical | ring | native |")
    print("|---|---|---|---|---|")
    for rate, sizes in measured.items():
        for mib, times in sizes.items():
            median = {mode: statistics.median(times[mode]) for mode in MODES}
            cells = [f"{median[m] * 1e3:.1f} ({median[m] / median['ring']:.2f})" for m in MODES]
            print(f"| {rate} | {mib} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
