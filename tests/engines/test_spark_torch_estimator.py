"""hvd_trainer.spark.torch's TorchEstimator on the session's Spark local-cluster (3 ranks): two
fits of one epoch of the same run_id (the second resumes from the store's checkpoint) against
one process training the same model for two epochs on the same rows in the same order (read
from the store's Parquet files with pyarrow, dealt by the documented rule); the validation
loss against a hand computation; transform against the model called directly; save/load;
and the driver's errors on bad input before any task starts."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

from estimator_data import (BATCH, RANKS, STEPS, frame, rows, shards, torch_estimator,  # noqa: E402
                            torch_model, torch_one_process)

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
    first = torch_estimator(store, torch_model(), **settings).fit(df)
    assert store.exists(store.get_checkpoint_path("resumed") + "/checkpoint")
    # A second fit of the same run starts from the first one's checkpoint (weights and
    # momentum): together they are two epochs from the start.
    trained = torch_estimator(store, torch_model(), **settings).fit(df)
    reference = torch_one_process(torch_model(), shards(tmp_path / "store"), 2)
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
            torch_estimator(**{"store": store, "model": torch_model(), **change}).fit(with_text)
    locked = torch_model()
    locked.lock = threading.Lock()
    with pytest.raises(ValueError, match="the model cannot be pickled"):
        torch_estimator(store, locked).fit(with_text)
    with pytest.raises(ValueError, match=r"holds 3 values per row, but input_shapes\[0\]"):
        torch_estimator(store, torch.nn.Linear(4, 1), input_shapes=[[-1, 4]]).fit(with_text)


def test_prepared_datasets_take_the_smallest_index_no_fit_holds(spark, tmp_path):
    # Horovod's rule (its test_prepare_data_no_compression expects 0 after a clear): indices
    # from 0, a second one while the first is in use, and the files of a dataset no fit uses
    # written over by the next new one rather than filling the store.
    from hvd_trainer.spark.common import prepare
    from hvd_trainer.spark.common.store import Store
    settings = dict(num_processes=RANKS, store=Store.create(str(tmp_path / "store")),
                    label_columns=["y"], feature_columns=["features"], partitions_per_process=1)
    first, second, third = frame(spark, 12), frame(spark, 15), frame(spark, 18)
    prepare.clear_training_cache()
    with prepare.prepare_data(df=first, **settings) as a:
        with prepare.prepare_data(df=second, **settings) as b:
            pass
        with prepare.prepare_data(df=first, **settings) as a_again:  # the same: reused
            pass
    with prepare.prepare_data(df=third, **settings) as c:  # 0 and 1 free: 0, written over
        rows_of_c = prepare.get_dataset_properties(c).train_rows
    with prepare.prepare_data(df=first, **settings) as a_later:  # its files were c's: again
        rows_of_a = prepare.get_dataset_properties(a_later).train_rows
    assert (a, b, a_again, c, a_later) == (0, 1, 0, 0, 0)
    assert (rows_of_c, rows_of_a) == (18, 12)
