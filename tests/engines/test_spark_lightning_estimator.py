"""hvd_trainer.spark.lightning's TorchEstimator (a LightningModule, Lightning 2, trained with
HorovodStrategy on 3 ranks of the session's local-cluster): weights against one process
training the module on the same rows in the same order, its logged metrics in the history and
the epoch lines, a user's ModelCheckpoint callback, transform against the module called
directly."""
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("pyarrow")

from estimator_data import BATCH, RANKS, STEPS, frame, global_batch, shards  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Regression(pl.LightningModule):
    """Batches are dicts of column name to tensor, as Horovod's Lightning estimator gives."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                       torch.nn.Linear(4, 1))

    def forward(self, features):
        return self.net(features.float())

    def training_step(self, batch, _):
        loss = torch.nn.functional.mse_loss(self(batch["features"]),
                                            batch["y"].float().reshape(-1, 1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)


def test_fit_equals_one_process_and_transform_equals_the_module(spark, tmp_path, capsys):
    import hvd_trainer.spark.lightning as hvd_spark
    from hvd_trainer.spark.common.store import Store
    store = Store.create(str(tmp_path / "store"))
    df = frame(spark, RANKS * BATCH * STEPS)
    estimator = hvd_spark.TorchEstimator(
        num_proc=RANKS, store=store, model=Regression(), feature_cols=["features"],
        label_cols=["y"], input_shapes=[[-1, 3]], batch_size=BATCH, epochs=2, shuffle=False,
        partitions_per_process=1, verbose=1,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"))])
    trained = estimator.fit(df)
    # The user's ModelCheckpoint ran (Lightning refused it while checkpointing was off).
    assert [p.suffix for p in (tmp_path / "checkpoints").iterdir()] == [".ckpt"]

    reference = Regression()
    optimizer = reference.configure_optimizers()
    found = shards(tmp_path / "store")
    losses = []
    for _ in range(2):
        for step in range(STEPS):
            x, y = global_batch(found, step)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(reference(x), y.reshape(-1, 1))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    for got, want in zip(trained.getModel().parameters(), reference.parameters()):
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-5,
                                   atol=1e-6)
    history = trained.getHistory()
    # The last step's loss, averaged over the ranks (sync_dist), is the global batch's.
    assert [round(h["train_loss"], 5) for h in history] == [round(losses[1], 5),
                                                             round(losses[3], 5)]
    assert "Epoch 2/2 - train_loss: " in capsys.readouterr().out

    predicted = trained.transform(df).select("features", "y__output").collect()
    features = torch.tensor(np.array([r.features.toArray() for r in predicted]),
                            dtype=torch.float32)
    with torch.no_grad():
        direct = reference(features).numpy()[:, 0]
    np.testing.assert_allclose([r.y__output for r in predicted], direct, rtol=1e-5, atol=1e-6)
