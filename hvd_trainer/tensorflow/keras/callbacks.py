"""horovod.keras's callbacks for ``model.fit``, Keras 3's and Keras 2's (tf_keras) alike.

- :class:`BroadcastGlobalVariablesCallback`: every rank starts from the root's weights and
  optimizer state.
- :class:`MetricAverageCallback`: the epoch's logged metrics averaged over the ranks.
- :class:`LearningRateScheduleCallback`, :class:`LearningRateWarmupCallback`: Horovod's
  learning-rate multipliers, by epoch or (without ``staircase``) by batch.

Each is a collective where it reduces or broadcasts: every rank runs ``fit`` with it.
"""
import warnings
from typing import Any, Callable, Dict, Optional, Union

import keras
import numpy as np

from ...collectives.arguments import Average
from ...runtime.runtime import rank, size
from .. import ops
from ..keras2 import Keras2Hooks, legacy_momentum, optimizer_variables, set_legacy_momentum

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]


def _variables(owner: Any) -> list:
    return list(getattr(owner, "variables", []) or [])


class Callback(Keras2Hooks, keras.callbacks.Callback):
    """A Keras 3 callback that Keras 2's ``fit`` takes too."""


class BroadcastGlobalVariablesCallback(Callback):
    """At the start of training, overwrite every rank's model weights and optimizer
    variables with ``root_rank``'s (a global rank). Horovod broadcasts after the first batch;
    Keras 3 builds the model and optimizer before training, so here no rank takes a step from
    its own weights. A Keras 2 model built by its first batch is broadcast after that batch,
    as in Horovod. ``local_variables`` (a variable or a list of them) and those given to
    :meth:`register_local_var` keep each rank's value. ``device`` has no effect."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None):
        super().__init__()
        self.root_rank = root_rank
        self._local = set()
        self.broadcast_done = False
        if local_variables is not None:
            single = hasattr(local_variables, "assign")
            for var in [local_variables] if single else local_variables:
                self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast (a worker-local variable)."""
        self._local.add(id(var))

    def _broadcast(self) -> None:
        variables = [v for v in _variables(self.model) if id(v) not in self._local]
        variables += optimizer_variables(getattr(self.model, "optimizer", None))
        ops.broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if getattr(self.model, "built", True):  # Keras 2 builds some models at the first batch
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(Callback):
    """At the end of each epoch, replace every metric in the logs by its average over the
    ranks (in sorted order of the names, the same on every rank). Put it before callbacks
    that read the metrics (checkpoints, early stopping). ``device`` has no effect."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs:
            return
        names = sorted(logs)
        values = np.array([float(logs[n]) for n in names], np.float64)
        averaged = ops.allreduce(values, op=Average, name="MetricAverageCallback")
        for n, v in zip(names, np.asarray(averaged)):
            logs[n] = float(v)


class LearningRateScheduleCallback(Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch`` (exclusive): at each epoch's first batch with ``staircase``, otherwise at
    every batch with a fractional epoch (``steps_per_epoch`` from ``fit``'s if not given).
    A number ``multiplier`` m means ``m ** (epoch - start_epoch)``.

    ``momentum_correction`` (Horovod scales momentum by the change of learning rate for one
    batch) applies where the optimizer reads its momentum at each step (Keras 2's legacy
    optimizers); Keras 3's and Keras 2's SGD keep it as a number compiled into the training
    step, so there it is skipped, with a warning.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: Optional[float] = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _set_lr(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        new_lr = self.initial_lr * self.multiplier(epoch)
        momentum = legacy_momentum(optimizer) if self.momentum_correction else None
        old_lr = float(np.asarray(optimizer.learning_rate)) if momentum is not None else 0.0
        if old_lr:
            self.restore_momentum = momentum
            set_legacy_momentum(optimizer, momentum * new_lr / old_lr)
        optimizer.learning_rate = new_lr

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__}: fit() does not say its steps per "
                                 "epoch; pass steps_per_epoch=")
        momentum = getattr(self.model.optimizer, "momentum", None)
        if (self.momentum_correction and isinstance(momentum, (int, float)) and momentum
                and legacy_momentum(self.model.optimizer) is None):
            warnings.warn(f"{type(self).__name__}: momentum_correction is skipped: the "
                          "optimizer's momentum is a number compiled into the training step")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._set_lr(epoch)
        elif not self.staircase:
            self._set_lr(epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.restore_momentum is not None:
            set_legacy_momentum(self.model.optimizer, self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warmup: over ``warmup_epochs`` the learning rate rises by batch from
    ``initial_lr / size`` to ``initial_lr`` (``initial_lr`` being the rate scaled for all
    ranks). ``verbose`` prints, on rank 0, when it ends."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{logs['lr'] if logs else self.initial_lr:g}.")
