"""The estimators' progress lines, printed by rank 0: one when training starts and one per
epoch with its loss and metrics, as Keras prints them (``Epoch 2/5 - loss: 0.6931 -
val_loss: 0.7012``). They reach the driver with the ranks' output (hvd_trainer.spark.run)."""
from typing import Mapping

__all__ = ["start_line", "epoch_line"]


def start_line(epochs: int, rows: int, batch_size: int, steps: int) -> None:
    """Say what training will do."""
    print(f"hvd_trainer.spark: {epochs} epochs of {steps} steps per rank ({rows} training "
          f"rows, batches of {batch_size} rows per rank)", flush=True)


def epoch_line(epoch: int, epochs: int, values: Mapping[str, float]) -> None:
    """Print epoch ``epoch`` (counted from 0) of ``epochs`` and its values."""
    parts = " - ".join(f"{name}: {value:.4f}" for name, value in values.items())
    print(f"Epoch {epoch + 1}/{epochs} - {parts}", flush=True)
