"""N ranks with per-rank batch B against one process with batch N·B, computed on every rank
as the reference: DistributedGradientTape (eager and in a tf.function, SGD with momentum and
Adam, an embedding's IndexedSlices with and without sparse_as_dense, op=Sum, a predivide
factor, fp16 compression, PowerSGD against its NumPy model, a variable without a gradient on some ranks) and the Keras 3
DistributedOptimizer in model.fit (SGD with momentum, Adam) with its callbacks and
load_model.

Each case reports one record per rank (case_runner.py).
"""
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd
from case_runner import run_cases
from powersgd_model import PowerSGDModel
import hvd_trainer.keras as hvd_keras

hvd.init()
R, N = hvd.rank(), hvd.size()
B, STEPS = 4, 3
rng = np.random.RandomState(0)
X = rng.randn(N * B * STEPS, 6).astype(np.float32)
IDS = rng.randint(0, 10, (N * B * STEPS,)).astype(np.int32)
Y = rng.randn(N * B * STEPS, 1).astype(np.float32)


def mine(k):
    """This rank's rows of global batch k: the k-th N·B rows, B of them from R·B on."""
    return slice(k * N * B + R * B, k * N * B + (R + 1) * B)


def every(k):
    return slice(k * N * B, (k + 1) * N * B)


def make_model(embedding=True):
    """A small model; its Embedding's gradients are IndexedSlices. Keras's Adam updates
    IndexedSlices lazily and per listed index (repeats counted twice), so a sum with each
    index once differs from one process's: Adam cases use one-hot ids instead."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((), dtype="int32")
    x = keras.Input((6,))
    embedded = (keras.layers.Embedding(10, 3)(ids) if embedding
                else keras.layers.CategoryEncoding(10, output_mode="one_hot")(ids))
    hidden = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([x, embedded]))
    return keras.Model([x, ids], keras.layers.Dense(1)(hidden))


def loss_of(model, k_rows, scale=1.0):
    prediction = model([X[k_rows], IDS[k_rows]])
    return tf.reduce_mean(tf.square(prediction - Y[k_rows])) * scale


def close_models(a, b, what, tol=1e-5):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        assert np.allclose(wa, wb, atol=tol, rtol=tol), \
            f"{what}: max difference {np.abs(wa - wb).max()}"


def reference(optimizer, steps=STEPS, scale=1.0, embedding=True):
    """One process on the global batches."""
    model = make_model(embedding)
    for k in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_of(model, every(k), scale)
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)
    return model


def tape_training(optimizer, compiled=False, scale=1.0, embedding=True, **tape_args):
    """N ranks, each stepping on its rows of the global batches through the tape."""
    model = make_model(embedding)

    def step(x, ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([x, ids]) - y)) * scale
        tape = hvd.DistributedGradientTape(tape, **tape_args)
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    run = tf.function(step) if compiled else step
    for k in range(STEPS):
        run(X[mine(k)], IDS[mine(k)], Y[mine(k)])
    return model


def tape_sgd_momentum_eager():
    got = tape_training(keras.optimizers.SGD(0.1, momentum=0.9))
    close_models(got, reference(keras.optimizers.SGD(0.1, momentum=0.9)), "tape SGD eager")


def tape_adam_in_tf_function():
    got = tape_training(keras.optimizers.Adam(0.01), compiled=True, embedding=False)
    close_models(got, reference(keras.optimizers.Adam(0.01), embedding=False),
                 "tape Adam tf.function")


def tape_indexed_slices_stay_sparse():
    model = make_model()
    with tf.GradientTape() as tape:
        loss = loss_of(model, mine(0))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    ref = make_model()
    with tf.GradientTape() as tape:
        loss = loss_of(ref, every(0))
    want = tape.gradient(loss, ref.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices), type(grads[0])
    touched = sorted(set(IDS[every(0)].tolist()))
    assert sorted(grads[0].indices.numpy().tolist()) == touched, "indices: rows touched anywhere"
    for g, w in zip(grads, want):
        assert np.allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(w), atol=1e-6)


def tape_sparse_as_dense_sum_predivide():
    sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.5)  # noqa: E731
    got = tape_training(sgd(), sparse_as_dense=True, gradient_predivide_factor=2.0)
    close_models(got, reference(sgd()), "sparse_as_dense with predivide 2")
    # op=Sum with the loss divided by N is the average again
    got = tape_training(sgd(), compiled=True, scale=1.0 / N, op=hvd.Sum)
    close_models(got, reference(sgd()), "op=Sum, loss / N, tf.function")


def tape_fp16_compression():
    got = tape_training(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    close_models(got, reference(keras.optimizers.SGD(0.1)), "fp16", tol=2e-3)


def tape_powersgd_compression():
    """Rank 1 from the second step, a new compressor each step (equal settings are one):
    the NumPy model replayed on every rank's gradients, then the same SGD."""
    model = make_model(False)

    def step(x, ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([x, ids]) - y))
        tape = hvd.DistributedGradientTape(
            tape, compression=hvd.Compression.powersgd(rank=1, start_iter=1))
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    optimizer = keras.optimizers.SGD(0.1)
    for k in range(STEPS):
        step(X[mine(k)], IDS[mine(k)], Y[mine(k)])
    single, replay = make_model(False), PowerSGDModel(N, rank=1, start_iter=1)
    variables, sgd = single.trainable_variables, keras.optimizers.SGD(0.1)
    for k in range(STEPS):
        per_rank = []
        for r in range(N):
            with tf.GradientTape() as tape:
                loss = loss_of(single, slice(k * N * B + r * B, k * N * B + (r + 1) * B))
            per_rank.append([g.numpy() for g in tape.gradient(loss, variables)])
        sgd.apply([(replay.sum(key, [g[key] for g in per_rank]) / N).astype(np.float32)
                   for key in range(len(variables))], variables)
    assert replay.compressed(tuple(variables[0].shape), np.float32), "nothing was factored"
    close_models(model, single, "powersgd", tol=1e-4)


