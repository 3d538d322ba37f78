"""Elastic TensorFlow worker: a Keras 3 model stepped by a tf.function with
DistributedGradientTape, kept in TensorFlowKerasState with the core's ElasticSampler; on the
first life rank 1 rewrites the hosts file to one slot fewer and SIGKILLs itself at step
KILL_AT_STEP, in the middle of an epoch.

Usage: elastic_tf.py HOSTS_FILE RESULT_FILE [--keep-slot]: --keep-slot leaves the hosts
file alone (as under hvdrun --ulfm, where the survivors go on in their processes: the kill
comes only while 3 ranks run). Rank 0 prints ``LIFE size=S step=K pid=P`` at each start and ``COMMITTED step=K`` after each commit; at the end it writes the final weights and
the history of global batches (epoch, size, every rank's indices) to RESULT_FILE as JSON.
"""
import json
import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd
from elastic_model import BATCH, EPOCHS, NUM_SAMPLES, data, initial_weights
from hvd_trainer.elastic import ElasticSampler

COMMIT_EVERY, KILL_AT_STEP = 4, 10
hosts_file, result_file, options = sys.argv[1], sys.argv[2], set(sys.argv[3:])
X, Y = data()


def write_hosts(slots: int) -> None:
    with open(hosts_file + ".tmp", "w") as f:
        f.write(f"localhost:{slots}\n")
    os.replace(hosts_file + ".tmp", hosts_file)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step} pid={os.getpid()}", flush=True)
    while state.epoch < EPOCHS:
        for position, batch in enumerate(state.sampler):
            if (os.environ["HVD_ELASTIC_RESTART"] == "0" and hvd.rank() == 1
                    and hvd.size() == 3 and state.step == KILL_AT_STEP):
                if "--keep-slot" not in options:
                    write_hosts(hvd.size() - 1)
                os.kill(os.getpid(), signal.SIGKILL)
            train_step(X[batch], Y[batch])
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
        weights = [w.tolist() for w in model.get_weights()]
        with open(result_file, "w") as f:
            json.dump({"weights": weights, "history": state.history, "steps": state.step}, f)


model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
weight, bias = initial_weights()
model.set_weights([weight.T, bias])
optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
optimizer.build(model.trainable_variables)
sampler = ElasticSampler(NUM_SAMPLES, BATCH, shuffle=True, seed=3)
train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, step=0, history=[],
                                       sampler=sampler))
