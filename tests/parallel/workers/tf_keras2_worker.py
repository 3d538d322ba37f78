"""Keras 2 (tf_keras) under hvd_trainer.tensorflow.keras: N ranks with per-rank batch B against
one process with batch N·B, computed on every rank as the reference. model.fit with the
DistributedOptimizer over tf_keras's SGD with momentum (an Embedding's IndexedSlices) and over
a legacy Adam; backward_passes_per_step=2 against one process on the two batches' mean; the
callbacks (broadcast, metric average, warmup with a legacy SGD's momentum correction) and
load_model; the elastic KerasState; and a Keras 3 model beside, in the same process.

Run with TF_USE_LEGACY_KERAS=1 (tf.keras is Keras 2), or with the argument ``--import`` where
the script imports tf_keras itself (tf.keras stays Keras 3). Each case reports one record per
rank (case_runner.py).
"""
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

import hvd_trainer.keras as hvd_keras
import hvd_trainer.tensorflow.keras as hvd
from case_runner import run_cases

if "--import" in sys.argv:
    sys.argv.remove("--import")
    import tf_keras as K
    assert not tf.keras.__name__.startswith("tf_keras"), "TF_USE_LEGACY_KERAS is set"
else:
    K = tf.keras
    assert K.__name__.startswith("tf_keras"), f"tf.keras is {K.__name__}, not Keras 2"

hvd.init()
R, N = hvd.rank(), hvd.size()
B, STEPS = 4, 4
rng = np.random.RandomState(0)
X = rng.randn(N * B * STEPS, 6).astype(np.float32)
IDS = rng.randint(0, 10, (N * B * STEPS,)).astype(np.int32)
Y = rng.randn(N * B * STEPS, 1).astype(np.float32)
# This rank's rows of every global batch k (rows k·N·B + R·B ... + B), in order.
MINE = np.concatenate([np.arange(k * N * B + R * B, k * N * B + (R + 1) * B)
                       for k in range(STEPS)])


def make_model(embedding=True):
    """A small Keras 2 model; its Embedding's gradients are IndexedSlices (one-hot ids for
    Adam, which updates IndexedSlices per listed index)."""
    K.utils.set_random_seed(3)
    ids = K.Input((), dtype="int32")
    x = K.Input((6,))
    embedded = (K.layers.Embedding(10, 3)(ids) if embedding
                else K.layers.CategoryEncoding(10, output_mode="one_hot")(ids))
    hidden = K.layers.Dense(5, activation="tanh")(K.layers.Concatenate()([x, embedded]))
    return K.Model([x, ids], K.layers.Dense(1)(hidden))


def close_models(a, b, what, tol=1e-5):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        assert np.allclose(wa, wb, atol=tol, rtol=tol), \
            f"{what}: max difference {np.abs(wa - wb).max()}"


def fit(optimizer, callbacks=(), epochs=2, embedding=True, model=None):
    model = model or make_model(embedding)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit([X[MINE], IDS[MINE]], Y[MINE], batch_size=B, epochs=epochs,
                        shuffle=False, verbose=0, callbacks=list(callbacks))
    return model, history


def fit_reference(optimizer, epochs=2, embedding=True, batch=None):
    model = make_model(embedding)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit([X, IDS], Y, batch_size=batch or N * B, epochs=epochs, shuffle=False, verbose=0)
    return model


def fit_sgd_momentum_and_legacy_adam():
    sgd = lambda: K.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    got, _ = fit(hvd.DistributedOptimizer(sgd()))
    close_models(got, fit_reference(sgd()), "fit SGD")
    adam = lambda: K.optimizers.legacy.Adam(0.01)  # noqa: E731
    got, _ = fit(hvd_keras.DistributedOptimizer(adam()), embedding=False)
    close_models(got, fit_reference(adam(), embedding=False), "fit legacy Adam")


def backward_passes_average_two_batches():
    """Two passes summed, averaged, then reduced: one process's step on both global batches."""
    sgd = lambda: K.optimizers.SGD(0.1)  # noqa: E731
    optimizer = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2,
                                         average_aggregated_gradients=True,
                                         sparse_as_dense=True)
    got, _ = fit(optimizer)
    close_models(got, fit_reference(sgd(), batch=2 * N * B), "backward_passes_per_step=2")
    assert int(optimizer.iterations) == 2 * STEPS, int(optimizer.iterations)