def tape_gradient_missing_on_some_ranks():
    """Eager: a variable used on rank 0 only gets the others' sum (zeros from the rest)."""
    v = tf.Variable(np.ones(3, np.float32))
    w = tf.Variable(np.ones(3, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * (R + 1))
        if R == 0:
            loss += tf.reduce_sum(v * 6.0)
    gv, gw = hvd.DistributedGradientTape(tape).gradient(loss, [v, w])
    assert np.allclose(gv, np.full(3, 6.0 / N)), gv
    assert np.allclose(gw, np.full(3, sum(r + 1 for r in range(N)) / N)), gw


def fit(optimizer, callbacks=(), epochs=2, embedding=True):
    model = make_model(embedding)
    model.compile(optimizer=optimizer, loss="mse")
    rows = np.concatenate([np.arange(STEPS * N * B)[mine(k)] for k in range(STEPS)])
    history = model.fit([X[rows], IDS[rows]], Y[rows], batch_size=B, epochs=epochs,
                        shuffle=False, verbose=0, callbacks=list(callbacks))
    return model, history


def fit_reference(optimizer, epochs=2, embedding=True):
    model = make_model(embedding)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit([X, IDS], Y, batch_size=N * B, epochs=epochs, shuffle=False, verbose=0)
    return model


def fit_sgd_momentum_and_adam():
    got, _ = fit(hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
    close_models(got, fit_reference(keras.optimizers.SGD(0.1, momentum=0.9)), "fit SGD")
    got, _ = fit(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), embedding=False)
    close_models(got, fit_reference(keras.optimizers.Adam(0.01), embedding=False), "fit Adam")


def fit_callbacks():
    # Different weights on every rank: the broadcast makes them rank 0's.
    keras.utils.set_random_seed(3)
    model = make_model()
    if R:
        model.set_weights([w + R for w in model.get_weights()])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse")
    rows = np.concatenate([np.arange(STEPS * N * B)[mine(k)] for k in range(STEPS)])
    warmup = hvd_keras.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
    history = model.fit([X[rows], IDS[rows]], Y[rows], batch_size=B, epochs=2, shuffle=False,
                        verbose=0, callbacks=[hvd_keras.BroadcastGlobalVariablesCallback(0),
                                              hvd_keras.callbacks.MetricAverageCallback(),
                                              warmup])  # horovod.keras has both spellings
    every_weights = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert all(w == every_weights[0] for w in every_weights), "weights differ across ranks"
    # Horovod's warmup at the last batch of epoch 1: epoch 1 + (STEPS - 1) / STEPS + 1 / STEPS
    last = 2.0
    want_lr = 0.1 / N * (last * (N - 1) / 2 + 1)
    assert np.isclose(history.history["lr"][-1], want_lr), (history.history["lr"], want_lr)
    losses = hvd.allgather_object(history.history["loss"][-1])
    assert np.allclose(losses, losses[0]), f"averaged loss differs across ranks: {losses}"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"model{R}.keras")
        model.save(path)
        loaded = hvd_keras.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert type(loaded.optimizer).apply is not keras.optimizers.SGD.apply, "not distributed"
    close_models(loaded, model, "loaded")


