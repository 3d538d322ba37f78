"""A training step of hvd_trainer.tensorflow against tf.distribute's
MultiWorkerMirroredStrategy, on 2 ranks of one machine, in the same two processes.

Each rank runs both: the strategy's two workers are the two ranks (TF_CONFIG with two
localhost workers, made here from the rank), and hvd_trainer's collectives go over MPI. The
step is the same for both: a Keras 3 model, SGD with momentum, per-rank batch B, the loss over
the global batch, a tf.function. Ours wraps the tape in ``DistributedGradientTape``; the
strategy's model, optimizer and step live in its scope and run through ``strategy.run``. The
models: the digits MLP (64-256-256-10) and a small CNN on 8x8 digits (16 and 32 filters, 64
units). Rounds of STEPS steps alternate between the two (which goes first alternates too);
the median seconds per step of each, the slowest rank's, and their ratio are printed, and how
far apart the two models' weights are at the end (both start from the same weights and take
the same steps on the same batches, so they agree to float rounding when both average the
same gradients).

    OMP_NUM_THREADS=1 hvdrun -np 2 --no-prefix python benchmarks/tf_mwms.py
"""
import json
import os
import socket
import time

import numpy as np

import hvd_trainer

ROUNDS, STEPS, WARMUP, BATCH = 9, 20, 5, 64


def free_ports(count: int) -> list:
    """Ports free on localhost now (closed again: the strategy's servers bind them)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def main() -> None:
    hvd_trainer.init()
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    # The strategy must exist before TensorFlow runs any op: its cluster first.
    ports = hvd_trainer.broadcast_object(free_ports(size) if rank == 0 else None, 0)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank}})
    import keras
    import tensorflow as tf

    import hvd_trainer.tensorflow as hvd
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def mlp():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                 keras.layers.Dense(256, activation="relu"),
                                 keras.layers.Dense(10)])

    def cnn():
        return keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])

    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def global_loss(model, x, y):
        return tf.reduce_sum(per_example(y, model(x, training=True))) / (BATCH * size)

    def ours(model):
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        hvd.broadcast_variables(model.variables, root_rank=0)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = global_loss(model, x, y) * size  # the tape averages over the ranks
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
        return step

    def theirs(model, make):
        weights = model.get_weights()
        with strategy.scope():
            model, optimizer = make(), keras.optimizers.SGD(0.01, momentum=0.9)
        model.set_weights(weights)  # ours', so both take the same steps

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = global_loss(model, x, y)  # the strategy sums over the replicas
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step(x, y):
            strategy.run(replica_step, args=(x, y))
        return step, model

    rng = np.random.RandomState(rank)
    inputs = {"mlp": (64,), "cnn": (8, 8, 1)}
    if rank == 0:
        print(f"TensorFlow {tf.__version__}, {size} ranks, per-rank batch {BATCH}; median of "
              f"{ROUNDS} interleaved rounds of {STEPS} steps, ms per step (slowest rank)")
        print(f"{'model':>6} {'hvd_trainer':>12} {'MWMS':>8} {'ratio ours/MWMS':>16}")
    for name, make in (("mlp", mlp), ("cnn", cnn)):
        x = tf.constant(rng.uniform(0, 1, (BATCH,) + inputs[name]).astype(np.float32))
        y = tf.constant(rng.randint(0, 10, BATCH))
        model = make()
        steps = {"hvd_trainer": ours(model)}
        steps["MWMS"], their_model = theirs(model, make)
        for step in steps.values():
            for _ in range(WARMUP):
                step(x, y)
        times = {label: [] for label in steps}
        for round_ in range(ROUNDS):
            order = list(steps) if round_ % 2 == 0 else list(steps)[::-1]
            for label in order:
                hvd_trainer.barrier()
                start = time.perf_counter()
                for _ in range(STEPS):
                    steps[label](x, y)
                elapsed = (time.perf_counter() - start) / STEPS
                times[label].append(float(hvd_trainer.allreduce(
                    np.array([elapsed]), op=hvd_trainer.Max)[0]))
        ms = {label: float(np.median(t)) * 1e3 for label, t in times.items()}
        # The same steps from the same weights: both must have averaged the same gradients.
        apart = max(float(np.abs(a - b).max())
                    for a, b in zip(model.get_weights(), their_model.get_weights()))
        apart = float(hvd_trainer.allreduce(np.array([apart]), op=hvd_trainer.Max)[0])
        if rank == 0:
            print(f"{name:>6} {ms['hvd_trainer']:>12.2f} {ms['MWMS']:>8.2f} "
                  f"{ms['hvd_trainer'] / ms['MWMS']:>16.2f}   weights apart {apart:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
