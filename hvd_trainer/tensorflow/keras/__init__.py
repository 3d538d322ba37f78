"""horovod.tensorflow.keras's API on Keras 3 (TensorFlow backend) and on Keras 2 (tf_keras,
see ``hvd_trainer/tensorflow/keras2.py``): ``DistributedOptimizer`` for ``model.fit`` and
custom loops, the callbacks, ``load_model``, and the collectives of :mod:`hvd_trainer.tensorflow`.

``DistributedOptimizer(opt)`` returns an optimizer of a subclass of ``opt``'s class, built
from ``opt.get_config()``, whose ``apply`` (which ``apply_gradients`` and ``model.fit`` call)
first reduces the gradients across the process set with the core's reducer (see
``hvd_trainer/tensorflow/gradients.py``): Average by default, so N ranks with per-rank batch
B take the step one process takes with batch N·B. A Keras 2 optimizer (its class from
``tf_keras``) gets Keras 2's ``DistributedOptimizer``, which reduces in ``compute_gradients``
as Horovod's does.
"""
from typing import Any, Dict, Optional, Sequence

import keras

from ...collectives.arguments import Average, Sum
from ...coordination.process_sets import add_process_set, init, remove_process_set
from ...runtime.runtime import (ProcessSet, ccl_built, cross_rank, cross_size, cuda_built,
                                ddl_built, gloo_built, gloo_enabled, global_process_set,
                                is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from ...runtime.timeline import start_timeline, stop_timeline
from ..bridge import plain_python
from ..compression import Compression
from ..gradients import Reduction
from .. import keras2
from ..tape import local_layers_of
from ..ops import (allgather, allgather_object, allreduce, alltoall, broadcast, broadcast_object,
                   broadcast_variables, grouped_allreduce, reducescatter)
from . import elastic
from .callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                        LearningRateWarmupCallback, MetricAverageCallback)


