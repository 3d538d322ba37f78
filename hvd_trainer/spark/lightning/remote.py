"""The Lightning estimator's training function, run on every rank
(horovod.spark.lightning.remote): a Lightning 2 ``Trainer`` with
:class:`hvd_trainer.torch.lightning.HorovodStrategy` fits the LightningModule on batches of the
rank's shard of the prepared Parquet rows, as dicts of column name to tensor (Horovod's
batches: ``batch['features']``). Every rank takes the same number of steps per epoch. After
each epoch rank 0 keeps the epoch's logged metrics for the history, prints an epoch line and
writes a Lightning checkpoint to the store (atomically); a run whose checkpoint is there
resumes from it, up to ``epochs`` in all (Lightning's resume).
"""
import io
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from hvd_trainer.spark.common import payload, progress
from hvd_trainer.spark.common.feed import DataSpec, feeds
from hvd_trainer.spark.common.reader import ShardReader

__all__ = ["LightningSpec", "LightningResult", "train"]


@dataclass
class LightningSpec(DataSpec):
    """What every rank needs to fit the module, besides the data and the module."""
    callbacks: List[Any] = field(default_factory=list)
    logger: Any = None
    trainer_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LightningResult:
    """A rank's answer: the per-epoch metrics, and (rank 0) the trained state_dict's bytes."""
    history: List[Dict[str, float]]
    state: Optional[bytes]


class _Batches:
    """``steps`` batches of a shard per pass, as dicts of tensors (what Lightning iterates)."""

    def __init__(self, reader: ShardReader, steps: int) -> None:
        self.reader, self.steps = reader, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        import torch
        for batch in self.reader.batches(self.steps):
            yield {name: torch.tensor(np.asarray(values)) for name, values in batch.items()}


def _epoch_callback(spec: LightningSpec, history: List[Dict[str, float]], folder: str) -> Any:
    """A callback that, after each epoch (and its validation), records the logged metrics,
    prints rank 0's epoch line and stores the checkpoint."""
    import pytorch_lightning as pl

    class EpochEnd(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            values = {k: float(v) for k, v in trainer.callback_metrics.items()
                      if getattr(v, "numel", lambda: 1)() == 1}
            history.append(values)
            local = os.path.join(folder, "checkpoint.ckpt")
            trainer.save_checkpoint(local)
            if trainer.is_global_zero:
                if spec.checkpoint_path:
                    with open(local, "rb") as f:
                        spec.store.write_bytes(spec.checkpoint_path, payload.pack(f.read()))
                if spec.verbose:
                    progress.epoch_line(trainer.current_epoch, spec.epochs, values)
    return EpochEnd()


def _resume_file(spec: LightningSpec, folder: str) -> Optional[str]:
    """The run's checkpoint from the store, verified and written to a local file, or None."""
    if not spec.checkpoint_path or not spec.store.exists(spec.checkpoint_path):
        return None
    data = payload.unpack(spec.store.read(spec.checkpoint_path),
                          f"the checkpoint {spec.checkpoint_path}")
    path = os.path.join(folder, "resume.ckpt")
    with open(path, "wb") as f:
        f.write(data)
    return path


def train(spec: LightningSpec, module_bytes: bytes) -> LightningResult:
    """Fit the module (pickled by cloudpickle) on this rank (the function each rank of the
    backend runs)."""
    import cloudpickle
    import pytorch_lightning as pl
    import torch
    from hvd_trainer.torch.lightning import HorovodStrategy
    if spec.random_seed is not None:
        pl.seed_everything(spec.random_seed, verbose=False)
    module = cloudpickle.loads(module_bytes)
    strategy = HorovodStrategy()
    import hvd_trainer.torch as hvd
    rank_feeds = feeds(spec, hvd.rank(), hvd.size())
    train_batches = _Batches(rank_feeds.train, rank_feeds.train_steps)
    val_batches = _Batches(rank_feeds.val, rank_feeds.val_steps) if rank_feeds.val else None
    history: List[Dict[str, float]] = []
    # The run's checkpoint is the store's (EpochEnd); Lightning's own only where the user
    # gave a ModelCheckpoint callback, which Lightning refuses with checkpointing off.
    checkpointing = any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in spec.callbacks)
    with tempfile.TemporaryDirectory(prefix="hvd_lightning.") as folder:
        accelerator = "gpu" if spec.use_gpu and torch.cuda.is_available() else "cpu"
        settings = dict(max_epochs=spec.epochs, accelerator=accelerator, devices=1,
                        logger=spec.logger if spec.logger is not None else False,
                        enable_checkpointing=checkpointing, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[*spec.callbacks, _epoch_callback(spec, history, folder)])
        settings.update(spec.trainer_args)
        trainer = pl.Trainer(strategy=strategy, **settings)
        if hvd.rank() == 0 and spec.verbose:
            progress.start_line(spec.epochs, spec.train_rows, spec.batch_size,
                                len(train_batches))
        try:
            trainer.fit(module, train_batches, val_batches, ckpt_path=_resume_file(spec, folder))
        finally:
            rank_feeds.close()
    state = None
    if hvd.rank() == 0:
        out = io.BytesIO()
        torch.save(module.state_dict(), out)
        state = out.getvalue()
    return LightningResult(history, state)
