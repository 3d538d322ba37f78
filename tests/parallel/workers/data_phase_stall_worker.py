"""A rank that is late for a collective's data phase, which the others entered without an
agreement (inside ``agreement.covered``, as the trainer's step runs its buckets).

Run as: worker.py stall (rank 1 is 3 s late) or worker.py hang (rank 1 sleeps 120 s).
"""
import sys
import time

import numpy as np

import hvd_trainer as hvd
from hvd_trainer.coordination import agreement
from hvd_trainer.runtime import runtime

R, N = hvd.rank(), hvd.size()
comm = runtime.communicator(hvd.global_process_set)
# Every rank agrees on the block first, so the allreduce inside skips its own agreement.
agreement.agree(comm, lambda: {"kind": "block", "name": "late block"})
if R == 1:
    time.sleep(3 if sys.argv[1] == "stall" else 120)
with agreement.covered(comm):
    got = hvd.allreduce(np.full(3, R + 1.0), op=hvd.Sum, name="late data")
assert np.array_equal(got, np.full(3, N * (N + 1) / 2)), got
print(f"rank {R}: stall over")
