"""The estimator tests' data: a small regression DataFrame, and each rank's rows as the
estimators' reader deals them, read back from the store's Parquet files with pyarrow alone;
the torch estimator's model and settings, and its reference (one process on the same rows).
Used by tests/engines and by the multi-host test bed's Spark driver."""
import sys

import cloudpickle
import numpy as np

RANKS, BATCH, STEPS = 3, 4, 2
LR, MOMENTUM = 0.02, 0.5  # the estimators' SGD
# The ranks cannot import the tests' modules: what they unpickle travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rows(count):
    """``count`` rows of 3 features and a linear label."""
    rng = np.random.default_rng(7)
    features = rng.normal(size=(count, 3))
    labels = features @ np.array([0.5, -1.0, 2.0]) + 0.25
    return features, labels


def frame(spark, count, validation_rows=0):
    """A DataFrame of ``count`` training rows then ``validation_rows`` marked ``is_val``, in one
    partition: features (an ML vector), y, is_val."""
    from pyspark.ml.linalg import Vectors
    features, labels = rows(count + validation_rows)
    data = [(Vectors.dense(f.tolist()), float(y), i >= count)
            for i, (f, y) in enumerate(zip(features, labels))]
    return spark.createDataFrame(data, ["features", "y", "is_val"]).coalesce(1)


def shards(folder):
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
    found = []
    for rank in range(RANKS):
        mine = groups[rank::RANKS]
        found.append((np.array([x for g in mine for x in g["features"]]),
                       np.array([y for g in mine for y in g["y"]])))
    return found


def global_batch(found, step):
    """Step ``step``'s rows of every rank, rank after rank (one process's global batch), as
    float32 tensors."""
    import torch
    window = slice(step * BATCH, (step + 1) * BATCH)
    x = np.concatenate([features[window] for features, _ in found])
    y = np.concatenate([labels[window] for _, labels in found])
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)


def torch_model():
    import torch
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def torch_estimator(store, model, **kwargs):
    """hvd_trainer.spark.torch's TorchEstimator of ``model`` on RANKS ranks: features -> y,
    BATCH rows a step, 2 epochs, no shuffling, one partition per rank (``kwargs`` change any)."""
    import torch
    import hvd_trainer.spark.torch as hvd_spark
    settings = dict(num_proc=RANKS, store=store, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                    loss=torch.nn.functional.mse_loss, input_shapes=[[-1, 3]],
                    feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2,
                    shuffle=False, partitions_per_process=1, verbose=1)
    settings.update(kwargs)
    return hvd_spark.TorchEstimator(**settings)


def torch_one_process(model, found, epochs):
    """``model`` trained in one process on the global batches of ``found`` (shards'): step t
    of an epoch takes every rank's t-th batch, with the learning rate times the ranks
    (Horovod's rule)."""
    import torch
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * RANKS, momentum=MOMENTUM)
    for _ in range(epochs):
        for step in range(STEPS):
            x, y = global_batch(found, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y.reshape(-1, 1)).backward()
            optimizer.step()
    return model
