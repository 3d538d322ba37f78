"""Elastic torch worker: a DistributedOptimizer with TorchState and the torch ElasticSampler
behind a DataLoader, where the job changes size in the middle of an epoch on its first life.

Usage: elastic_torch.py HOSTS_FILE RESULT_FILE (--kill | --grow | --ulfm-kill [RANK] |
--ulfm-regrow). With
--kill, rank 1 rewrites the hosts file to one slot fewer and SIGKILLs itself at step
KILL_AT_STEP; with --grow, rank 0 rewrites it to 3 slots at step GROW_AT_STEP and the ranks
commit until the host change arrives; with --ulfm-kill (under hvdrun --ulfm), RANK (2 by
default) SIGKILLs itself at step KILL_AT_STEP while 3 ranks run, and the hosts file stays;
with --ulfm-regrow, rank 2 as with --ulfm-kill, then at step REGROW_AT_STEP the 2 ranks that
went on commit until the host change arrives (hvdrun's hold on the killed rank's slot ends).
Rank 0 prints ``LIFE size=S step=K pid=P`` at each start (each call of the training
function) and ``COMMITTED step=K`` after each commit; at the end it writes the final weights
and the history of global batches (epoch, size, every rank's indices) to RESULT_FILE as JSON.
"""
import json
import os
import signal
import sys
import time

import torch

import hvd_trainer.torch as hvd
from elastic_model import BATCH, EPOCHS, data, make_torch_net, torch_step

COMMIT_EVERY, KILL_AT_STEP, GROW_AT_STEP, REGROW_AT_STEP = 4, 10, 3, 11
hosts_file, result_file, mode = sys.argv[1], sys.argv[2], sys.argv[3]
killed = int(sys.argv[4]) if len(sys.argv) > 4 else 2  # --ulfm-kill's rank
X, Y = (torch.from_numpy(a) for a in data())


# The first life whose ranks ran, not hvdrun's life 0: a life in which no rank started (the
# launcher failed, as Open MPI's PMIx listener once did under CI load) must not use up the
# change. Rank 0 marks a life as having run at its first commit, which every rank of the life
# reaches only after each has read the mark here, at its start.
RAN_MARK = result_file + ".ran"
FIRST_LIFE = not os.path.exists(RAN_MARK)


def write_hosts(slots: int) -> None:
    with open(hosts_file + ".tmp", "w") as f:
        f.write(f"localhost:{slots}\n")
    os.replace(hosts_file + ".tmp", hosts_file)


def wait_for_hosts(state, seconds: int) -> None:
    """Commit until hvdrun's host change arrives (HostsUpdatedInterrupt), for ``seconds``."""
    for _ in range(seconds * 10):
        time.sleep(0.1)
        state.commit()
    raise RuntimeError(f"no host update reached rank {hvd.rank()} within {seconds} s")


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step} pid={os.getpid()}", flush=True)
    while state.epoch < EPOCHS:
        for position, (x, y) in enumerate(loader):
            if FIRST_LIFE and mode == "--kill" and hvd.rank() == 1 and state.step == KILL_AT_STEP:
                write_hosts(hvd.size() - 1)
                os.kill(os.getpid(), signal.SIGKILL)
            if (FIRST_LIFE and mode in ("--ulfm-kill", "--ulfm-regrow") and hvd.size() == 3
                    and hvd.rank() == killed and state.step == KILL_AT_STEP):
                os.kill(os.getpid(), signal.SIGKILL)
            batch = state.sampler.get_indices(position, BATCH)
            assert torch.equal(x, X[batch]), (position, batch)  # the DataLoader's own batch
            if torch_step(state, optimizer, x, y, position, batch, COMMIT_EVERY) \
                    and hvd.rank() == 0:
                print(f"COMMITTED step={state.step}", flush=True)
                open(RAN_MARK, "a").close()
            if FIRST_LIFE and mode == "--grow" and state.step == GROW_AT_STEP:
                if hvd.rank() == 0:
                    write_hosts(3)
                wait_for_hosts(state, 30)
            if (FIRST_LIFE and mode == "--ulfm-regrow" and hvd.size() == 2
                    and state.step == REGROW_AT_STEP):
                wait_for_hosts(state, 90)  # the hold is 30 s from the kill
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
    if hvd.rank() == 0:
        weights = [p.detach().numpy().tolist() for p in (model.weight, model.bias)]
        with open(result_file, "w") as f:
            json.dump({"weights": weights, "history": state.history, "steps": state.step}, f)


model = make_torch_net()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
dataset = torch.utils.data.TensorDataset(X, Y)
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
train(hvd.elastic.TorchState(model, optimizer, epoch=0, step=0, history=[], sampler=sampler))
