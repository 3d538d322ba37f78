"""The torch estimator's training function, run on every rank (horovod.spark.torch.remote).

Each rank builds the model and optimizer from the driver's (or the run's checkpoint), scales
the learning rate by the number of ranks (Horovod's rule; the checkpoint keeps the rate
unscaled, so a run may resume on another number of ranks: Horovod 0.28.1 resumes with the
unscaled rate, hvd_trainer scales it again), takes rank 0's weights, wraps the
optimizer in hvd_trainer.torch's DistributedOptimizer and trains for ``epochs`` of the same
number of steps on every rank over its shard of the prepared Parquet rows
(:class:`hvd_trainer.spark.common.reader.ShardReader`). Losses and metrics are averaged over
the ranks after every step, so the history is the same on every rank. Rank 0 writes the
checkpoint after every epoch (atomically) and prints an epoch line; it returns the history and
the last checkpoint.

The helper factories keep Horovod's names (``_calculate_loss_fn``, ``_metric_cls``...), which
Horovod's tests call as attributes of horovod.spark.torch.remote: they are in ``__all__``,
which is what hvdrun --horovod's shim carries.
"""
import io
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from hvd_trainer.spark.common import payload, progress
from hvd_trainer.spark.common.feed import DataSpec, feeds

__all__ = ["TrainSpec", "RankResult", "train", "_calculate_loss_fn",
           "_get_optimizer_with_unscaled_lr_fn", "_metric_cls",
           "_construct_metric_value_holders_fn", "_get_metric_avgs_fn", "_update_metrics_fn",
           "_prepare_np_data_fn", "_train_minibatch_fn"]


@dataclass
class TrainSpec(DataSpec):
    """What every rank needs to train, besides the data, the model and the optimizer."""
    feature_columns: List[str] = field(default_factory=list)
    label_columns: List[str] = field(default_factory=list)
    sample_weight_col: Optional[str] = None
    input_shapes: Optional[List[List[int]]] = None
    label_shapes: Optional[List[List[int]]] = None
    loss_fns: List[Callable] = field(default_factory=list)
    loss_constructors: List[Callable] = field(default_factory=list)
    loss_weights: List[float] = field(default_factory=list)
    metric_fn_groups: List[List[Callable]] = field(default_factory=list)
    backward_passes_per_step: int = 1
    gradient_compression: Any = None
    train_minibatch_fn: Optional[Callable] = None


@dataclass
class RankResult:
    """A rank's answer: the per-epoch history, and (rank 0) the last checkpoint's bytes."""
    history: List[Dict[str, Any]]
    checkpoint: Optional[bytes]


def _calculate_loss_fn() -> Callable:
    """Horovod's loss: the weighted sum over outputs of each output's loss; with sample
    weights, each row's loss times its weight, averaged over the batch."""
    def calculate_loss(outputs, labels, loss_weights, loss_fns, sample_weights=None):
        losses = []
        for output, label, loss_fn, weight in zip(outputs, labels, loss_fns, loss_weights):
            if sample_weights is None:
                losses.append(loss_fn(output, label) * weight)
            else:
                rows = loss_fn(output, label, reduction="none").flatten() * sample_weights
                losses.append(rows.mean() * weight)
        return sum(losses)
    return calculate_loss


def _get_optimizer_with_unscaled_lr_fn() -> Callable:
    """A copy of an optimizer (on ``model``'s parameters) with its learning rates divided by
    the number of ranks: what the checkpoint keeps, so a run can resume on another count."""
    def get_optimizer_with_unscaled_lr(hvd, current_optimizer, optimizer_cls, model):
        state = current_optimizer.state_dict()
        for group in state["param_groups"]:
            group["lr"] = group["lr"] / hvd.size()
        optimizer = optimizer_cls(model.parameters(), lr=1)
        optimizer.load_state_dict(state)
        return optimizer
    return get_optimizer_with_unscaled_lr


def _metric_cls() -> type:
    """A running mean of a value averaged over the ranks (hvd.allreduce) at every update."""
    import torch

    class Metric:
        def __init__(self, name, hvd):
            self.name, self.hvd = name, hvd
            self.sum, self.n = torch.tensor(0.), torch.tensor(0.)

        def update(self, val):
            self.sum += self.hvd.allreduce(val.detach().cpu(), name=self.name)
            self.n += 1

        @property
        def avg(self):
            return self.sum / self.n
    return Metric


def _construct_metric_value_holders_fn() -> Callable:
    """One Metric per metric group and label column, named group_G_LABEL."""
    def construct_metric_value_holders(metric_class, metric_fn_groups, label_columns, hvd):
        return [[metric_class(f"group_{number}_{label}", hvd) for label in label_columns]
                for number, _ in enumerate(metric_fn_groups)]
    return construct_metric_value_holders


