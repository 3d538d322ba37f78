"""What the per-collective agreement costs, before and after a change, in one interleaved run,
and how it grows with the rank count.

Run:  python benchmarks/agreement.py [--against REV] [--rounds 5]
      python benchmarks/agreement.py --scaling [--ranks 2,4,8,16] [--launches 3]

Each round launches the same 2-rank worker twice, once importing hvd_trainer from a checkout
of REV (default: b87c4df, the last commit before the agreement became a fixed-size allreduce)
and once from this tree, alternating. The worker times, per call, small collectives (4 KiB,
where the agreement is most of the cost) against raw mpi4py on the same buffers, and the
agreement of a 82-gradient training step alone. The tables keep each variant's best round.

``--scaling`` launches jobs of 2, 4, 8 and 16 ranks on this host (more ranks than cores:
they take turns, MPICH's blocking calls yielding the core after its polls, the agreement's
waits after 100 µs; see coordination/stall.py), rank counts in turn, ``--launches`` times,
and times in each, in short interleaved rounds, a training step's agreement (82 flags)
against one small allreduce (mpi4py's ``Allreduce`` of 8 bytes) and a raw persistent
allreduce of the agreement's record polled as the agreement polls it. It prints each
one's median per call by rank count and its growth from 2 ranks: the agreement's should grow
no faster than the small allreduce's.
"""
import argparse
import datetime
import json
import os
import platform
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CASES = ["raw Allreduce", "allreduce_", "allreduce", "raw Bcast", "broadcast_", "barrier",
         "step agreement (82 flags)"]


def worker(iters: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import hvd_trainer as hvd
    from hvd_trainer.coordination import agreement
    from hvd_trainer.runtime import runtime

    world = MPI.COMM_WORLD
    buf = np.ones(1024, np.float32)
    comm = runtime.communicator(hvd.global_process_set)
    step = {"kind": "trainer step", "name": "step",
            "tensors": [{"name": f"grad.{i}", "shape": (256, 256), "dtype": "<f4"}
                        for i in range(82)]}
    flags = np.ones(82, bool)
    cases = {
        "raw Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
        "allreduce_": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="a"),
        "allreduce": lambda: hvd.allreduce(buf, op=hvd.Sum, name="a"),
        "raw Bcast": lambda: world.Bcast(buf, 0),
        "broadcast_": lambda: hvd.broadcast_(buf, 0, name="b"),
        "barrier": hvd.barrier,
        "step agreement (82 flags)": lambda: agreement.agree(comm, lambda: step, flags),
    }
    best = {}
    for _ in range(5):
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            took = world.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)
            best[name] = min(best.get(name, float("inf")), took)
    if world.rank == 0:
        print("RESULT " + json.dumps({"file": hvd.__file__, "us": {k: v * 1e6
                                                                    for k, v in best.items()}}))


def scaling_worker(iters: int, rounds: int) -> None:
    """One job of ``--scaling``: the agreement against small allreduces, medians per call."""
    import statistics

    import numpy as np
    from mpi4py import MPI

    import hvd_trainer as hvd
    from hvd_trainer.coordination import agreement, records, scheduler, stall
    from hvd_trainer.runtime import runtime

    hvd.init()
    world = MPI.COMM_WORLD
    comm = runtime.communicator(hvd.global_process_set)
    step = {"kind": "trainer step", "name": "step",
            "tensors": [{"name": f"grad.{i}", "shape": (256, 256), "dtype": "<f4"}
                        for i in range(82)]}
    flags = np.zeros(82, bool)
    flags[world.rank % 82] = True
    word = np.zeros(1, np.int64)
    record = np.zeros(records.RECORD_WORDS, np.int64)  # the agreement's record
    reduced = np.zeros_like(record)
    request = world.Allreduce_init(record, reduced, MPI.BOR)
    sched = scheduler.of(comm)

    def polled() -> None:
        request.Start()
        stall.poll(common.Polled(request), sched, comm, "raw", "agreement", 1)
    cases = {"agreement": lambda: agreement.agree(comm, lambda: step, flags),
             "small allreduce": lambda: world.Allreduce(MPI.IN_PLACE, word, MPI.BOR),
             f"persistent {record.nbytes} B allreduce, polled": polled}
    times: dict = {name: [] for name in cases}
    for fn in cases.values():
        for _ in range(5):
            fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            world.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append(world.allreduce((time.perf_counter() - start) / iters,
                                               op=MPI.MAX))
    request.Free()
    if world.rank == 0:
        print("RESULT " + json.dumps({"file": hvd.__file__, "us": {
            k: statistics.median(v) * 1e6 for k, v in times.items()}}))