def fit_callbacks_and_load_model():
    # Different weights on every rank: the broadcast makes them rank 0's.
    model = make_model()
    if R:
        model.set_weights([w + R for w in model.get_weights()])
    optimizer = hvd.DistributedOptimizer(K.optimizers.legacy.SGD(0.1, momentum=0.5))
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
    _, history = fit(optimizer, model=model,
                     callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvd.callbacks.MetricAverageCallback(), warmup])
    every_weights = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert all(w == every_weights[0] for w in every_weights), "weights differ across ranks"
    # Horovod's warmup at the last batch of epoch 1: 1 + (STEPS - 1) / STEPS + 1 / STEPS = 2
    want_lr = 0.1 / N * (2.0 * (N - 1) / 2 + 1)
    assert np.isclose(history.history["lr"][-1], want_lr), (history.history["lr"], want_lr)
    assert np.isclose(float(np.asarray(optimizer.momentum)), 0.5), "momentum not restored"
    losses = hvd.allgather_object(history.history["loss"][-1])
    assert np.allclose(losses, losses[0]), f"averaged loss differs across ranks: {losses}"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"model{R}.h5")
        model.save(path)
        loaded = hvd.load_model(path, custom_optimizers=[K.optimizers.legacy.SGD])
    assert isinstance(loaded.optimizer, K.optimizers.legacy.SGD), type(loaded.optimizer)
    assert isinstance(loaded.optimizer, hvd_keras_distributed()), "not distributed"
    close_models(loaded, model, "loaded")


def broadcast_after_the_first_batch_builds_the_model():
    """A Sequential without an input shape has no weights until its first batch: the
    broadcast comes after that batch (Horovod's time), and every rank ends with the same
    weights although each started from its own."""
    K.utils.set_random_seed(11 + R)
    model = K.Sequential([K.layers.Dense(3), K.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(K.optimizers.SGD(0.1)), loss="mse")
    model.fit(X[MINE], Y[MINE], batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    every_weights = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert all(w == every_weights[0] for w in every_weights), "weights differ across ranks"


def hvd_keras_distributed():
    from hvd_trainer.tensorflow.keras2 import Keras2Distributed
    return Keras2Distributed


def elastic_keras_state():
    """sync gives every rank the root's weights and attributes; restore rolls back to the
    last commit, optimizer state included."""
    model = make_model()
    model.set_weights([w + R for w in model.get_weights()])
    optimizer = K.optimizers.legacy.SGD(0.1, momentum=0.9)
    model.compile(optimizer=optimizer, loss="mse")
    model.train_on_batch([X[:B], IDS[:B]], Y[:B])
    state = hvd.elastic.KerasState(model, optimizer, batch=R, epoch=10 + R)
    state.sync()
    assert (state.batch, state.epoch) == (0, 10), (state.batch, state.epoch)
    root = hvd.broadcast_object([w.tolist() for w in model.get_weights()], 0)
    for got, want in zip(model.get_weights(), root):
        assert np.allclose(got, want)
    committed = [w.copy() for w in model.get_weights()] + [
        np.asarray(v).copy() for v in optimizer.variables()]
    model.train_on_batch([X[B:2 * B], IDS[B:2 * B]], Y[B:2 * B])
    state.batch = 7
    state.restore()
    now = model.get_weights() + [np.asarray(v) for v in optimizer.variables()]
    assert state.batch == 0
    for got, want in zip(now, committed):
        assert np.allclose(got, want), "restore did not roll back"


def keras3_beside():
    """A Keras 3 model and optimizer in the same process take Keras 3's path."""
    import keras
    keras.utils.set_random_seed(3)

    def model3():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        return model

    got = model3()
    got.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    got.fit(X[MINE], Y[MINE], batch_size=B, epochs=1, shuffle=False, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    want = model3()
    want.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    want.fit(X, Y, batch_size=N * B, epochs=1, shuffle=False, verbose=0)
    close_models(got, want, "Keras 3 beside Keras 2")


run_cases({"fit_sgd_momentum_and_legacy_adam": fit_sgd_momentum_and_legacy_adam,
           "backward_passes_average_two_batches": backward_passes_average_two_batches,
           "fit_callbacks_and_load_model": fit_callbacks_and_load_model,
           "broadcast_after_the_first_batch_builds_the_model":
               broadcast_after_the_first_batch_builds_the_model,
           "elastic_keras_state": elastic_keras_state,
           "keras3_beside": keras3_beside}, rank=R)
