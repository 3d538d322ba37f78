"""Keras 2 (the ``tf_keras`` package) under horovod.tensorflow.keras's API.

``tf.keras`` is Keras 2 when ``TF_USE_LEGACY_KERAS=1`` is set and tf-keras is installed, or a
script imports ``tf_keras`` itself; ``import keras`` stays Keras 3. Which Keras an optimizer
belongs to is read from its class's module (``tf_keras...``), never from versions.

A Keras 2 ``DistributedOptimizer`` reduces where Horovod's does: in ``compute_gradients``
(``minimize`` and ``model.fit`` call it; the legacy optimizers' ``_compute_gradients`` and
``get_gradients`` too), so ``apply_gradients`` applies what it is given. With
``backward_passes_per_step`` N > 1 the gradients add up locally and are reduced every N-th
pass (aggregation.py).
"""
from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf

from .aggregation import LocalAggregation
from .gradients import Reduction


def is_keras2_class(cls: type) -> bool:
    """Whether ``cls`` is or derives from a tf_keras class."""
    return any(c.__module__.startswith("tf_keras.") for c in cls.__mro__)


def is_keras2(obj: Any) -> bool:
    """Whether ``obj`` (an optimizer, model or callback) is an instance of a tf_keras class."""
    return is_keras2_class(type(obj))


def is_keras2_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Keras 2 optimizer: tf_keras's, or its legacy ones."""
    return is_keras2(optimizer) and hasattr(optimizer, "apply_gradients")


def optimizer_variables(optimizer: Any) -> List[Any]:
    """The variables an optimizer holds now (none before its first step): Keras 3's and
    Keras 2's have ``variables`` as a list, Keras 2's legacy ones as a method."""
    if optimizer is None or not getattr(optimizer, "built", getattr(optimizer, "_built", True)):
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) and not isinstance(variables, list)
                else variables)


def legacy_momentum(optimizer: Any) -> Optional[float]:
    """A Keras 2 legacy optimizer's momentum, a hyperparameter it reads at each step; None for
    other optimizers."""
    if "momentum" not in (getattr(optimizer, "_hyper", None) or {}):
        return None
    return float(np.asarray(optimizer._get_hyper("momentum")))


def set_legacy_momentum(optimizer: Any, value: float) -> None:
    """Set a Keras 2 legacy optimizer's momentum hyperparameter."""
    optimizer._set_hyper("momentum", value)


def build_optimizer(optimizer: Any, variables: List[Any]) -> None:
    """Create ``optimizer``'s state for ``variables`` before its first step (to restore into)."""
    if hasattr(optimizer, "_create_all_weights"):  # Keras 2's legacy optimizers
        optimizer._create_all_weights(variables)
    else:
        optimizer.build(variables)


class Keras2Hooks:
    """What Keras 2's ``fit`` asks of a callback beyond Keras 3's: whether it has batch hooks
    (Keras 2 calls them only then). Mixed into the adapter's callbacks, which both take."""

    _BATCH_HOOKS = {"train": ("on_batch_begin", "on_batch_end", "on_train_batch_begin",
                              "on_train_batch_end"),
                    "test": ("on_test_batch_begin", "on_test_batch_end"),
                    "predict": ("on_predict_batch_begin", "on_predict_batch_end")}

    def _overrides(self, kind: str) -> bool:
        import keras
        return any(getattr(type(self), hook) is not getattr(keras.callbacks.Callback, hook)
                   for hook in self._BATCH_HOOKS[kind])

    def _implements_train_batch_hooks(self) -> bool:
        return self._overrides("train")

    def _implements_test_batch_hooks(self) -> bool:
        return self._overrides("test")

    def _implements_predict_batch_hooks(self) -> bool:
        return self._overrides("predict")


