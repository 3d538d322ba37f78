"""hvd_trainer.spark.keras's KerasEstimator (Keras 3 on TensorFlow, 3 ranks of the session's
Spark local-cluster; it runs in the TensorFlow environment, .venv-tf): weights against one
process training the same model on the same rows in the same order, the history against
Keras's, transform against the model called directly, resume from the store's checkpoint,
save/load."""
import os
import sys

import cloudpickle
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("pyarrow")
keras = pytest.importorskip("keras")
if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    pytest.skip("the Keras estimator's test runs with Keras 3", allow_module_level=True)

from estimator_data import BATCH, LR, MOMENTUM, RANKS, STEPS, frame, shards  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def _one_process(found, epochs):
    """The model trained in one process on the global batches (every rank's t-th batch), with
    the learning rate times the ranks (Horovod's rule)."""
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(LR * RANKS, momentum=MOMENTUM), loss="mse")
    losses = []
    for _ in range(epochs):
        for step in range(STEPS):
            window = slice(step * BATCH, (step + 1) * BATCH)
            x = np.concatenate([f[window] for f, _ in found]).astype(np.float32)
            y = np.concatenate([y[window] for _, y in found]).astype(np.float32)
            losses.append(float(model.train_on_batch(x, y.reshape(-1, 1))))
    return model, losses


def _estimator(store, **kwargs):
    import hvd_trainer.spark.keras as hvd_spark
    settings = dict(num_proc=RANKS, store=store, model=_model(),
                    optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM), loss="mse",
                    feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2,
                    shuffle=False, partitions_per_process=1, verbose=1)
    settings.update(kwargs)
    return hvd_spark.KerasEstimator(**settings)


def test_fit_equals_one_process_resumes_and_transform_equals_the_model(spark, tmp_path, capsys):
    from hvd_trainer.spark.common.store import Store
    from hvd_trainer.spark.keras import KerasModel
    store = Store.create(str(tmp_path / "store"))
    df = frame(spark, RANKS * BATCH * STEPS)
    first = _estimator(store, epochs=1, run_id="keras_run").fit(df)
    # The same run again: it resumes from the first fit's checkpoint, one more epoch.
    trained = _estimator(store, epochs=1, run_id="keras_run").fit(df)
    reference, losses = _one_process(shards(tmp_path / "store"), 2)
    for got, want in zip(trained.getModel().get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Keras's epoch loss is the mean of its steps' losses, averaged over the ranks.
    assert first.getHistory()["loss"][0] == pytest.approx(np.mean(losses[:STEPS]), rel=1e-5)
    assert "Epoch 1/1 - loss: " in capsys.readouterr().out

    predicted = trained.transform(df).select("features", "y__output").collect()
    features = np.array([r.features.toArray() for r in predicted], dtype=np.float32)
    direct = np.asarray(reference(features))[:, 0]
    np.testing.assert_allclose([r.y__output for r in predicted], direct, rtol=1e-5, atol=1e-6)

    trained.write().overwrite().save(str(tmp_path / "model"))
    loaded = KerasModel.load(str(tmp_path / "model"))
    assert loaded.getHistory() == trained.getHistory()
    for got, want in zip(loaded.getModel().get_weights(), trained.getModel().get_weights()):
        np.testing.assert_array_equal(got, want)
