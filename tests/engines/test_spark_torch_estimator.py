"""hvd_trainer.spark.torch's TorchEstimator on the session's Spark local-cluster (3 ranks): two
fits of one epoch of the same run_id (the second resumes from the store's checkpoint) against
one process training the same model for two epochs on the same rows in the same order (read
from the store's Parquet files with pyarrow, dealt by the documented rule); the validation
loss against a hand computation; transform against the model called directly; save/load;
and the driver's errors on bad input before any task starts."""
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

from estimator_data import BATCH, RANKS, STEPS, frame, global_batch, rows, shards  # noqa: E402

LR, MOMENTUM = 0.02, 0.5
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _one_process(model, found, epochs):
    """The same model trained in one process on the global batches: step t of an epoch takes
    every rank's t-th batch, with the learning rate times the ranks (Horovod's rule)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * RANKS, momentum=MOMENTUM)
    for _ in range(epochs):
        for step in range(STEPS):
            x, y = global_batch(found, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y.reshape(-1, 1)).backward()
            optimizer.step()
    return model


def _estimator(store, model, **kwargs):
    import hvd_trainer.spark.torch as hvd_spark
    settings = dict(num_proc=RANKS, store=store, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                    loss=torch.nn.functional.mse_loss, input_shapes=[[-1, 3]],
                    feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2,
                    shuffle=False, partitions_per_process=1, verbose=1)
    settings.update(kwargs)
    return hvd_spark.TorchEstimator(**settings)


def _weights(model):
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_fit_resumed_equals_one_process_and_transform_equals_the_model(spark, tmp_path,
                                                                        capsys):
    from hvd_trainer.spark.common.store import Store
    from hvd_trainer.spark.torch import TorchModel
    store = Store.create(str(tmp_path / "store"))
    val_rows = RANKS * 2
    df = frame(spark, RANKS * BATCH * STEPS, validation_rows=val_rows)
    settings = dict(validation="is_val", val_batch_size=2, epochs=1, run_id="resumed")
    first = _estimator(store, _model(), **settings).fit(df)
    assert store.exists(store.get_checkpoint_path("resumed") + "/checkpoint")
    # A second fit of the same run starts from the first one's checkpoint (weights and
    # momentum): together they are two epochs from the start.
    trained = _estimator(store, _model(), **settings).fit(df)
    reference = _one_process(_model(), shards(tmp_path / "store"), 2)
    for got, want in zip(_weights(trained.getModel()), _weights(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    out = capsys.readouterr().out
    assert "Epoch 1/1 - loss: " in out and "resuming from the checkpoint" in out
    # The validation loss of the first epoch: the mean squared error over the validation rows
    # of the weights after one epoch (each rank's 2 rows in one step, averaged over ranks).
    features, labels = rows(RANKS * BATCH * STEPS + val_rows)
    val_x = torch.tensor(features[-val_rows:], dtype=torch.float32)
    with torch.no_grad():
        after_one = first.getModel()(val_x).numpy()[:, 0]
    expected = np.mean((after_one - labels[-val_rows:]) ** 2)
    assert first.getHistory()[0]["validation"]["loss"] == pytest.approx(expected, rel=1e-5)

    predicted = trained.transform(df).select("features", "y__output").collect()
    features = np.array([row.features.toArray() for row in predicted])
    with torch.no_grad():
        direct = reference(torch.tensor(features, dtype=torch.float32)).numpy()[:, 0]
    np.testing.assert_allclose([row.y__output for row in predicted], direct, rtol=1e-5,
                               atol=1e-6)

    trained.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getHistory() == trained.getHistory()
    assert loaded.getRunId() == "resumed"
    for got, want in zip(_weights(loaded.getModel()), _weights(trained.getModel())):
        np.testing.assert_array_equal(got, want)


def test_bad_input_is_refused_on_the_driver(spark, tmp_path):
    import threading
    from hvd_trainer.spark.common.store import Store
    store = Store.create(str(tmp_path / "store"))
    df = frame(spark, 12)
    cases = [
        (dict(feature_cols=["missing"]), r"feature column 'missing' is not in the DataFrame"),
        (dict(label_cols=["text"]), r"label column 'text' holds string"),
        (dict(input_shapes=[[-1, 5]]), r"the model does not take inputs of input_shapes"),
        (dict(num_proc=7), r"num_proc=7 is more than the 3 task slots"),
        (dict(validation=1.5), r"validation=1.5: give a fraction"),
        (dict(store=None), r"store is required"),
    ]
    with_text = df.withColumn("text", df.y.cast("string"))
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            _estimator(**{"store": store, "model": _model(), **change}).fit(with_text)
    locked = _model()
    locked.lock = threading.Lock()
    with pytest.raises(ValueError, match="the model cannot be pickled"):
        _estimator(store, locked).fit(with_text)
    with pytest.raises(ValueError, match=r"holds 3 values per row, but input_shapes\[0\]"):
        _estimator(store, torch.nn.Linear(4, 1), input_shapes=[[-1, 4]]).fit(with_text)