def partial_optimizer_and_local_variables():
    """horovod.keras's PartialDistributedOptimizer: the local layer's gradient stays this
    rank's, divided by N (scale_local_gradients), the other layer's is averaged, against each
    rank's gradient computed here in one process. BroadcastGlobalVariablesCallback with
    local_variables leaves those at each rank's value and gives the rest the root's."""
    def make(rank):
        keras.utils.set_random_seed(5)  # the shared layer starts alike on every rank
        inputs = keras.Input((6,))
        local = keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(
            0.1 * (rank + 1)))
        model = keras.Model(inputs, keras.layers.Dense(1)(local(inputs)))
        return model, local

    def gradients_of(rank):
        model, _ = make(rank)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(X[mine_of(rank)]) - Y[mine_of(rank)]))
        return model, [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    def mine_of(rank):
        return slice(rank * B, (rank + 1) * B)

    model, local = make(R)
    optimizer = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0),
                                                      local_layers=local)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(X[mine_of(R)]) - Y[mine_of(R)]))
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    start, own = gradients_of(R)
    every = [gradients_of(r)[1] for r in range(N)]
    for i, (got, before) in enumerate(zip(model.get_weights(), start.get_weights())):
        want = own[i] / N if i < 2 else sum(g[i] for g in every) / N  # [local, shared] weights
        assert np.allclose(before - got, want, atol=1e-6), (i, before - got, want)

    # The tape's split into local and shared (source, gradient) pairs (Horovod's).
    model, local = make(R)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(X[mine_of(R)]) - Y[mine_of(R)]))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
    local_pairs, shared_pairs = tape.get_local_and_global_gradients(
        loss, model.trainable_variables)
    assert [id(v) for v, _ in local_pairs] == [id(w) for w in local.trainable_weights]
    for i, (_, g) in enumerate(local_pairs + shared_pairs):
        want = own[i] / N if i < 2 else sum(e[i] for e in every) / N
        assert np.allclose(g, want, atol=1e-6), ("split", i)

    model, local = make(R)
    model.layers[-1].set_weights([w + R for w in model.layers[-1].get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
        root_rank=N - 1, local_variables=local.variables)
    model.fit(X[:B], Y[:B], batch_size=B, verbose=0, callbacks=[callback])
    fresh, _ = make(N - 1)
    assert np.allclose(local.get_weights()[0], 0.1 * (R + 1)), "a local variable was broadcast"
    for got, root in zip(model.layers[-1].get_weights(), fresh.layers[-1].get_weights()):
        assert np.allclose(got, root + N - 1), "the root's value did not arrive"


run_cases({"tape_sgd_momentum_eager": tape_sgd_momentum_eager,
           "tape_adam_in_tf_function": tape_adam_in_tf_function,
           "tape_indexed_slices_stay_sparse": tape_indexed_slices_stay_sparse,
           "tape_sparse_as_dense_sum_predivide": tape_sparse_as_dense_sum_predivide,
           "tape_fp16_compression": tape_fp16_compression,
           "tape_powersgd_compression": tape_powersgd_compression,
           "tape_gradient_missing_on_some_ranks": tape_gradient_missing_on_some_ranks,
           "fit_sgd_momentum_and_adam": fit_sgd_momentum_and_adam,
           "fit_callbacks": fit_callbacks,
           "partial_optimizer_and_local_variables": partial_optimizer_and_local_variables}, rank=R)
