"""Broadcasting Gluon parameters from one rank so that every rank starts from the same weights.

A tensor is named by its index in the sorted key list plus a prefix, never by ``param.name``
alone: MXNet names are per-process counters and two models may share them. A Parameter whose
shape is not known yet (deferred initialisation) is broadcast the moment it is initialised,
which happens in the first forward pass on every rank, so the first gradients are already
computed on the root's weights.
"""
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import mxnet as mx

from ..collectives import ops
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge, sparse_weights
from .errors import raises_mxnet_errors


def broadcast_ndarray(array: mx.nd.NDArray, root_rank: int, name: str,
                      process_set: ProcessSet) -> None:
    """Overwrite a dense NDArray in place with the root rank's values."""
    if bridge.is_host(array):
        ops.broadcast_(bridge.write_view(array), root_rank, name, process_set)
    else:
        staged = ops.broadcast_(array.asnumpy(), root_rank, name, process_set)
        bridge.assign(array, staged)


def _broadcast_parameter(param: mx.gluon.Parameter, root_rank: int, name: str,
                         process_set: ProcessSet) -> None:
    """Broadcast the first context's copy, then copy it to the parameter's other contexts."""
    if param._stype != "default":
        _broadcast_whole(param, root_rank, name, process_set)
        return
    first, *others = param.list_data()
    broadcast_ndarray(first, root_rank, name, process_set)
    for array in others:
        bridge.assign(array, bridge.read_view(first))


def _broadcast_whole(param: mx.gluon.Parameter, root_rank: int, name: str,
                     process_set: ProcessSet) -> None:
    """Broadcast a row_sparse weight whole and set it with ``set_data``.

    Once a trainer serves the weight, its arrays hold only the rows last served, so the whole
    weight comes from the trainer (``_reduce`` asks it for every row), and ``set_data`` hands
    the root's value back to it.
    """
    source = param._reduce() if param._trainer is not None else param._data[0]
    values = source.tostype("default").asnumpy()
    ops.broadcast_(values, root_rank, name, process_set)
    param.set_data(mx.nd.array(values, dtype=values.dtype))


def _broadcast_when_initialised(param: mx.gluon.Parameter, root_rank: int, name: str,
                                process_set: ProcessSet) -> None:
    """Make the parameter's next initialisation end with a broadcast (once), then unhook."""
    original = param._init_impl

    def init_then_broadcast(data, ctx_list):
        param._init_impl = original
        original(data, ctx_list)
        _broadcast_parameter(param, root_rank, name, process_set)

    param._init_impl = init_then_broadcast


def broadcast_named(items: Sequence[Tuple[str, Any]], root_rank: int, process_set: ProcessSet
                    ) -> None:
    """Broadcast ``(tensor name, Parameter or NDArray)`` pairs in order; values already checked.

    Parameters still waiting for their shape are hooked to broadcast on initialisation.
    """
    for name, value in items:
        if isinstance(value, mx.gluon.Parameter):
            if value._data is None:
                _broadcast_when_initialised(value, root_rank, name, process_set)
            else:
                _broadcast_parameter(value, root_rank, name, process_set)
        else:
            broadcast_ndarray(value, root_rank, name, process_set)


def check_value(key: Any, value: Any) -> None:
    """Raise ValueError naming ``key`` unless ``value`` is a Parameter or a dense NDArray."""
    if isinstance(value, mx.gluon.Parameter):
        if value._data is None and not value._deferred_init:
            raise ValueError(f"parameter {key!r} has not been initialized; call "
                             "net.initialize() (or param.initialize()) before broadcasting")
        return
    if not isinstance(value, mx.nd.NDArray):
        raise ValueError(f"params[{key!r}] is a {type(value).__name__}; broadcast_parameters "
                         "takes Parameters or NDArrays, e.g. net.collect_params()")
    if value.stype != "default":
        raise ValueError(f"params[{key!r}] has storage type {value.stype!r}; broadcast a dense "
                         "NDArray (value.tostype('default'))")


@raises_mxnet_errors
def broadcast_parameters(params: Mapping[Any, Any], root_rank: int = 0,
                         prefix: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` on every rank of ``process_set`` with the root rank's values.

    ``params`` is a dict of name -> Parameter or NDArray, or a ParameterDict
    (``net.collect_params()``). Tensors are named ``prefix`` + their index in the sorted keys;
    call it with distinct prefixes when broadcasting several dicts. ``root_rank`` is a global
    rank, as in Horovod.

    A collective: every rank of ``process_set`` calls it, and a parameter waiting for its
    shape makes the forward pass that initialises it one too. On a rank outside the set it
    does nothing, as a ``DistributedTrainer`` on that set does there.
    """
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError(f"params is a {type(params).__name__}; pass a dict of name -> "
                         "Parameter/NDArray or a ParameterDict (net.collect_params())")
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"prefix={prefix!r} must be a string or None")
    keys = sorted(params.keys(), key=str)
    items: List[Tuple[str, Any]] = []
    for index, key in enumerate(keys):
        check_value(key, params[key])
        items.append((f"{prefix or ''}{index}", params[key]))
    runtime.init()
    if process_set.size() == 1 or not process_set.included():
        return
    broadcast_named(items, root_rank, process_set)


def parameter_list(params: Any) -> List[mx.gluon.Parameter]:
    """Gluon's parameter order (sorted keys for a dict, given order for a list), checked."""
    if isinstance(params, (dict, mx.gluon.ParameterDict)):
        keyed = [(key, params[key]) for key in sorted(params.keys())]
    elif isinstance(params, (list, tuple)):
        keyed = list(enumerate(params))
    else:
        raise ValueError(f"params is a {type(params).__name__}; pass net.collect_params(), "
                         "a dict of name -> Parameter or a list of Parameters")
    for key, param in keyed:
        if not isinstance(param, mx.gluon.Parameter):
            raise ValueError(f"params[{key!r}] is a {type(param).__name__}, not a gluon "
                             "Parameter; pass net.collect_params() or Parameters only")
        if param._stype != "default":
            sparse_weights.check(param)
    return [param for _, param in keyed]