class Keras2Distributed:
    """What DistributedOptimizer adds to a Keras 2 optimizer's class; the reduction's settings
    are the class's (``_hvd_settings``, ``_hvd_scale_local``), so ``from_config`` rebuilds it
    too."""

    _hvd_settings: Dict[str, Any] = {}
    _hvd_passes = 1
    _hvd_average_aggregated = False
    _hvd_scale_local = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hvd_local: set = set()
        self._hvd_made = Reduction("DistributedOptimizer.", **self._hvd_settings)
        # Horovod's name, which its tests read.
        self._agg_helper = (LocalAggregation(self._hvd_passes, self._hvd_average_aggregated)
                            if self._hvd_passes > 1 else None)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: it is not reduced, only divided by the set's size
        when the optimizer was made with ``scale_local_gradients=True`` (the default)."""
        self._hvd_local.add(id(var))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> List[Any]:
        """The wrapped optimizer's gradients, reduced across the process set: a collective."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> List[Any]:
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):  # the legacy optimizers
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        grads, variables = zip(*pairs)
        return list(zip(self._hvd_reduce(list(grads), list(variables)), variables))

    def get_gradients(self, loss: Any, params: Any) -> List[Any]:
        """The legacy optimizers' symbolic gradients, reduced across the process set."""
        return self._hvd_reduce(list(super().get_gradients(loss, params)), list(params))

    def _hvd_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        def reduce(values: List[Any]) -> List[Any]:
            return self._hvd_made.reduce_shared(values, variables, self._hvd_local,
                                                self._hvd_scale_local)
        if self._agg_helper is None:
            return reduce(grads)
        return self._agg_helper.compute_gradients(grads, variables, reduce,
                                                  sparse_as_dense=self._hvd_made.sparse_as_dense)

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's step; with ``backward_passes_per_step`` N, only on every
        N-th pass (the others count an iteration, as Horovod's)."""
        if self._agg_helper is None:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        base = super()
        return self._agg_helper.apply_gradients(
            lambda: base.apply_gradients(pairs, *args, **kwargs), self.iterations)


def distributed_class(base: type, settings: Dict[str, Any], passes: int,
                      average_aggregated: bool, classes: Dict[Any, type],
                      scale_local: bool = True) -> type:
    """``base`` (a Keras 2 optimizer class) with :class:`Keras2Distributed` in front, named
    and placed as ``base`` so that a saved model names the plain optimizer; cached in
    ``classes`` by its settings (``scale_local``: Horovod's ``scale_local_gradients``)."""
    key = (base, passes, average_aggregated, scale_local,
           tuple(sorted((k, id(v) if k == "process_set" else v) for k, v in settings.items())))
    if key not in classes:
        classes[key] = type(base.__name__, (Keras2Distributed, base),
                            {"__doc__": base.__doc__, "__module__": base.__module__,
                             "_hvd_settings": dict(settings), "_hvd_passes": passes,
                             "_hvd_average_aggregated": average_aggregated,
                             "_hvd_scale_local": scale_local})
    return classes[key]


def keras2_models(custom_optimizers: List[type]) -> Optional[Any]:
    """tf_keras's ``models`` module when ``tf.keras`` is Keras 2 or a custom optimizer class
    is a Keras 2 one, else None."""
    if any(is_keras2_class(c) for c in custom_optimizers):
        import tf_keras
        return tf_keras.models
    models = tf.keras.models
    return models if models.__name__.startswith("tf_keras.") else None


def optimizer_classes(custom_optimizers: List[type]) -> List[type]:
    """Keras 2's optimizer classes and ``custom_optimizers``, in the order in which a name
    (``SGD``) found twice is taken from the last: the legacy ones, tf_keras's, the custom."""
    import tf_keras
    found = []
    for module in (tf_keras.optimizers.legacy, tf_keras.optimizers):
        found += [c for c in vars(module).values() if isinstance(c, type)
                  and hasattr(c, "apply_gradients") and is_keras2_class(c)]
    return found + list(custom_optimizers)
