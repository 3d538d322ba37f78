"""Print this rank's Horovod variables (as hvdrun set them) beside what hvd_trainer reports.

One line per rank: ``PLACE {"env": {...}, "mpi": {...}}``, where ``env`` maps each
HOROVOD_* name to its value (absent: not set) and ``mpi`` the same names to hvd_trainer's
rank(), size(), local_rank(), local_size(), cross_rank(), cross_size(), which it takes from
MPI's own split of the world.
"""
import json
import os

import hvd_trainer as hvd

NAMES = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")
env = {name: os.environ[f"HOROVOD_{name}"] for name in NAMES if f"HOROVOD_{name}" in os.environ}
hvd.init()
mpi = {"RANK": hvd.rank(), "SIZE": hvd.size(), "LOCAL_RANK": hvd.local_rank(),
       "LOCAL_SIZE": hvd.local_size(), "CROSS_RANK": hvd.cross_rank(),
       "CROSS_SIZE": hvd.cross_size()}
print("PLACE " + json.dumps({"env": env, "mpi": {k: str(v) for k, v in mpi.items()}}), flush=True)