def _get_metric_avgs_fn() -> Callable:
    def get_metric_avgs(metric_value_groups):
        return [{metric.name: metric.avg.item() for metric in group}
                for group in metric_value_groups]
    return get_metric_avgs


def _update_metrics_fn(metric_fn_groups: Sequence[Sequence[Callable]]) -> Callable:
    """Update each group's metrics with its functions' values on (output, label): a group of
    one function applies it to every output."""
    def update_metrics(metric_value_groups, outputs, labels):
        for functions, values in zip(metric_fn_groups, metric_value_groups):
            if len(functions) == 1:
                functions = [functions[0]] * len(outputs)
            for value, function, output, label in zip(values, functions, outputs, labels):
                value.update(function(output, label))
        return metric_value_groups
    return update_metrics


def _prepare_np_data_fn() -> Callable:
    """Horovod's conversion of a column read back; rows are written dense, so unchanged."""
    def prepare_np_data(rows, col_name, metadata):
        return rows
    return prepare_np_data


def _train_minibatch_fn() -> Callable:
    """One step of ``backward_passes_per_step``: the update runs at the start of the next
    group of passes (and after the epoch's last step)."""
    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels,
                        sample_weights, backward_passes_per_step, batch_idx):
        if batch_idx % backward_passes_per_step == 0:
            if batch_idx != 0:
                optimizer.step()
            optimizer.zero_grad()
        outputs, labels = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, labels, sample_weights)
        if backward_passes_per_step > 1:
            loss.div_(float(backward_passes_per_step))
        loss.backward()
        return outputs, loss
    return train_minibatch


def _transform_outputs(label_shapes: Optional[List[List[int]]]) -> Callable:
    """Outputs as a list, and labels reshaped to the outputs (or to ``label_shapes``)."""
    def transform_outputs(outputs, labels):
        if not isinstance(outputs, (tuple, list)):
            outputs = [outputs]
        if label_shapes:
            labels = [label.reshape(shape) for label, shape in zip(labels, label_shapes)]
        else:
            labels = [label.reshape(output.shape) if output.numel() == label.numel() else label
                      for label, output in zip(labels, outputs)]
        return outputs, labels
    return transform_outputs


def _tensors(batch: Dict[str, np.ndarray], spec: TrainSpec, device: Any) -> tuple:
    """(inputs, labels, sample weights) of a batch, as float32 tensors (Horovod's)."""
    import torch
    shapes = spec.input_shapes or [None] * len(spec.feature_columns)
    inputs = []
    for column, shape in zip(spec.feature_columns, shapes):
        tensor = torch.tensor(batch[column]).float()
        inputs.append((tensor.reshape(shape) if shape else tensor).to(device))
    labels = [torch.tensor(batch[c]).float().to(device)
              for c in spec.label_columns]
    weights = None
    if spec.sample_weight_col:
        weights = torch.tensor(batch[spec.sample_weight_col]).float().to(device)
    return inputs, labels, weights


class _Loop:
    """The rank's model, optimizer and readers, and one epoch of training or validation."""

    def __init__(self, spec: TrainSpec, model: Any, optimizer: Any, hvd: Any,
                 device: Any) -> None:
        self.spec, self.model, self.optimizer, self.hvd, self.device = \
            spec, model, optimizer, hvd, device
        self.metric_cls = _metric_cls()
        self.update_metrics = _update_metrics_fn(spec.metric_fn_groups)
        self.calculate_loss = _calculate_loss_fn()
        self.transform_outputs = _transform_outputs(spec.label_shapes)
        self.minibatch = (spec.train_minibatch_fn or _train_minibatch_fn)()
        self.feeds = feeds(spec, hvd.rank(), hvd.size())

    def loss_fn(self, outputs, labels, sample_weights):
        return self.calculate_loss(outputs, labels, self.spec.loss_weights,
                                   self.spec.loss_fns, sample_weights)

    def _summary(self, loss: Any, groups: List[List[Any]]) -> Dict[str, Any]:
        return {loss.name: loss.avg.item(), "all_metrics": _get_metric_avgs_fn()(groups)}

    def train_epoch(self) -> Dict[str, Any]:
        import torch
        self.model.train()
        loss_metric = self.metric_cls("loss", self.hvd)
        groups = _construct_metric_value_holders_fn()(
            self.metric_cls, self.spec.metric_fn_groups, self.spec.label_columns, self.hvd)
        for step, batch in enumerate(self.feeds.train.batches(self.feeds.train_steps)):
            inputs, labels, weights = _tensors(batch, self.spec, self.device)
            outputs, loss = self.minibatch(self.model, self.optimizer, self.transform_outputs,
                                           self.loss_fn, inputs, labels, weights,
                                           self.spec.backward_passes_per_step, step)
            with torch.no_grad():
                self.update_metrics(groups, outputs, labels)
            loss_metric.update(loss)
        self.optimizer.step()
        return self._summary(loss_metric, groups)

    def validate_epoch(self) -> Dict[str, Any]:
        import torch
        self.model.eval()
        loss_metric = self.metric_cls("loss", self.hvd)
        groups = _construct_metric_value_holders_fn()(
            self.metric_cls, self.spec.metric_fn_groups, self.spec.label_columns, self.hvd)
        with torch.no_grad():
            for batch in self.feeds.val.batches(self.feeds.val_steps):
                inputs, labels, weights = _tensors(batch, self.spec, self.device)
                outputs, labels = self.transform_outputs(self.model(*inputs), labels)
                loss_metric.update(self.loss_fn(outputs, labels, weights))
                self.update_metrics(groups, outputs, labels)
        return self._summary(loss_metric, groups)