def scaling(counts: list, launches: int, iters: int, rounds: int) -> None:
    """``--scaling``: jobs of each rank count in turn, ``launches`` times; medians."""
    import statistics
    loads = [", ".join(f"{x:.2f}" for x in os.getloadavg())]
    runs: dict = {n: [] for n in counts}
    for _ in range(launches):
        for n in counts:
            runs[n].append(common.launch_tree(REPO, __file__, [
                "--worker", "scaling", "--iters", str(iters), "--rounds", str(rounds)],
                ranks=n)["us"])
        loads.append(", ".join(f"{x:.2f}" for x in os.getloadavg()))
    cases = list(runs[counts[0]][0])
    median = {n: {c: statistics.median(run[c] for run in runs[n]) for c in cases}
              for n in counts}
    print(f"# agreement against rank count: {datetime.date.today()}, {platform.node()}, "
          f"{os.cpu_count()} cores ({common.cpu_model()}), commit {common.commit()}; "
          f"{launches} launches per rank count, rank counts in turn, {rounds} rounds x {iters} "
          f"calls each; load average (1, 5, 15 min) at the start and after each pass: "
          f"{' / '.join(loads)}")
    print("| ranks | " + " | ".join(f"{c}, µs (x 2 ranks')" for c in cases)
          + " | agreement − small allreduce, µs |")
    print("|---|" + "---|" * (len(cases) + 1))
    for n in counts:
        cells = [f"{median[n][c]:.1f} ({median[n][c] / median[counts[0]][c]:.2f})"
                 for c in cases]
        print(f"| {n} | " + " | ".join(cells)
              + f" | {median[n]['agreement'] - median[n]['small allreduce']:+.1f} |")


def launch(tree: str, iters: int) -> dict:
    return common.launch_tree(tree, __file__, ["--worker", "--iters", str(iters)])["us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="b87c4df", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--scaling", action="store_true",
                        help="the agreement against small allreduces at --ranks rank counts")
    parser.add_argument("--ranks", default="2,4,8,16", help="rank counts of --scaling")
    parser.add_argument("--launches", type=int, default=3, help="launches per rank count")
    parser.add_argument("--worker", nargs="?", const="pair", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "scaling":
        scaling_worker(args.iters, args.rounds)
        return
    if args.worker:
        worker(args.iters)
        return
    if args.scaling:
        scaling([int(n) for n in args.ranks.split(",")], args.launches, args.iters,
                args.rounds)
        return
    with common.detached_tree(args.against) as old:
        best = {"before": {}, "after": {}}
        for _ in range(args.rounds):
            for label, tree in (("before", old), ("after", REPO)):
                for case, us in launch(tree, args.iters).items():
                    best[label][case] = min(best[label].get(case, float("inf")), us)
    print(f"# {datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, 2 ranks, "
          f"before = {args.against}, after = this tree; best of {args.rounds} rounds")
    print("| call (4 KiB float32) | before, µs | after, µs | after − before, µs |")
    print("|---|---|---|---|")
    for case in CASES:
        b, a = best["before"][case], best["after"][case]
        print(f"| {case} | {b:.1f} | {a:.1f} | {a - b:+.1f} |")


if __name__ == "__main__":
    main()
