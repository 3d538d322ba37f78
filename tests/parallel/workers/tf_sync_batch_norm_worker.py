"""hvd_trainer.tensorflow.SyncBatchNormalization on N ranks against tf.keras's
BatchNormalization in one process on every rank's rows together (each rank makes every
rank's rows from the seed): outputs, moving statistics and input gradients with uneven
batches (rank r holds r + 1 rows), eagerly and in a tf.function, on 2-D and channels-first
4-D inputs and with a mask; model.fit with the DistributedOptimizer against one process on
the global batch; fused=True refused.

tf.keras is Keras 3, or Keras 2 when the job runs with TF_USE_LEGACY_KERAS=1; the layer
follows it. Each case reports one record per rank (case_runner.py).
"""
import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd
import hvd_trainer.tensorflow.keras as hvd_keras
from case_runner import run_cases

K = tf.keras
# Keras 2's BatchNormalization may pick its fused kernel, whose moving variance is unbiased:
# the reference is the layer SyncBatchNormalization derives from, unfused (Keras 3 has no
# fused kernel, nor the argument).
UNFUSED = {"fused": False} if K.__name__.startswith("tf_keras") else {}
hvd.init()
R, N = hvd.rank(), hvd.size()


def rows_of(rank, shape, seed=0):
    """Rank ``rank``'s batch: rank + 1 rows of ``shape``."""
    rng = np.random.RandomState(10 * seed + rank)
    return (rng.randn(rank + 1, *shape) * (rank + 1) + rank).astype(np.float32)


def mine(rank):
    """Where rank ``rank``'s rows sit in the concatenated batch."""
    start = sum(r + 1 for r in range(rank))
    return slice(start, start + rank + 1)


def close(got, want, what, tol=1e-4):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol), \
        f"{what}: max difference {np.abs(got - want).max()} (shapes {got.shape}, {want.shape})"


def step(layer, x, weights, mask=None):
    """Two training calls of ``layer`` on ``x`` (the moving statistics move twice), then the
    second call's output and the gradient of sum(output * weights) with respect to ``x``."""
    x = tf.convert_to_tensor(x)
    layer(x, training=True, mask=mask)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=True, mask=mask)
        loss = tf.reduce_sum(out * weights)
    return out, tape.gradient(loss, x)


def compare(shape, axis, compiled, masked=False):
    every = np.concatenate([rows_of(r, shape) for r in range(N)])
    weights = np.random.RandomState(99).randn(*every.shape).astype(np.float32)
    mask = None
    if masked:
        mask = np.random.RandomState(7).rand(*every.shape[:2]) > 0.3
    sync = hvd.SyncBatchNormalization(axis=axis, momentum=0.5)
    local = K.layers.BatchNormalization(axis=axis, momentum=0.5, **UNFUSED)
    # Built here: a tf.function may create variables on its first trace only.
    sync.build((None,) + shape)
    local.build((None,) + shape)
    run = tf.function(step) if compiled else step
    out, grad = run(sync, every[mine(R)], weights[mine(R)],
                    None if mask is None else tf.constant(mask[mine(R)]))
    want_out, want_grad = run(local, every, weights, None if mask is None else tf.constant(mask))
    what = f"shape {shape}, axis {axis}, {'tf.function' if compiled else 'eager'}"
    close(out, np.asarray(want_out)[mine(R)], f"{what}: output")
    close(grad, np.asarray(want_grad)[mine(R)], f"{what}: input gradient")
    close(sync.moving_mean, local.moving_mean, f"{what}: moving mean")
    close(sync.moving_variance, local.moving_variance, f"{what}: moving variance")
    # Inference uses the moving statistics, which now agree: an ordinary local layer.
    close(sync(every[mine(R)], training=False),
          np.asarray(local(every, training=False))[mine(R)], f"{what}: inference")


def uneven_batches_eager_and_compiled():
    assert issubclass(hvd.SyncBatchNormalization, K.layers.BatchNormalization)
    for compiled in (False, True):
        compare((3,), -1, compiled)
        compare((2, 3, 3), 1, compiled)


def masked_rows():
    compare((5, 3), -1, compiled=False, masked=True)


def model_fit_matches_one_process():
    B, STEPS = 4, 3
    rng = np.random.RandomState(0)
    X = rng.randn(N * B * STEPS, 5).astype(np.float32) * 3 + 1
    Y = rng.randn(N * B * STEPS, 1).astype(np.float32)
    rows = np.concatenate([np.arange(k * N * B + R * B, k * N * B + (R + 1) * B)
                           for k in range(STEPS)])

    def model(norm):
        K.utils.set_random_seed(3)
        inputs = K.Input((5,))
        hidden = norm(momentum=0.5)(K.layers.Dense(4)(inputs))
        return K.Model(inputs, K.layers.Dense(1)(K.layers.Activation("tanh")(hidden)))

    got = model(hvd.SyncBatchNormalization)
    got.compile(optimizer=hvd_keras.DistributedOptimizer(K.optimizers.SGD(0.1)), loss="mse")
    got.fit(X[rows], Y[rows], batch_size=B, epochs=2, shuffle=False, verbose=0)
    want = model(lambda **kwargs: K.layers.BatchNormalization(**kwargs, **UNFUSED))
    want.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
    want.fit(X, Y, batch_size=N * B, epochs=2, shuffle=False, verbose=0)
    for g, w in zip(got.get_weights(), want.get_weights()):
        close(g, w, "model.fit weights and moving statistics", tol=2e-5)


def fused_refused():
    try:
        hvd.SyncBatchNormalization(fused=True)
    except ValueError as error:
        assert "fused=False" in str(error), error
    else:
        raise AssertionError("fused=True was accepted")


run_cases({
    "uneven_batches_eager_and_compiled": uneven_batches_eager_and_compiled,
    "masked_rows": masked_rows,
    "model_fit_matches_one_process": model_fit_matches_one_process,
    "fused_refused": fused_refused,
})
