"""Elastic worker without a framework: sums the samples the ElasticSampler hands out while
hvdrun grows the job from 2 to 3 ranks and shrinks it back (the worker rewrites the hosts file
that the discovery script prints).

Usage: elastic_resize.py HOSTS_FILE RESULT_FILE. Rank 0 prints ``LIFE size=S step=K pid=P`` at
each start and ``HOSTS <text> step=K`` when it rewrites the hosts file; at the end it writes the
sum, the sums of the two gradients it reduces each step (see ``reduced``) and the history
of global batches to RESULT_FILE as JSON.
"""
import json
import os
import sys
import time

import numpy as np

import hvd_trainer as hvd
from hvd_trainer import elastic
from hvd_trainer.training.array_reducer import ArrayReducer

NUM_SAMPLES, BATCH, EPOCHS = 30, 2, 2
SPARSE_ROWS = 5  # the row-sparse gradient's table: sample i adds to row i % 5
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


# Each step also sums two gradients through the ArrayReducer (TensorFlow's): a dense one and a
# row-sparse one, whose kinds the first ranks agree in their first step and a rank that joins
# later takes from them (a mismatch otherwise).
reducer = ArrayReducer([(2,), (SPARSE_ROWS, 2)], [np.float64, np.float64])


def reduced(batch) -> np.ndarray:
    """This step's sums of the two gradients as one dense (1 + SPARSE_ROWS, 2) table."""
    values = DATA[batch]
    dense, (ids, rows) = reducer.reduce(
        [np.full(2, values.sum()), (np.array(batch) % SPARSE_ROWS, np.stack([values, values], 1))])
    table = np.zeros((1 + SPARSE_ROWS, 2))
    table[0] = dense
    np.add.at(table[1:], ids, rows)
    return table


@elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step} pid={os.getpid()}", flush=True)
    while state.epoch < EPOCHS:
        for batch in state.sampler:
            total = hvd.allreduce(np.array([DATA[batch].sum()]), op=hvd.Sum, name="sum")
            state.total += float(total[0])
            state.reduced = (np.array(state.reduced) + reduced(batch)).tolist()
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
            json.dump({"total": state.total, "reduced": state.reduced, "history": state.history,
                       "steps": state.step}, f)


sampler = elastic.ElasticSampler(NUM_SAMPLES, BATCH, shuffle=True, seed=5)
train(elastic.ObjectState(epoch=0, step=0, total=0.0, reduced=[[0.0, 0.0]] * (1 + SPARSE_ROWS),
                          history=[], sampler=sampler))
