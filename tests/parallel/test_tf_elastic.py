"""Elastic hvdrun with TensorFlow: TensorFlowKerasState (a Keras 3 model and its optimizer's
momentum), DistributedGradientTape in a tf.function and the core's ElasticSampler through a
rank killed with SIGKILL in the middle of an epoch (workers/elastic_tf.py).

The final weights are checked against a NumPy replay of the same global batches with the
same world sizes (SGD with momentum, as Keras computes it), and each epoch's processed samples
against range(num_samples).
"""
import json
import re
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here; its tests run in "
                    "the [test-tensorflow] environment (.venv-tf, see the README)")

from runner import WORKERS, run_ranks  # noqa: E402
from test_elastic import assert_each_sample_once_per_epoch, discovery, lives  # noqa: E402

sys.path.insert(0, WORKERS)


def reference_weights(history):
    """The global batches replayed in NumPy: the loss is each rank's sum of squared errors,
    averaged over the ranks by the tape, so each step's gradient is the global batch's sum
    divided by the number of ranks; Keras's SGD keeps m = 0.9 m - 0.05 g and adds m."""
    from elastic_model import data, initial_weights
    X, Y = data()
    weight, bias = (w.astype(np.float64) for w in initial_weights())
    moments = [np.zeros_like(weight), np.zeros_like(bias)]
    for _, size, batches in history:
        batch = [i for part in batches for i in part]
        error = 2.0 * (X[batch] @ weight.T + bias - Y[batch]) / size
        grads = [error.T @ X[batch], error.sum(0)]
        for i, (param, grad) in enumerate(zip((weight, bias), grads)):
            moments[i] = 0.9 * moments[i] - 0.05 * grad
            param += moments[i]
    return [weight.T, bias]  # a Keras Dense kernel is (inputs, units)


def test_killed_rank_tf_job_goes_on_from_last_commit_with_the_weights_of_a_replay(tmp_path):
    from elastic_model import EPOCHS, NUM_SAMPLES
    script = discovery(tmp_path, "localhost:3")
    proc = run_ranks("elastic_tf.py", 3, [str(tmp_path / "hosts"), str(tmp_path / "out.json")],
                     hvdrun_args=["--min-np", "2", "--max-np", "3",
                                  "--host-discovery-script", script], timeout=400)
    assert "rank 1 exited with code 137; ending this life of the job" in proc.stderr
    # Killed at step 10 of the first life, after committing step 8 (2 batches into epoch 1):
    # the second life, on the two slots left, starts from step 8 and spreads the 24 samples
    # left of epoch 1 over 2 ranks (6 steps).
    first_life = proc.stdout[:proc.stdout.index("LIFE size=2")]
    assert re.findall(r"COMMITTED step=(\d+)", first_life) == ["4", "8"]
    assert lives(proc.stdout) == [(3, 0), (2, 8)]
    result = json.loads((tmp_path / "out.json").read_text())
    history = result["history"]
    assert len(history) == result["steps"]
    assert [size for _, size, _ in history] == [3] * 8 + [2] * 6
    assert_each_sample_once_per_epoch(history, NUM_SAMPLES, EPOCHS)
    for got, want in zip(result["weights"], reference_weights(history)):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)
