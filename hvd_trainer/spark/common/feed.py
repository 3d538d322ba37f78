"""What a rank needs to read its share of a prepared dataset, whatever the framework: the
store's paths, row counts, batch sizes and steps (the same on every rank), shuffling; and the
rank's readers built from it."""
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional

from hvd_trainer.spark.common.reader import ShardReader

__all__ = ["DataSpec", "Feeds", "feeds"]


@dataclass
class DataSpec:
    """The dataset and its reading, as the driver decided them."""
    store: Any
    train_path: str
    val_path: Optional[str]
    checkpoint_path: Optional[str]
    columns: List[str]
    train_rows: int
    val_rows: int
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps_per_epoch: Optional[int]
    validation_steps_per_epoch: Optional[int]
    shuffle: bool
    shuffle_buffer_size: Optional[int]
    random_seed: Optional[int]
    inmemory_cache_all: bool
    use_gpu: bool
    verbose: int


class Feeds(NamedTuple):
    """A rank's readers and how many batches each epoch takes from them."""
    train: ShardReader
    train_steps: int
    val: Optional[ShardReader]
    val_steps: int

    def close(self) -> None:
        """Stop the readers' reading ahead (ShardReader.close): the rank's training is over."""
        self.train.close()
        if self.val is not None:
            self.val.close()


def feeds(spec: DataSpec, rank: int, size: int) -> Feeds:
    """The rank's readers. An epoch is ``train_rows // (batch_size * size)`` steps (at least
    one) unless given, on every rank; validation reads every row once (rounded up)."""
    def reader(path: str, batch: int, training: bool) -> ShardReader:
        return ShardReader(spec.store.fs, spec.store.parquet_files(path), spec.columns, rank,
                           size, batch, shuffle=training and spec.shuffle,
                           shuffle_buffer_size=spec.shuffle_buffer_size, seed=spec.random_seed,
                           cache=spec.inmemory_cache_all)
    train_steps = spec.train_steps_per_epoch or max(
        1, spec.train_rows // (spec.batch_size * size))
    val, val_steps = None, 0
    if spec.val_path:
        val = reader(spec.val_path, spec.val_batch_size, False)
        val_steps = spec.validation_steps_per_epoch or max(
            1, -(-spec.val_rows // (spec.val_batch_size * size)))
    return Feeds(reader(spec.train_path, spec.batch_size, True), train_steps, val, val_steps)
