"""Small collectives, 64 B..64 KiB: raw mpi4py against hvd_trainer, in the same run.

Run on 2 ranks:  hvdrun -np 2 --no-prefix python benchmarks/small_collectives.py [--rounds 200]
Against a commit:  python benchmarks/small_collectives.py --against b87c4df [--launches 10]

Each call is timed against the raw mpi4py call that moves the same bytes, on the same
buffers: ``allreduce`` (a new array) against ``Allreduce(buf, out)`` into an output allocated
once, ``allreduce_`` against ``Allreduce(IN_PLACE, buf)``, ``broadcast_`` against ``Bcast``,
``allgather`` against ``Allgather`` into an output allocated once, ``broadcast_object`` of a
small dict against ``comm.bcast`` (mpi4py's pickling broadcast), ``barrier`` against
``Barrier``. Float32 Sum, automatic names, as a script's metric averaging makes them. Rounds
interleave every variant; a round's time is its slowest rank's; each variant keeps its best
round and the median of its rounds, and each call the median over rounds of ours − raw
(each round of ours runs right after the raw one). Rounds are short (10 calls): on cores
shared with other jobs a long round mostly measures how often the two ranks were
descheduled, for the raw calls as for ours.

With ``--against REV`` the script launches 2-rank jobs of itself, alternating between
commit REV's tree (a detached worktree, imported through PYTHONPATH) and this one, and
prints for each call the median over launches of each job's median ours − raw, and the
best; the targets (issue 50): a 4 KiB allreduce's and broadcast's ours − raw at most a third
of REV's, and ``broadcast_object`` of a small dict at most 3x raw ``bcast``. Figures in
docs/performance.md.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# The workers import mpi4py, NumPy and hvd_trainer (the tree under test) where they need them:
# the parent of --against starts no MPI and imports no tree.
SIZES = [64, 1 << 10, 4 << 10, 16 << 10, 64 << 10]
SMALL_DICT = {"epoch": 3, "lr": 0.1, "best": [0.91, 0.93], "model": "resnet20"}


def pairs(size: int) -> Dict[str, Dict[str, Callable[[], None]]]:
    """For each call at ``size`` bytes: the raw mpi4py variant and ours."""
    import numpy as np
    from mpi4py import MPI

    import hvd_trainer as hvd
    comm = MPI.COMM_WORLD
    buf = np.ones(size // 4, np.float32)
    zeros = np.zeros(size // 4, np.float32)  # in place: sums of zeros stay finite
    out = np.empty_like(buf)
    gathered = np.empty(comm.size * buf.size, np.float32)
    return {
        "allreduce": {"raw": lambda: comm.Allreduce(buf, out, MPI.SUM),
                      "ours": lambda: hvd.allreduce(buf, op=hvd.Sum)},
        "allreduce_": {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, zeros, MPI.SUM),
                       "ours": lambda: hvd.allreduce_(zeros, op=hvd.Sum)},
        "broadcast_": {"raw": lambda: comm.Bcast(buf, 0),
                       "ours": lambda: hvd.broadcast_(buf, 0)},
        "allgather": {"raw": lambda: comm.Allgather(buf, gathered),
                      "ours": lambda: hvd.allgather(buf)},
    }


def others() -> Dict[str, Dict[str, Callable[[], None]]]:
    """Calls without a size: an object broadcast and a barrier."""
    from mpi4py import MPI

    import hvd_trainer as hvd
    comm = MPI.COMM_WORLD
    return {
        "broadcast_object (small dict)": {
            "raw": lambda: comm.bcast(SMALL_DICT, 0),
            "ours": lambda: hvd.broadcast_object(SMALL_DICT, 0)},
        "barrier": {"raw": comm.Barrier, "ours": hvd.barrier},
    }


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def commit(repo: str = REPO) -> str:
    """The checkout's commit, marked when the tree has changes."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def label(call: str, size) -> str:
    """A case's name: the call and its size."""
    if size is None:
        return call
    return f"{call} {size // 1024} KiB" if size >= 1024 else f"{call} {size} B"


def measure(rounds: int, iters: int) -> Dict[str, Dict[str, float]]:
    """Every case's figures in µs on this job: best and median raw and ours, and the median
    over rounds of ours − raw."""
    from allreduce import timed  # seconds per call, the slowest rank's
    cases = {label(call, size): variants for size in SIZES
             for call, variants in pairs(size).items()}
    cases.update({label(call, None): variants for call, variants in others().items()})
    for variants in cases.values():  # warm up: first calls allocate and connect
        for fn in variants.values():
            for _ in range(20):
                fn()
    times: Dict[str, Dict[str, List[float]]] = {key: {"raw": [], "ours": []} for key in cases}
    for _ in range(rounds):
        for key, variants in cases.items():
            for variant, fn in variants.items():  # raw first, then ours
                times[key][variant].append(timed(fn, iters) * 1e6)
    return {key: {"raw best": min(t["raw"]), "ours best": min(t["ours"]),
                  "raw median": statistics.median(t["raw"]),
                  "ours median": statistics.median(t["ours"]),
                  "excess median": statistics.median(o - r for o, r in zip(t["ours"], t["raw"]))}
            for key, t in times.items()}


