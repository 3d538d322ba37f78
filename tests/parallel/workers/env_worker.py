"""Ranks start with different wire settings in their environment; collectives still agree.

Run as: worker.py '<json {rank: {variable: value}}>'. Each rank adds its own entries to its
environment before init (as a per-rank launcher wrapper would). If init raises, the rank
prints the error and stops; otherwise allreduces around the fusion and ring thresholds are
checked against NumPy.
"""
import json
import os
import sys

from hvd_trainer_launch.rank.wrapper import launcher_rank

os.environ.update(json.loads(sys.argv[1]).get(str(launcher_rank(os.environ)), {}))

import numpy as np  # noqa: E402 - the environment is set first

import hvd_trainer as hvd  # noqa: E402

try:
    hvd.init()
except ValueError as e:
    print(f"rank {launcher_rank(os.environ)}: init raised ValueError: {e}")
    sys.exit(0)
R, N = hvd.rank(), hvd.size()


def data(r, count, salt):
    return np.random.default_rng([r, count, salt]).integers(0, 9, count).astype(np.float32)


failures = []
# Sizes on both sides of the thresholds the test sets (1000 bytes of fusion, 100 bytes of
# ring threshold) and of the defaults (64 MiB, 1 MiB).
for count in (3, 24, 300, 2000, 300_000):
    got = hvd.allreduce(data(R, count, 0), op=hvd.Sum, name=f"single.{count}")
    want = sum(data(r, count, 0) for r in range(N))
    if not np.array_equal(got, want):
        failures.append(f"allreduce of {count}")
    group = hvd.grouped_allreduce([data(R, count, i) for i in range(4)], op=hvd.Sum,
                                  name=f"group.{count}")
    for i, g in enumerate(group):
        if not np.array_equal(g, sum(data(r, count, i) for r in range(N))):
            failures.append(f"grouped_allreduce of 4 x {count}, tensor {i}")
if failures:
    print(f"rank {R}:", *failures, sep="\n  ")
    sys.exit(1)
print(f"rank {R}: allreduces with per-rank settings match NumPy")
