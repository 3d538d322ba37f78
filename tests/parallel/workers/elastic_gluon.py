"""Elastic Gluon worker: a DistributedTrainer with GluonState and an ElasticSampler, where
rank 1 kills itself with SIGKILL in the middle of an epoch on the job's first life, after
rewriting the hosts file to one slot fewer (its slot goes with it).

Usage: elastic_gluon.py HOSTS_FILE RESULT_FILE [--2bit] [--no-kill] [--keep-slot]: with
--2bit the trainer compresses gradients with MXNet's 2-bit compression (error feedback);
--no-kill runs without the kill; --keep-slot leaves the hosts file alone (as under hvdrun
--ulfm, where the survivors go on in their processes: the kill comes only while 3 ranks run).
Rank 0 prints ``LIFE size=S step=K pid=P`` at each start (each call of the training
function) and ``COMMITTED step=K`` after each commit; at the end it writes the final weights
and the history of global batches (epoch, size, every rank's indices) to RESULT_FILE as JSON.
"""
import json
import os
import signal
import sys

import mxnet as mx

import hvd_trainer.mxnet as hvd
from elastic_model import BATCH, EPOCHS, NUM_SAMPLES, data, make_net

COMMIT_EVERY, KILL_AT_STEP = 4, 10
hosts_file, result_file, options = sys.argv[1], sys.argv[2], set(sys.argv[3:])
X, Y = data()


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step} pid={os.getpid()}", flush=True)
    while state.epoch < EPOCHS:
        for position, batch in enumerate(state.sampler):
            if (os.environ["HVD_ELASTIC_RESTART"] == "0" and hvd.rank() == 1 and hvd.size() == 3
                    and state.step == KILL_AT_STEP and "--no-kill" not in options):
                if "--keep-slot" not in options:
                    with open(hosts_file, "w") as f:
                        f.write(f"localhost:{hvd.size() - 1}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            with mx.autograd.record():
                loss = ((net(mx.nd.array(X[batch])) - mx.nd.array(Y[batch])) ** 2).sum()
            loss.backward()
            trainer.step(1)
            state.history.append([state.epoch, hvd.size(),
                                  hvd.allgather_object(batch, name="batch")])
            state.sampler.record_batch(position)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                if hvd.rank() == 0:
                    print(f"COMMITTED step={state.step}", flush=True)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
    if hvd.rank() == 0:
        weights = [p.data().asnumpy().tolist() for p in net.collect_params().values()]
        with open(result_file, "w") as f:
            json.dump({"weights": weights, "history": state.history, "steps": state.step}, f)


net = make_net()
compression = {"type": "2bit", "threshold": 0.1, "min_size": 1} if "--2bit" in options else None
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                 {"learning_rate": 0.05, "momentum": 0.9},
                                 compression_params=compression)
sampler = hvd.elastic.ElasticSampler(NUM_SAMPLES, BATCH, shuffle=True, seed=3)
train(hvd.elastic.GluonState(net, trainer, epoch=0, step=0, history=[], sampler=sampler))