def _setup(spec: TrainSpec, model: Any, optimizer_cls: type, state: Dict[str, Any],
           hvd: Any) -> tuple:
    """The rank's device, model and DistributedOptimizer, starting from rank 0's weights."""
    import torch
    device = torch.device("cpu")
    if spec.use_gpu and torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    model.load_state_dict(state["model"])
    model.to(device)
    optimizer = optimizer_cls(model.parameters(), lr=1)
    optimizer_state = state["optimizer"]
    for group in optimizer_state["param_groups"]:  # a checkpoint keeps the unscaled rate
        group["lr"] = group["lr"] * hvd.size()
    optimizer.load_state_dict(optimizer_state)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model)
    extra = {"compression": spec.gradient_compression} if spec.gradient_compression else {}
    distributed = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        backward_passes_per_step=spec.backward_passes_per_step, **extra)
    return device, model, optimizer_cls, distributed


def _checkpoint(hvd: Any, model: Any, optimizer: Any, optimizer_cls: type) -> bytes:
    """The model's and (unscaled) optimizer's states, as torch.save writes them."""
    import torch
    unscaled = _get_optimizer_with_unscaled_lr_fn()(hvd, optimizer, optimizer_cls, model)
    out = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": unscaled.state_dict()}, out)
    return out.getvalue()


def _flat(record: Dict[str, Any]) -> Dict[str, float]:
    """An epoch's record as one level of names (val_ before validation's), for its line."""
    flat = {}
    for phase, prefix in (("train", ""), ("validation", "val_")):
        summary = record.get(phase)
        if summary:
            flat[f"{prefix}loss"] = summary["loss"]
            for group in summary["all_metrics"]:
                flat.update({f"{prefix}{name}": value for name, value in group.items()})
    return flat


def train(spec: TrainSpec, model_bytes: bytes, optimizer_cls: type,
          state_bytes: bytes) -> RankResult:
    """Train on this rank (the function each rank of the backend runs): the model pickled
    (cloudpickle), the optimizer's class, the states of both (torch.save)."""
    import cloudpickle
    import torch
    import hvd_trainer.torch as hvd
    model = cloudpickle.loads(model_bytes)
    if spec.random_seed is not None:
        torch.manual_seed(spec.random_seed)
    hvd.init()
    state = torch.load(io.BytesIO(state_bytes), weights_only=True)
    if spec.loss_constructors:
        spec.loss_fns = [construct() for construct in spec.loss_constructors]
    device, model, optimizer_cls, optimizer = _setup(spec, model, optimizer_cls, state, hvd)
    loop = _Loop(spec, model, optimizer, hvd, device)
    if hvd.rank() == 0 and spec.verbose:
        progress.start_line(spec.epochs, spec.train_rows, spec.batch_size,
                            loop.feeds.train_steps)
    history, checkpoint = [], None
    try:
        for epoch in range(spec.epochs):
            record = {"epoch": epoch, "train": loop.train_epoch()}
            if loop.feeds.val is not None:
                record["validation"] = loop.validate_epoch()
            history.append(record)
            if hvd.rank() == 0:
                checkpoint = _checkpoint(hvd, model, optimizer, optimizer_cls)
                if spec.checkpoint_path:
                    spec.store.write_bytes(spec.checkpoint_path, payload.pack(checkpoint))
                if spec.verbose:
                    progress.epoch_line(epoch, spec.epochs, _flat(record))
    finally:
        loop.feeds.close()
    return RankResult(history, checkpoint)
