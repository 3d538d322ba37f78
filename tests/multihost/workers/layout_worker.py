"""One rank of a multi-host job: says where it runs, then checks collectives against NumPy.

Prints ``layout {json}`` (hostname, rank, size, local and cross rank and size, the HOROVOD_*
variables), then allreduce, allgather and broadcast of float32 arrays (16 MiB for the
allreduce, so that the job must move that much between hosts) against NumPy, and
``collectives match NumPy`` or the mismatches.
"""
import json
import os
import socket
import sys

import numpy as np

import hvd_trainer as hvd

COUNT = 4 << 20  # float32 elements: 16 MiB

hvd.init()
R, N = hvd.rank(), hvd.size()
print("layout " + json.dumps({
    "host": socket.gethostname(), "rank": R, "size": N,
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}}), flush=True)


def data(rank, count):
    return np.random.default_rng([rank, count]).standard_normal(count).astype(np.float32)


failures = []
total = hvd.allreduce(data(R, COUNT), op=hvd.Sum, name="big")
want = np.zeros(COUNT, np.float32)
for r in range(N):  # the ring's order differs: compare to float tolerance
    want += data(r, COUNT)
if not np.allclose(total, want, rtol=1e-5, atol=1e-4):
    failures.append(f"allreduce of {COUNT}: largest error {np.abs(total - want).max()}")
gathered = hvd.allgather(np.full((R + 1, 3), R, np.int64), name="rows")
if not np.array_equal(gathered, np.concatenate([np.full((r + 1, 3), r) for r in range(N)])):
    failures.append(f"allgather: got rows {gathered[:, 0].tolist()}")
root = N - 1  # a rank on the last host
got = hvd.broadcast(data(R, 1000), root_rank=root, name="from_last")
if not np.array_equal(got, data(root, 1000)):
    failures.append(f"broadcast from rank {root}: differs")
if failures:
    print(f"rank {R}:", *failures, sep="\n  ")
    sys.exit(1)
print(f"rank {R}: collectives match NumPy")