def machine() -> str:
    """This host, its cores and its MPI library (read without starting MPI)."""
    import mpi4py
    mpi4py.rc.initialize = False
    from mpi4py import MPI
    return (f"{platform.node()}, {os.cpu_count()} cores ({common.cpu_model()}), "
            f"{MPI.Get_library_version().splitlines()[0].strip()}")


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def print_one_run(figures: Dict[str, Dict[str, float]], rounds: int, iters: int,
                  ranks: int) -> None:
    print(f"# small collectives on {ranks} ranks: {datetime.date.today()}, {machine()}, "
          f"commit {commit()}, load average {load()} at the end, {rounds} rounds x {iters} "
          "calls")
    print("| call | raw µs (best) | ours µs (best) | ours − raw µs (best) | "
          "ours − raw µs (median) | ours / raw (best) |")
    print("|---|---|---|---|---|---|")
    for key, f in figures.items():
        print(f"| {key} | {f['raw best']:.1f} | {f['ours best']:.1f} | "
              f"{f['ours best'] - f['raw best']:+.1f} | {f['excess median']:+.1f} | "
              f"{f['ours best'] / f['raw best']:.2f} |")


def worker(args: argparse.Namespace) -> None:
    import hvd_trainer as hvd
    hvd.init()
    figures = measure(args.rounds, args.iters)
    if hvd.rank() != 0:
        return
    if args.worker:
        print("RESULT " + json.dumps({"file": hvd.__file__, "figures": figures}), flush=True)
    else:
        print_one_run(figures, args.rounds, args.iters, hvd.size())


def launch(tree: str, rounds: int, iters: int) -> Dict[str, Dict[str, float]]:
    """One 2-rank job of this script's worker importing hvd_trainer from ``tree``."""
    return common.launch_tree(tree, __file__, ["--worker", "--rounds", str(rounds), "--iters",
                                               str(iters)])["figures"]


def against(rev: str, launches: int, rounds: int, iters: int) -> None:
    """This tree against commit ``rev``, launches alternating (see the module docstring)."""
    loads = [load()]
    runs: Dict[str, List[Dict[str, Dict[str, float]]]] = {"before": [], "after": []}
    with common.detached_tree(rev) as old:
        for _ in range(launches):
            for side, tree in (("before", old), ("after", REPO)):
                runs[side].append(launch(tree, rounds, iters))
            loads.append(load())

    def median(side: str, key: str, figure: str) -> float:
        return statistics.median(run[key][figure] for run in runs[side])

    def best(side: str, key: str) -> float:
        return min(run[key]["ours best"] - run[key]["raw best"] for run in runs[side])

    print(f"# small collectives on 2 ranks, {datetime.date.today()}, {machine()}; before = "
          f"{rev}, after = {commit()}; {launches} launches each, alternating, {rounds} rounds "
          f"x {iters} calls per launch; load average (1, 5, 15 min) before the first launch "
          f"and after each pair: {' / '.join(loads)}")
    print("| call | raw µs (median) | before: ours − raw µs, median (best) | after: ours − raw "
          "µs, median (best) | after / before (median) |")
    print("|---|---|---|---|---|")
    for key in runs["after"][0]:
        b, a = median("before", key, "excess median"), median("after", key, "excess median")
        print(f"| {key} | {median('after', key, 'raw median'):.1f} | {b:+.1f} "
              f"({best('before', key):+.1f}) | {a:+.1f} ({best('after', key):+.1f}) | "
              f"{a / b:.2f} |")
    for call in ("allreduce 4 KiB", "broadcast_ 4 KiB"):
        b, a = median("before", call, "excess median"), median("after", call, "excess median")
        print(f"target: {call}: ours − raw at most a third of {rev}'s: {a:+.1f} against "
              f"{b:+.1f} µs ({a / b:.2f}), {'met' if a <= b / 3 else 'not met'}")
    key = "broadcast_object (small dict)"
    ratio = median("after", key, "ours median") / median("after", key, "raw median")
    print(f"target: {key} at most 3x raw bcast: {ratio:.2f}x (medians), "
          f"{'met' if ratio <= 3 else 'not met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--iters", type=int, default=10, help="calls per round")
    parser.add_argument("--against", metavar="REV", help="compare with commit REV's tree")
    parser.add_argument("--launches", type=int, default=10, help="launches per tree (--against)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against:
        against(args.against, args.launches, args.rounds, args.iters)
    else:
        worker(args)


if __name__ == "__main__":
    main()
