"""horovod.tensorflow.keras.elastic's API: ``KerasState``, the callbacks that keep it current
during ``model.fit``, and ``run`` (see :mod:`hvd_trainer.tensorflow.elastic`).

A ``model.fit`` inside a function decorated with ``run`` commits through
:class:`CommitStateCallback`; :class:`UpdateBatchStateCallback` and
:class:`UpdateEpochStateCallback` keep ``state.batch`` and ``state.epoch`` where training is,
so that after a reset ``fit(epochs=epochs - state.epoch)`` goes on from the last commit
(without ``initial_epoch``: the callback adds ``fit``'s epoch, counted from 0, to the
state's epoch at the start).
"""
from typing import Any, Dict, Optional

from ..elastic import TensorFlowKerasState, run
from .callbacks import Callback

__all__ = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """The state of a Keras model and optimizer (see :class:`TensorFlowKerasState`)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(Callback):
    """Commit ``state`` after every ``batches_per_commit`` batches and at each epoch's end
    (a collective: every rank runs ``fit`` with it)."""

    def __init__(self, state: Any, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit={batches_per_commit!r}: pass 1 or more")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same count on every rank

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(Callback):
    """Keep ``state.batch`` at the index of the last finished batch of the epoch (0 again at
    its end). Horovod's also shortens the first epoch after a reset by rewriting ``fit``'s
    ``params["steps"]``, which Keras 3's ``fit`` does not read back: a script that resumes in
    the middle of an epoch gives ``fit`` the batches left itself."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(Callback):
    """Keep ``state.epoch`` at the number of epochs finished across resets: the state's
    epoch when ``fit`` began plus ``fit``'s own count (from 0; no ``initial_epoch``)."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
