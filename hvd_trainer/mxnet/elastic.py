"""horovod.elastic's API for Gluon: ``GluonState`` plus the framework-free core's names.

``hvd.elastic.GluonState(net, trainer, epoch=0)`` keeps the weights, the trainer's optimizer
states and compression residuals, and any picklable attributes across a reset of the job.
"""
import pickle
from typing import Any, Dict, List, Optional, Tuple

import mxnet as mx
import numpy as np

from ..elastic import (ElasticSampler, HorovodInternalError, HostsUpdatedInterrupt, ObjectState,
                       State, register_array_type, run)
from ..training import hook_state
from . import bridge
from .trainer import DistributedTrainer

__all__ = ["ElasticSampler", "GluonState", "HorovodInternalError", "HostsUpdatedInterrupt",
           "ObjectState", "State", "run"]


def _describe(array: mx.nd.NDArray) -> Optional[Tuple[int, Any]]:
    # Empty NDArrays, and dtypes NumPy lacks, are pickled as usual (sparse ones are of
    # other types).
    try:
        dtype = np.dtype(array.dtype)
    except TypeError:
        return None
    if array.size == 0:
        return None
    context = array.context
    return array.size * dtype.itemsize, (dtype, array.shape,
                                         (context.device_type, context.device_id))


def _copy(array: mx.nd.NDArray, meta: Any, out: np.ndarray) -> None:
    """The NDArray's values into ``out``, once MXNet's pending writes to it have finished."""
    np.copyto(out.view(meta[0]).reshape(meta[1]), bridge.read_view(array))


def _rebuild(data: np.ndarray, meta: Any) -> mx.nd.NDArray:
    dtype, shape, (device_type, device_id) = meta
    return bridge.to_ndarray(data.view(dtype).reshape(shape), mx.Context(device_type, device_id))


register_array_type(mx.nd.NDArray, "mxnet", _describe, _copy, _rebuild)


def _parameters(net_or_params: Any) -> List[mx.gluon.Parameter]:
    """The parameters of a Block, a ParameterDict/dict (sorted keys) or a list, in order."""
    if isinstance(net_or_params, mx.gluon.Block):
        net_or_params = net_or_params.collect_params()
    if isinstance(net_or_params, (dict, mx.gluon.ParameterDict)):
        return [net_or_params[key] for key in sorted(net_or_params.keys())]
    if isinstance(net_or_params, (list, tuple)):
        return list(net_or_params)
    raise ValueError(f"GluonState: net_or_params is a {type(net_or_params).__name__}; pass a "
                     "Block, net.collect_params() or a list of Parameters")


class GluonState(ObjectState):
    """The state of a Gluon model and its DistributedTrainer, plus picklable ``attributes``.

    A commit holds every parameter's values (running statistics included), the optimizer
    states with the optimizer itself (update counts, lr scheduler), every rank's compression
    residuals (gathered: after a restart on another number of ranks they start from zero,
    with a warning) and the attributes. Parameters must be initialised (one forward pass for
    deferred shapes) before the first commit.
    """

    def __init__(self, net_or_params: Any, trainer: DistributedTrainer, **attributes: Any):
        if not isinstance(trainer, DistributedTrainer):
            raise ValueError(f"GluonState: trainer is a {type(trainer).__name__}; pass the "
                             "hvd_trainer DistributedTrainer that updates the model")
        self._params = _parameters(net_or_params)
        self._trainer = trainer
        super().__init__(**attributes)

    def save(self) -> Dict[str, Any]:
        trainer = self._trainer
        trainer._check_initialized("GluonState.commit")
        waiting = [p.name for p in self._params if p._data is None]
        if waiting:
            raise ValueError(f"GluonState: parameters {waiting} are not initialised yet; run "
                             "one forward pass before the first commit")
        snapshot = super().save()
        # The live NDArrays: the commit copies them (updater.get_states would pickle them).
        snapshot["_weights"] = [p.list_data()[0] for p in self._params]
        updater = trainer._updaters[0]
        snapshot["_trainer"] = (updater.states, updater.optimizer)
        snapshot["_residuals"] = (hook_state.shared(
            trainer._reducer, f"{trainer._prefix}elastic.residuals") if trainer._member
            else None)
        return snapshot

    def load(self, snapshot: Dict[str, Any]) -> None:
        weights = snapshot["_weights"]
        if len(weights) != len(self._params):
            raise ValueError(f"GluonState: the commit holds {len(weights)} parameters, the "
                             f"model has {len(self._params)}; restore into the same model")
        for param, values in zip(self._params, weights):
            if tuple(param.shape) != values.shape:
                raise ValueError(f"GluonState: parameter {param.name!r} has shape "
                                 f"{param.shape}, the commit's has {values.shape}")
            param.set_data(values)
        trainer = self._trainer
        # What updater.get_states(dump_optimizer=True) gives, the trainer's format.
        trainer._set_states(pickle.dumps(snapshot["_trainer"], pickle.HIGHEST_PROTOCOL))
        if trainer._member:
            hook_state.scatter(trainer._reducer, snapshot["_residuals"],
                               f"{trainer._prefix}elastic.residuals")
        super().load(snapshot)

