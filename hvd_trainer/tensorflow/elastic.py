"""horovod.tensorflow.elastic's API: ``TensorFlowKerasState``, ``TensorFlowState``, and the
framework-free core's ``run``, ``State``, ``ObjectState`` and errors.

``hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)`` keeps a Keras 3 or
Keras 2 (tf_keras) model's variables (weights and non-trainable state), its optimizer's
variables (step count, moments) and any picklable attributes across a reset of the job;
``TensorFlowState(variables, ...)`` keeps a list of ``tf.Variable``. A commit holds their
values as NumPy arrays; a restore assigns them back into the script's own objects, so
``tf.function`` steps traced on them stay valid (see :mod:`hvd_trainer.elastic` for commits,
``run`` and restarts).
"""
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run
from .keras2 import build_optimizer, optimizer_variables

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]


def _values(variables: Sequence[Any]) -> List[np.ndarray]:
    """The variables' values, as read-only views where TF gives them: a commit copies them."""
    return [np.asarray(tf.convert_to_tensor(v)) for v in variables]


def _assign(variables: Sequence[Any], values: Sequence[np.ndarray], what: str) -> None:
    if len(variables) != len(values):
        raise ValueError(f"{what}: the commit holds {len(values)} variables, this process has "
                         f"{len(variables)}; restore into the model and optimizer the commit "
                         "was made from")
    for i, (variable, value) in enumerate(zip(variables, values)):
        if tuple(variable.shape) != value.shape:
            name = getattr(variable, "path", None) or variable.name
            raise ValueError(f"{what}: variable {i} ({name}) has shape {tuple(variable.shape)}, "
                             f"the commit {value.shape}")
        variable.assign(value)


class TensorFlowKerasState(ObjectState):
    """The state of a Keras 3 or Keras 2 model and its optimizer (horovod.tensorflow.elastic's).

    ``model`` must be built. ``optimizer`` defaults to the model's compiled one; it may be
    unbuilt (no step taken yet), in which case a restore of a commit made after the first
    step builds it for the model's trainable variables first. Keyword values are picklable
    attributes, as in :class:`~hvd_trainer.elastic.ObjectState`. ``backend`` (TF1's Keras
    backend, for a session) is accepted for Horovod's sake and has no effect.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        if not getattr(model, "built", True):
            raise ValueError("TensorFlowKerasState: the model is not built; call "
                             "model.build(input_shape) (or run it on a batch) first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        super().__init__(**kwargs)

    def _optimizer_variables(self) -> List[Any]:
        return optimizer_variables(self.optimizer)

    def save(self) -> Dict[str, Any]:
        snapshot = super().save()
        snapshot["_model"] = _values(self.model.variables)
        snapshot["_optimizer"] = _values(self._optimizer_variables())
        return snapshot

    def load(self, snapshot: Dict[str, Any]) -> None:
        super().load(snapshot)
        _assign(self.model.variables, snapshot["_model"], "TensorFlowKerasState's model")
        saved = snapshot["_optimizer"]
        if saved and self.optimizer is not None and not self._optimizer_variables():
            build_optimizer(self.optimizer, self.model.trainable_variables)
        if saved or self._optimizer_variables():
            _assign(self._optimizer_variables(), saved, "TensorFlowKerasState's optimizer")


class TensorFlowState(ObjectState):
    """The state of a list of ``tf.Variable`` (horovod.tensorflow.elastic's), eager only.

    Keyword values are picklable attributes. ``variables`` is required: TF1's global
    variables and ``session`` are not supported.
    """

    def __init__(self, variables: Optional[Sequence[Any]] = None, session: Any = None,
                 **kwargs: Any):
        if variables is None:
            raise ValueError("TensorFlowState: pass variables= (TF1's global variables are not "
                             "supported)")
        if session is not None or not tf.executing_eagerly():
            raise ValueError("TensorFlowState runs eagerly only: TF1 sessions are not "
                             "supported")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def save(self) -> Dict[str, Any]:
        snapshot = super().save()
        snapshot["_variables"] = _values(self.variables)
        return snapshot

    def load(self, snapshot: Dict[str, Any]) -> None:
        super().load(snapshot)
        _assign(self.variables, snapshot["_variables"], "TensorFlowState")
