"""PowerSGD in the core's gradient reducer on plain NumPy gradients, each case against an
independent reference (workers/powersgd_model.py, or an uninterrupted run):

- every step's sums equal the NumPy model's (with and without error feedback and warm start,
  with gradient_predivide_factor), and are bit-identical on every rank;
- save_checkpoint and an elastic commit keep the residuals, factors and counts: a resumed run
  continues bit-identically;
- a NumPy MLP trained on scikit-learn's digits with rank 4 ends within 1 point of the same
  training uncompressed.
Run with the pytest temporary directory as the only argument.
"""
import os
import pickle
import sys

import numpy as np

import hvd_trainer
from case_runner import run_cases
from hvd_trainer.training import checkpoint, hook_state
from hvd_trainer.training.array_reducer import ArrayReducer
from hvd_trainer.compression import Compression
from powersgd_model import PowerSGDModel

hvd_trainer.init()
R, N = hvd_trainer.rank(), hvd_trainer.size()
# Factored: (12, 10), (8, 3, 5) and the float64 (10, 9); exact: 1-D, too small, integer.
SHAPES = [(12, 10), (7,), (8, 3, 5), (3, 3), (10, 9), (4, 4)]
DTYPES = [np.float32, np.float32, np.float32, np.float32, np.float64, np.int32]


def gradient(rank, key, step):
    rng = np.random.default_rng([step, rank, key])
    if DTYPES[key] == np.int32:
        return rng.integers(-5, 5, SHAPES[key]).astype(np.int32)
    return rng.uniform(-1, 1, SHAPES[key]).astype(DTYPES[key])


def same_on_every_rank(arrays, what):
    every = hvd_trainer.allgather_object([np.asarray(a) for a in arrays])
    for r, theirs in enumerate(every):
        for k, (a, b) in enumerate(zip(every[0], theirs)):
            assert np.array_equal(a, b), f"{what}: tensor {k} differs between ranks 0 and {r}"


def matches_model(settings, predivide):
    reducer = ArrayReducer(SHAPES, DTYPES, compression=Compression.powersgd(**settings),
                           gradient_predivide_factor=predivide)
    model = PowerSGDModel(N, settings["rank"], settings["start_iter"],
                          settings.get("min_compression_rate", 2.0),
                          settings.get("use_error_feedback", True),
                          settings.get("warm_start", True))
    lossy = 0
    for step in range(6):
        got = reducer.reduce([gradient(R, k, step) for k in range(len(SHAPES))])
        same_on_every_rank(got, f"{settings} step {step}")
        for k, value in enumerate(got):
            exact = sum(gradient(r, k, step).astype(np.float64) for r in range(N))
            want = model.sum(k, [gradient(r, k, step) for r in range(N)]) / predivide
            assert value.dtype == DTYPES[k] and value.shape == SHAPES[k]
            if model.compressed(SHAPES[k], DTYPES[k]):
                np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-4,
                                           err_msg=f"{settings} step {step} tensor {k}")
            if model.compressed(SHAPES[k], DTYPES[k]) and step >= settings["start_iter"]:
                lossy += not np.allclose(value, exact / predivide, atol=1e-2)
            elif DTYPES[k] != np.int32 or predivide == 1.0:  # ops prescales ints per rank
                np.testing.assert_allclose(value, exact / predivide, rtol=1e-6, atol=1e-6,
                                           err_msg=f"exact: {settings} step {step} tensor {k}")
    assert lossy > 0, f"{settings}: nothing was compressed"


def factors_match_numpy_model():
    matches_model({"rank": 2, "start_iter": 2}, predivide=2.0)
    matches_model({"rank": 1, "start_iter": 0, "use_error_feedback": False,
                   "warm_start": False}, predivide=1.0)
    matches_model({"rank": 3, "start_iter": 1, "min_compression_rate": 1.0}, predivide=1.0)


def train(reducer, weights, steps):
    """Plain SGD on the reduced sums of this rank's gradients at each of ``steps``."""
    for step in steps:
        sums = reducer.reduce([gradient(R, k, step) for k in range(len(SHAPES))])
        for w, s in zip(weights, sums):
            w -= (0.1 * s).astype(w.dtype)


