"""The Keras estimator's training function, run on every rank (horovod.spark.keras.remote).

Each rank rebuilds the model (its JSON and weights) and the optimizer (its config) from the
driver's, multiplies the learning rate by the number of ranks (Horovod's rule; the checkpoint
keeps it unscaled), compiles with hvd_trainer.tensorflow.keras's DistributedOptimizer and fits
on batches of its shard of the prepared Parquet rows, the same number of steps on every rank,
with rank 0's variables broadcast first and the epoch's metrics averaged over the ranks
(Horovod's callbacks). Rank 0 prints an epoch line, writes the checkpoint (weights,
optimizer variables, unscaled rate) to the store after every epoch and returns the history
and the trained weights.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from hvd_trainer.spark.common import payload, progress
from hvd_trainer.spark.common.feed import DataSpec, feeds

__all__ = ["KerasSpec", "KerasResult", "shaped", "train", "unscaled_learning_rate"]


@dataclass
class KerasSpec(DataSpec):
    """What every rank needs to train, besides the data and the model."""
    feature_columns: List[str] = field(default_factory=list)
    label_columns: List[str] = field(default_factory=list)
    sample_weight_col: Optional[str] = None
    label_shapes: Optional[List[List[int]]] = None
    custom_objects: Dict[str, Any] = field(default_factory=dict)
    model_json: str = ""
    weights: List[np.ndarray] = field(default_factory=list)
    optimizer_config: Dict[str, Any] = field(default_factory=dict)
    loss: Any = None
    loss_weights: Any = None
    metrics: List[Any] = field(default_factory=list)
    callbacks: List[Any] = field(default_factory=list)
    gradient_compression: Any = None
    checkpoint: Optional[Dict[str, Any]] = None


@dataclass
class KerasResult:
    """A rank's answer: Keras's history, and (rank 0) the trained weights."""
    history: Dict[str, List[float]]
    weights: Optional[List[np.ndarray]]


def unscaled_learning_rate(optimizer: Any) -> Optional[float]:
    """The optimizer's learning rate as a number (None for a schedule, which is not scaled)."""
    rate = optimizer.learning_rate
    try:
        return float(np.asarray(rate))
    except (TypeError, ValueError):
        return None


def shaped(values: np.ndarray, shape: Any) -> np.ndarray:
    """Rows reshaped to a Keras tensor's shape (its first, batch, dimension left free), when
    the sizes agree."""
    dims = [d for d in list(shape)[1:]]
    if all(d is not None for d in dims) and int(np.prod(dims)) == int(np.prod(values.shape[1:])):
        return values.reshape([len(values), *dims])
    return values


def _batches(reader: Any, steps: int, spec: KerasSpec, model: Any) -> Iterator[tuple]:
    """Endless (inputs, labels[, sample weights]) batches for Keras's fit."""
    label_shapes = spec.label_shapes or [o.shape for o in model.outputs]
    while True:
        for batch in reader.batches(steps):
            inputs = [shaped(batch[c], t.shape) for c, t in zip(spec.feature_columns,
                                                                 model.inputs)]
            labels = [shaped(batch[c], [None, *s[1:]] if spec.label_shapes is None else
                              [None, *s]) for c, s in zip(spec.label_columns, label_shapes)]
            x = inputs[0] if len(inputs) == 1 else inputs
            y = labels[0] if len(labels) == 1 else labels
            if spec.sample_weight_col:
                yield x, y, batch[spec.sample_weight_col]
            else:
                yield x, y


def _build(spec: KerasSpec, hvd: Any) -> tuple:
    """The rank's compiled model and (distributed) optimizer, at the checkpoint if any."""
    import keras
    model = keras.models.model_from_json(spec.model_json, custom_objects=spec.custom_objects)
    model.set_weights(spec.weights)
    base = keras.optimizers.deserialize(spec.optimizer_config,
                                        custom_objects=spec.custom_objects)
    rate = unscaled_learning_rate(base)
    extra = {"compression": spec.gradient_compression} if spec.gradient_compression else {}
    optimizer = hvd.DistributedOptimizer(base, **extra)
    model.compile(optimizer=optimizer, loss=spec.loss, loss_weights=spec.loss_weights,
                  metrics=spec.metrics or None)
    if spec.checkpoint is not None:
        model.set_weights(spec.checkpoint["weights"])
        optimizer.build(model.trainable_variables)
        for variable, value in zip(optimizer.variables, spec.checkpoint["optimizer"]):
            variable.assign(value)
        rate = spec.checkpoint["learning_rate"]
    if rate is not None:
        optimizer.learning_rate = rate * hvd.size()
    return model, optimizer, rate


def _epoch_callback(spec: KerasSpec, model: Any, optimizer: Any, rate: Optional[float]) -> Any:
    """Rank 0's callback after each epoch (its metrics averaged over the ranks by then): the
    checkpoint to the store, and the epoch line."""
    import cloudpickle
    import keras

    class EpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if spec.checkpoint_path:
                state = {"weights": model.get_weights(), "learning_rate": rate,
                         "optimizer": [np.asarray(v) for v in optimizer.variables]}
                spec.store.write_bytes(spec.checkpoint_path,
                                       payload.pack(cloudpickle.dumps(state)))
            if spec.verbose:
                progress.epoch_line(epoch, spec.epochs, {k: float(v) for k, v in
                                                         (logs or {}).items()})
    return EpochEnd()


def train(spec: KerasSpec) -> KerasResult:
    """Train on this rank (the function each rank of the backend runs)."""
    import hvd_trainer.tensorflow.keras as hvd
    hvd.init()
    if spec.random_seed is not None:
        import keras
        keras.utils.set_random_seed(spec.random_seed)
    model, optimizer, rate = _build(spec, hvd)
    rank_feeds = feeds(spec, hvd.rank(), hvd.size())
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=0),
                 hvd.callbacks.MetricAverageCallback(), *spec.callbacks]
    if hvd.rank() == 0:
        callbacks.append(_epoch_callback(spec, model, optimizer, rate))
        if spec.verbose:
            progress.start_line(spec.epochs, spec.train_rows, spec.batch_size,
                                rank_feeds.train_steps)
    validation = {}
    if rank_feeds.val is not None:
        validation = dict(validation_data=_batches(rank_feeds.val, rank_feeds.val_steps, spec,
                                                   model),
                          validation_steps=rank_feeds.val_steps)
    try:
        history = model.fit(_batches(rank_feeds.train, rank_feeds.train_steps, spec, model),
                            steps_per_epoch=rank_feeds.train_steps, epochs=spec.epochs,
                            callbacks=callbacks, verbose=0, **validation)
    finally:
        rank_feeds.close()
    return KerasResult({k: [float(v) for v in vs] for k, vs in history.history.items()},
                       model.get_weights() if hvd.rank() == 0 else None)
