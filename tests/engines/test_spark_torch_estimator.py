"""hvd_trainer.spark.torch's TorchEstimator on the session's Spark local-cluster (3 ranks):
weights against one process training the same model on the same rows in the same order (read
from the store's Parquet files with pyarrow, dealt by the documented rule), transform against
the model called directly, validation and resuming from the store's checkpoint, save/load,
and the driver's errors on bad input before any task starts."""
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

RANKS, BATCH, STEPS = 3, 4, 2
LR, MOMENTUM = 0.02, 0.5
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _rows(count, offset=0):
    rng = np.random.default_rng(7)
    features = rng.normal(size=(count + offset, 3))[offset:]
    labels = features @ np.array([0.5, -1.0, 2.0]) + 0.25
    return features, labels


def _frame(spark, count, validation_rows=0):
    from pyspark.ml.linalg import Vectors
    features, labels = _rows(count + validation_rows)
    data = [(Vectors.dense(f.tolist()), float(y), i >= count)
            for i, (f, y) in enumerate(zip(features, labels))]
    return spark.createDataFrame(data, ["features", "y", "is_val"]).coalesce(1)


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _shards(folder):
    """Each rank's rows in reading order, by the reader's rule: row groups in file-name order,
    dealt round-robin to the ranks (read here with pyarrow alone from the store's one
    training dataset)."""
    import pyarrow.parquet as pq
    [dataset] = folder.glob("intermediate_train_data.*")
    groups = []
    for name in sorted(str(p) for p in dataset.glob("*.parquet")):
        with open(name, "rb") as f:
            parquet = pq.ParquetFile(f)
            groups += [parquet.read_row_group(i).to_pydict()
                       for i in range(parquet.metadata.num_row_groups)]
    shards = []
    for rank in range(RANKS):
        mine = [g for g in groups[rank::RANKS]]
        shards.append((np.array([x for g in mine for x in g["features"]]),
                       np.array([y for g in mine for y in g["y"]])))
    return shards


def _one_process(model, shards, epochs):
    """The same model trained in one process on the global batches: step t of an epoch takes
    every rank's t-th batch, with the learning rate times the ranks (Horovod's rule)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * RANKS, momentum=MOMENTUM)
    for _ in range(epochs):
        for step in range(STEPS):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            x = torch.tensor(np.concatenate([s[0][rows] for s in shards]), dtype=torch.float32)
            y = torch.tensor(np.concatenate([s[1][rows] for s in shards]), dtype=torch.float32)
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


def test_fit_equals_one_process_and_transform_equals_the_model(spark, tmp_path, capsys):
    from hvd_trainer.spark.common.store import Store
    from hvd_trainer.spark.torch import TorchModel
    store = Store.create(str(tmp_path / "store"))
    df = _frame(spark, RANKS * BATCH * STEPS)
    trained = _estimator(store, _model()).fit(df)
    reference = _one_process(_model(), _shards(tmp_path / "store"), 2)
    for got, want in zip(_weights(trained.getModel()), _weights(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    history = trained.getHistory()
    assert [entry["epoch"] for entry in history] == [0, 1]
    out = capsys.readouterr().out
    assert "Epoch 1/2 - loss: " in out and "Epoch 2/2 - loss: " in out

    predicted = trained.transform(df).select("features", "y__output").collect()
    features = np.array([row.features.toArray() for row in predicted])
    with torch.no_grad():
        direct = reference(torch.tensor(features, dtype=torch.float32)).numpy()[:, 0]
    np.testing.assert_allclose([row.y__output for row in predicted], direct, rtol=1e-5,
                               atol=1e-6)

    trained.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getHistory() == history and loaded.getRunId() == trained.getRunId()
    for got, want in zip(_weights(loaded.getModel()), _weights(trained.getModel())):
        np.testing.assert_array_equal(got, want)


def test_validation_column_and_resume_from_the_checkpoint(spark, tmp_path):
    from hvd_trainer.spark.common.store import Store
    store = Store.create(str(tmp_path / "store"))
    val_rows = RANKS * 2
    df = _frame(spark, RANKS * BATCH * STEPS, validation_rows=val_rows)
    settings = dict(validation="is_val", val_batch_size=2, epochs=1, run_id="resumed")
    first = _estimator(store, _model(), **settings).fit(df)
    assert store.exists(store.get_checkpoint_path("resumed") + "/checkpoint")
    # A second fit of the same run starts from the first one's checkpoint (weights and
    # momentum): together they are two epochs from the start.
    second = _estimator(store, _model(), **settings).fit(df)
    shards = _shards(tmp_path / "store")
    reference = _one_process(_model(), shards, 2)
    for got, want in zip(_weights(second.getModel()), _weights(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The validation loss of the first epoch: the mean squared error over the validation rows
    # of the weights after one epoch (each rank's 2 rows in one step, averaged over ranks).
    features, labels = _rows(RANKS * BATCH * STEPS + val_rows)
    val_x = torch.tensor(features[-val_rows:], dtype=torch.float32)
    with torch.no_grad():
        after_one = first.getModel()(val_x).numpy()[:, 0]
    expected = np.mean((after_one - labels[-val_rows:]) ** 2)
    assert first.getHistory()[0]["validation"]["loss"] == pytest.approx(expected, rel=1e-5)


def test_bad_input_is_refused_on_the_driver(spark, tmp_path):
    import threading
    from hvd_trainer.spark.common.store import Store
    store = Store.create(str(tmp_path / "store"))
    df = _frame(spark, 12)
    cases = [
        (dict(feature_cols=["missing"]), r"feature column 'missing' is not in the DataFrame"),
        (dict(label_cols=["text"]), r"label column 'text' holds string"),
        (dict(input_shapes=[[-1, 5]]), r"the model does not take inputs of input_shapes"),
        (dict(num_proc=7), r"num_proc=7 is more than the 3 task slots"),
        (dict(validation=1.5), r"validation=1.5: give a fraction"),
        (dict(store=None), r"store is required"),
    ]
    frame = df.withColumn("text", df.y.cast("string"))
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            _estimator(**{"store": store, "model": _model(), **change}).fit(frame)
    locked = _model()
    locked.lock = threading.Lock()
    with pytest.raises(ValueError, match="the model cannot be pickled"):
        _estimator(store, locked).fit(frame)
    with pytest.raises(ValueError, match=r"holds 3 values per row, but input_shapes\[0\]"):
        _estimator(store, torch.nn.Linear(4, 1), input_shapes=[[-1, 4]]).fit(frame)
