"""Elastic worker without a framework for the multi-host tests: STEPS steps, a commit each.

Usage: elastic_hosts.py FOLDER. Each step allreduces rank + 1 and adds the sum to the state,
with the world size it ran at; after each commit every rank writes FOLDER/progress.RANK
(JSON: host, pid on its host, step, size) and pauses, so that a test can kill it between
steps. Rank 0 prints ``LIFE size=S step=K hosts=...`` at each start, ``COMMITTED step=K`` after
each commit and the job's commit folder (HVD_ELASTIC_DIR) once; at the end it writes
FOLDER/result.json with the total and the size of every step.
"""
import json
import os
import socket
import sys
import time

import numpy as np

import hvd_trainer as hvd
from hvd_trainer import elastic

STEPS = 24
folder = sys.argv[1]


def write(name: str, value) -> None:
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


@elastic.run
def train(state):
    hosts = hvd.allgather_object(socket.gethostname(), name="hosts")
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step} hosts={','.join(hosts)}", flush=True)
        print(f"FOLDER {os.environ['HVD_ELASTIC_DIR']}", flush=True)
    while state.step < STEPS:
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="step")
        state.total += float(total[0])
        state.sizes.append(hvd.size())
        state.step += 1
        state.commit()
        if hvd.rank() == 0:
            print(f"COMMITTED step={state.step}", flush=True)
        write(f"progress.{hvd.rank()}", {"host": socket.gethostname(), "pid": os.getpid(),
                                         "step": state.step, "size": hvd.size()})
        time.sleep(0.3)
    if hvd.rank() == 0:
        write("result.json", {"total": state.total, "sizes": state.sizes})


train(elastic.ObjectState(step=0, total=0.0, sizes=[]))
