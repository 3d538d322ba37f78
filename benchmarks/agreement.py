"""What the per-collective agreement costs, before and after a change, in one interleaved run.

Run:  python benchmarks/agreement.py [--against REV] [--rounds 5]

Each round launches the same 2-rank worker twice, once importing hvd_trainer from a checkout
of REV (default: b87c4df, the last commit before the agreement became a fixed-size allreduce)
and once from this tree, alternating. The worker times, per call, small collectives (4 KiB,
where the agreement is most of the cost) against raw mpi4py on the same buffers, and the
agreement of a 82-gradient training step alone. The tables keep each variant's best round.
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


def launch(tree: str, iters: int) -> dict:
    return common.launch_tree(tree, __file__, ["--worker", "--iters", str(iters)])["us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="b87c4df", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iters)
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