class _Distributed:
    """What DistributedOptimizer adds to the wrapped optimizer's class; the reduction's
    settings are the class's (``_hvd_settings``), so ``from_config`` rebuilds it too. The
    variables registered as local and ``scale_local_gradients`` are the instance's."""

    _hvd_settings: Dict[str, Any] = {}

    @plain_python
    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None
              ) -> Any:
        """Reduce ``grads`` across the process set (except those of local variables, see
        :meth:`register_local_var`), then the wrapped optimizer's ``apply``. A collective:
        every rank of the set calls it, with the same variables."""
        grads = list(grads)
        variables = (self._trainable_variables if trainable_variables is None
                     else list(trainable_variables))
        if grads and len(grads) == len(variables):
            grads = self._hvd_reduction().reduce_shared(
                grads, variables, self.__dict__.get("_hvd_local", set()),
                self.__dict__.get("_hvd_scale_local", True))
        return super().apply(grads, trainable_variables)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: it is not reduced, only divided by the set's size
        when the optimizer was made with ``scale_local_gradients=True`` (the default)."""
        self.__dict__.setdefault("_hvd_local", set()).add(id(var))

    def _hvd_reduction(self) -> Reduction:
        reduction = self.__dict__.get("_hvd_reduction_made")
        if reduction is None:
            reduction = Reduction("DistributedOptimizer.", **self._hvd_settings)
            self.__dict__["_hvd_reduction_made"] = reduction
        return reduction


_classes: Dict[Any, type] = {}


def _distributed_class(base: type, settings: Dict[str, Any]) -> type:
    """``base`` with :class:`_Distributed` in front and ``settings``; named and placed as
    ``base``, so that a saved model names the plain optimizer."""
    key = (base, tuple(sorted((k, id(v) if k == "process_set" else v)
                              for k, v in settings.items())))
    if key not in _classes:
        _classes[key] = type(base.__name__, (_Distributed, base),
                             {"__doc__": base.__doc__, "__module__": base.__module__,
                              "_hvd_settings": dict(settings)})
    return _classes[key]


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A Keras 3 optimizer like ``optimizer`` (same class and config) whose updates apply
    gradients averaged (``op=Average``) or summed (``op=Sum``) over ``process_set``.

    ``compression``, ``sparse_as_dense``, ``gradient_predivide_factor`` and ``num_groups``
    (``groups`` as an integer) are those of ``DistributedGradientTape``, and
    ``scale_local_gradients`` that of the variables given to ``register_local_var``.
    ``backward_passes_per_step`` must be 1: Keras 3's own ``gradient_accumulation_steps``
    accumulates the reduced gradients instead. ``name``, ``device_dense``,
    ``device_sparse`` and ``average_aggregated_gradients`` are accepted and have no effect.
    Build it before the optimizer has taken a step: the new optimizer starts without state.

    A Keras 2 optimizer (tf_keras's, its legacy ones included) is wrapped as Horovod wraps
    it: gradients reduced in ``compute_gradients``, ``backward_passes_per_step`` passes
    summed locally (averaged with ``average_aggregated_gradients``) between reductions.
    """
    keras2_optimizer = keras2.is_keras2_optimizer(optimizer)
    if not keras2_optimizer and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a Keras 3 optimizer (keras.optimizers.Optimizer) "
                        f"or a Keras 2 one (tf_keras.optimizers.Optimizer, or a legacy one), "
                        f"got {type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, (_Distributed, keras2.Keras2Distributed)):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap it only once")
    if backward_passes_per_step != 1 and not keras2_optimizer:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: pass 1 and "
                         "give the Keras optimizer gradient_accumulation_steps="
                         f"{backward_passes_per_step} instead")
    if groups is not None:
        if isinstance(groups, list):
            raise ValueError("groups= as lists of variables is not supported; pass "
                             "num_groups= (an integer)")
        num_groups = groups
    settings = dict(compression=compression, sparse_as_dense=bool(sparse_as_dense), op=op,
                    gradient_predivide_factor=float(gradient_predivide_factor),
                    num_groups=int(num_groups), process_set=process_set)
    Reduction("DistributedOptimizer.", **settings)  # refuses bad settings here
    if keras2_optimizer:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: pass 1 "
                             "or more")
        cls = keras2.distributed_class(type(optimizer), settings, int(backward_passes_per_step),
                                       bool(average_aggregated_gradients), _classes,
                                       bool(scale_local_gradients))
        return cls.from_config(optimizer.get_config())
    cls = _distributed_class(type(optimizer), settings)
    distributed = cls.from_config(optimizer.get_config())
    distributed.__dict__["_hvd_scale_local"] = bool(scale_local_gradients)
    return distributed


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer,
                                name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A :func:`DistributedOptimizer` whose gradients of ``local_layers``' trainable weights
    (a Keras layer or a list of them) stay local (horovod.keras's)."""
    layers = local_layers_of(local_layers)
    distributed = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            distributed.register_local_var(weight)
    return distributed


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None,
               compression: Any = Compression.none, **kwargs: Any) -> keras.Model:
    """``keras.models.load_model(filepath)`` with its optimizer wrapped in a
    DistributedOptimizer (with ``compression``), as Horovod's ``load_model``: Keras's own
    optimizers and ``custom_optimizers`` are rebuilt as distributed ones. Keras 2's
    ``load_model`` where ``tf.keras`` is Keras 2 (``TF_USE_LEGACY_KERAS=1``) or a custom
    optimizer is a Keras 2 class; Keras 3's otherwise."""
    settings = dict(compression=compression, sparse_as_dense=False, op=Average,
                    gradient_predivide_factor=1.0, num_groups=0,
                    process_set=global_process_set)
    custom = list(custom_optimizers or [])
    models = keras2.keras2_models(custom)
    if models is not None:
        # Keras 2 looks its built-in optimizers up by their lower-case names.
        objects = {name: keras2.distributed_class(c, settings, 1, False, _classes)
                   for c in keras2.optimizer_classes(custom)
                   for name in (c.__name__, c.__name__.lower())}
    else:
        bases = [c for c in vars(keras.optimizers).values()
                 if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)] + custom
        objects = {c.__name__: _distributed_class(c, settings) for c in bases}
        models = keras.models
    objects.update(custom_objects or {})
    return models.load_model(filepath, custom_objects=objects, **kwargs)


__all__ = ["Average", "BroadcastGlobalVariablesCallback", "Compression", "DistributedOptimizer",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
           "PartialDistributedOptimizer", "ProcessSet", "Sum", "add_process_set", "allgather",
           "allgather_object", "allreduce", "alltoall", "broadcast", "broadcast_object",
           "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
           "grouped_allreduce", "init", "is_initialized", "load_model", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
           "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size",
           "start_timeline", "stop_timeline"]
