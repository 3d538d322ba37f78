"""hvd_trainer.tensorflow and its Keras 3 API on 2 and 3 ranks, one job per worker and rank
count, each case its own result: the collectives against NumPy, eagerly and in a
tf.function, their gradients, errors on every rank (workers/tf_ops_worker.py); the
DistributedGradientTape and the Keras DistributedOptimizer against one process on the global
batch, the callbacks and load_model (workers/tf_training_worker.py).

TensorFlow needs NumPy 2, which MXNet 1.9.1 cannot import beside: these run in the
environment of the [test-tensorflow] extra (.venv-tf, see the README).
"""
import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here; its tests run in "
                    "the [test-tensorflow] environment (.venv-tf, see the README)")

from runner import run_ranks  # noqa: E402

OPS = ["allreduce_ops_dtypes", "variables_names_process_sets", "grouped_allreduce_with_slices",
       "allgather_variable_rows", "broadcasts", "alltoall_splits", "reducescatters",
       "gradients", "compression", "errors_on_every_rank", "runtime_ops"]
TRAINING = ["tape_sgd_momentum_eager", "tape_adam_in_tf_function",
            "tape_indexed_slices_stay_sparse", "tape_sparse_as_dense_sum_predivide",
            "tape_fp16_compression", "tape_gradient_missing_on_some_ranks",
            "fit_sgd_momentum_and_adam", "fit_callbacks"]


@pytest.fixture(scope="module", params=[2, 3])
def np_(request):
    return request.param


@pytest.fixture(scope="module")
def jobs(np_):
    """Each worker's output on ``np_`` ranks, run once for all its cases."""
    return {worker: run_ranks(worker, np_, timeout=300).stdout
            for worker in ("tf_ops_worker.py", "tf_training_worker.py")}


def _check(out, prefix, case, np_):
    failed = [line for line in out.splitlines() if f"FAILED: {case}:" in line]
    assert out.count(f"{prefix} ok: {case}\n") == np_, "\n".join(failed) or out


@pytest.mark.parametrize("case", OPS)
def test_collectives(jobs, np_, case):
    _check(jobs["tf_ops_worker.py"], "tf ops", case, np_)


@pytest.mark.parametrize("case", TRAINING)
def test_training_matches_one_process(jobs, np_, case):
    _check(jobs["tf_training_worker.py"], "tf training", case, np_)
