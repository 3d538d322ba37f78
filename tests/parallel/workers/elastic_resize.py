"""Elastic worker without a framework: sums the samples the ElasticSampler hands out while
hvdrun grows the job from 2 to 3 ranks and shrinks it back (the worker rewrites the hosts file
that the discovery script prints).

Usage: elastic_resize.py HOSTS_FILE RESULT_FILE. Rank 0 prints ``LIFE size=S step=K`` at each
start and ``HOSTS <text> step=K`` when it rewrites the hosts file; at the end it writes the
sum and the history of global batches to RESULT_FILE as JSON.
"""
import json
import os
import sys
import time

import numpy as np

import hvd_trainer as hvd
from hvd_trainer import elastic

NUM_SAMPLES, BATCH, EPOCHS = 30, 2, 2
DATA = np.arange(NUM_SAMPLES, dtype=np.float64) + 1.0
hosts_file, result_file = sys.argv[1], sys.argv[2]


def write_hosts(text: str) -> None:
    with open(hosts_file + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(hosts_file + ".tmp", hosts_file)


def wait_for_reset(state: elastic.State, check) -> None:
    """Commit or check until hvdrun's change arrives (HostsUpdatedInterrupt); bounded."""
    for _ in range(300):
        time.sleep(0.1)
        check()
    raise RuntimeError(f"no host update reached rank {hvd.rank()} within 30 s")


@elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step}", flush=True)
    while state.epoch < EPOCHS:
        for batch in state.sampler:
            total = hvd.allreduce(np.array([DATA[batch].sum()]), op=hvd.Sum, name="sum")
            state.total += float(total[0])
            state.history.append([state.epoch, hvd.size(),
                                  hvd.allgather_object(batch, name="batch")])
            state.sampler.record(batch)
            state.step += 1
            state.commit()
            if hvd.size() == 2 and state.step == 3:  # grow at the next commit
                if hvd.rank() == 0:
                    write_hosts("localhost:3")
                    print(f"HOSTS localhost:3 step={state.step}", flush=True)
                wait_for_reset(state, state.commit)
            if hvd.size() == 3 and state.step == 9:  # shrink at the next check
                if hvd.rank() == 0:
                    write_hosts("localhost:2")
                    print(f"HOSTS localhost:2 step={state.step}", flush=True)
                wait_for_reset(state, state.check_host_updates)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
    if hvd.rank() == 0:
        with open(result_file, "w") as f:
            json.dump({"total": state.total, "history": state.history, "steps": state.step}, f)


sampler = elastic.ElasticSampler(NUM_SAMPLES, BATCH, shuffle=True, seed=5)
train(elastic.ObjectState(epoch=0, step=0, total=0.0, history=[], sampler=sampler))