def resume_keeps_state(directory):
    settings = {"rank": 2, "start_iter": 2}
    fname = os.path.join(directory, f"powersgd.{N}.checkpoint")
    first = ArrayReducer(SHAPES, DTYPES, compression=Compression.powersgd(**settings))
    weights = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]
    train(first, weights, range(4))
    checkpoint.save(fname, first.reducer, lambda: [w.copy() for w in weights],
                    lambda: b"", None)
    committed = pickle.loads(pickle.dumps(hook_state.shared(first.reducer, "commit")))
    middle = [w.copy() for w in weights]
    train(first, weights, range(4, 8))
    same_on_every_rank(weights, "uninterrupted")

    loaded = ArrayReducer(SHAPES, DTYPES, compression=Compression.powersgd(**settings))
    resumed = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]

    def restore(saved, states):
        for w, v in zip(resumed, saved):
            w[...] = v
    checkpoint.load(fname, loaded.reducer, SHAPES, [str(k) for k in range(len(SHAPES))],
                    restore)
    train(loaded, resumed, range(4, 8))
    restored = ArrayReducer(SHAPES, DTYPES, compression=Compression.powersgd(**settings))
    hook_state.scatter(restored.reducer, committed, "commit")
    again = [w.copy() for w in middle]
    train(restored, again, range(4, 8))
    fresh = ArrayReducer(SHAPES, DTYPES, compression=Compression.powersgd(**settings))
    lost = [w.copy() for w in middle]
    train(fresh, lost, range(4, 8))
    for k, (a, b, c) in enumerate(zip(weights, resumed, again)):
        assert np.array_equal(a, b), f"resumed from the checkpoint: tensor {k} differs"
        assert np.array_equal(a, c), f"restored from the commit: tensor {k} differs"
    assert not all(np.array_equal(a, b) for a, b in zip(weights, lost)), \
        "a run without the saved state gave the same weights: the state was not needed"


def digits_within_a_point_of_uncompressed():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16).astype(np.float32), y, test_size=0.25, random_state=0)
    x_mine, y_mine = x_train[R::N], y_train[R::N]

    def run(compression):
        rng = np.random.default_rng(0)
        weights = [(rng.standard_normal((64, 64)) / 8).astype(np.float32),
                   np.zeros(64, np.float32),
                   (rng.standard_normal((64, 10)) / 8).astype(np.float32),
                   np.zeros(10, np.float32)]
        velocity = [np.zeros_like(w) for w in weights]
        reducer = ArrayReducer([w.shape for w in weights], [w.dtype for w in weights],
                               compression=compression)
        batch = 32
        steps = len(y_mine) // batch
        for epoch in range(15):
            order = np.random.default_rng(epoch).permutation(len(y_mine))
            for s in range(steps):
                take = order[s * batch:(s + 1) * batch]
                grads = backward(weights, x_mine[take], y_mine[take])
                sums = reducer.reduce(grads, postscale=1.0 / N)
                for w, v, g in zip(weights, velocity, sums):
                    v *= 0.9
                    v += g
                    w -= 0.1 * v
        same_on_every_rank(weights, str(compression))
        accuracy = float((forward(weights, x_test)[1].argmax(1) == y_test).mean())
        return accuracy, reducer.reducer.stats.bytes_sent

    dense, dense_bytes = run(Compression.none)
    low_rank, low_rank_bytes = run(Compression.powersgd(rank=4, start_iter=10))
    if R == 0:
        print(f"digits test accuracy: uncompressed {dense:.4f}, PowerSGD rank 4 "
              f"{low_rank:.4f}; bytes sent per step {dense_bytes} and {low_rank_bytes}",
              flush=True)
    assert low_rank_bytes < dense_bytes / 2, (low_rank_bytes, dense_bytes)
    assert dense > 0.9, f"uncompressed training reached only {dense}"
    assert low_rank >= dense - 0.01, f"PowerSGD {low_rank} against uncompressed {dense}"


def forward(weights, x):
    w1, b1, w2, b2 = weights
    hidden = np.tanh(x @ w1 + b1)
    return hidden, hidden @ w2 + b2


def backward(weights, x, y):
    """Gradients of the mean softmax cross-entropy of a 64-64-10 tanh MLP."""
    hidden, logits = forward(weights, x)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    dlogits = p / len(y)
    dhidden = (dlogits @ weights[2].T) * (1 - hidden ** 2)
    return [x.T @ dhidden, dhidden.sum(0), hidden.T @ dlogits, dlogits.sum(0)]


if __name__ == "__main__":
    run_cases({"factors_match_numpy_model": factors_match_numpy_model,
               "resume_keeps_state": lambda: resume_keeps_state(sys.argv[1]),
               "digits_within_a_point_of_uncompressed": digits_within_a_point_of_uncompressed},
              rank=R, selected=sys.argv[2:])
