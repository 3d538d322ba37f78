"""Regenerate every performance table of docs/performance.md and benchmarks/README.md in one
command.

Run:  python benchmarks/run_all.py [--quick]
Runs each benchmark script in turn (they launch their own 1- and 2-rank jobs) and prints
their tables, each headed with the machine and the date, after one line naming the machine,
the MPI library and the versions. ``--quick`` runs fewer rounds (noisier figures; 5 minutes
on 2 cores), the default more (roughly three times as long). Run it on an idle machine.
"""
import argparse
import os
import subprocess
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HVDRUN = [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "-np", "2", "--no-prefix"]


def scripts(quick: bool) -> List[List[str]]:
    """The command line of each benchmark, in the order of docs/performance.md's tables."""
    rounds = ["--rounds", "1"] if quick else []

    def path(name: str) -> str:
        return os.path.join(HERE, name)

    return [
        HVDRUN + [sys.executable, path("allreduce.py")] + (["--quick"] if quick else []),
        HVDRUN + [sys.executable, path("small_collectives.py")]
        + (["--rounds", "50"] if quick else []),
        [sys.executable, path("train_step.py"), "--buckets"] + rounds,
        [sys.executable, path("train_step.py"), "--autotune"] + rounds,
        [sys.executable, path("synthetic.py")] + rounds,
        [sys.executable, path("bridge.py")] + (["--quick"] if quick else []),
        HVDRUN + [sys.executable, path("sparse.py")],
        HVDRUN + [sys.executable, path("sparse_weights.py")],
        [sys.executable, path("compression.py")] + rounds,
        [sys.executable, path("fp16.py")] + rounds,
        [sys.executable, path("torch_ddp.py")] + rounds,
        HVDRUN + [sys.executable, path("torch_allreduce.py")] + (["--quick"] if quick else []),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, noisier figures")
    args = parser.parse_args()
    import mxnet
    import numpy
    from mpi4py import MPI
    print(common.header("hvd_trainer benchmarks",
                        f"{MPI.Get_library_version().splitlines()[0].strip()}, "
                        f"mxnet {mxnet.__version__}, numpy {numpy.__version__}, "
                        f"python {sys.version.split()[0]}"), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for cmd in scripts(args.quick):
        print(f"\n$ {' '.join(os.path.relpath(c) if c.startswith(HERE) else c for c in cmd)}",
              flush=True)
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
