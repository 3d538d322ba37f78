"""Horovod's MXNet collectives on NDArrays, built on the framework-free core.

NDArrays go in and come out: the ``*_`` variants write into the NDArray they are given, the
others return new NDArrays on the input's context. Host NDArrays are reduced through
zero-copy views of their memory (see bridge.py), so an in-place op moves no data besides
the communication itself and an out-of-place one copies its input once. Allreduces of GPU
arrays run on the GPU (``hvd_trainer.cuda``, through DLPack) where CuPy can run; other GPU
collectives travel through host memory. Every op waits for pending MXNet writes to its
inputs first.

Every function here is a collective: every rank of its ``process_set`` calls it, in the same
order. ``root_rank`` is a global rank, as in Horovod. A misused collective (ranks that
disagree, splits that do not fit, a rank outside the process set) raises on every rank an
error that is an ``MXNetError``, as horovod.mxnet's, and also the core's ``ValueError``,
``TypeError`` or ``MismatchError`` (see errors.py).

``priority`` is accepted for compatibility with Horovod and has no effect: calls run in the
order they are made, which is the same order on every rank.

Argument errors are collective too: a check of this module that fails on one rank goes
through the core's agreement (:func:`hvd_trainer.collectives.arguments.refuse`), so every rank
raises it.
"""
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import mxnet as mx
import numpy as np

from ..collectives import arguments, objects
from ..collectives import ops as core
from ..collectives.arguments import Average, Sum
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .errors import raises_mxnet_errors

NDArray = mx.nd.NDArray
T = TypeVar("T")


def _checked(kind: str, name: Optional[str], process_set: ProcessSet, check: Callable[[], T]) -> T:
    """Run this adapter's argument ``check``; its error is raised on every rank of the set."""
    try:
        return check()
    except (TypeError, ValueError) as e:
        arguments.refuse(e, kind, name, process_set)

broadcast_object = raises_mxnet_errors(objects.broadcast_object)
allgather_object = raises_mxnet_errors(objects.allgather_object)


def _resolve_op(op: Any, average: Optional[bool]) -> Any:
    """Horovod's rule: ``op`` wins, ``average`` is the deprecated spelling, Average by default."""
    if op is not None:
        if average is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return op
    if average is not None:
        warnings.warn("average= is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _as_list(tensors: Sequence[NDArray]) -> List[NDArray]:
    if isinstance(tensors, (NDArray, np.ndarray)):
        raise TypeError("tensors must be a list of NDArrays, got a single "
                        f"{type(tensors).__name__}; wrap it in a list")
    return [bridge.check_dense(t, f"tensors[{i}]") for i, t in enumerate(tensors)]


def _buffers(tensors: Sequence[NDArray]) -> List[np.ndarray]:
    """Writable host buffers for in-place work: the arrays' own memory on the host."""
    return [bridge.write_view(t) if bridge.is_host(t) else t.asnumpy() for t in tensors]


def _write_back(tensors: Sequence[NDArray], buffers: Sequence[np.ndarray]) -> None:
    """Copy host results into device arrays (host arrays were worked on in place)."""
    for t, b in zip(tensors, buffers):
        if not bridge.is_host(t):
            bridge.assign(t, b)


def _copy(tensor: NDArray) -> NDArray:
    """A new NDArray with the tensor's values, on its context: the one copy of an op."""
    out = mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
    if bridge.is_host(tensor):
        np.copyto(bridge.write_view(out), bridge.read_view(tensor))
    else:
        out[:] = tensor.as_nd_ndarray()
    return bridge.like(out, tensor)


# -- allreduce ------------------------------------------------------------------------------
@raises_mxnet_errors
def grouped_allreduce_(tensors: Sequence[NDArray], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: Any = None) -> List[NDArray]:
    """Reduce each NDArray across ranks in place, fused into as few messages as the core can.

    ``op`` is Average, Sum, Min, Max or Product (Average if neither it nor ``average`` is
    given). Returns ``tensors``.
    """
    op = _checked("grouped_allreduce", name, process_set, lambda: _resolve_op(op, average))
    tensors = _checked("grouped_allreduce", name, process_set, lambda: _as_list(tensors))
    if tensors and bridge.on_cupy_gpus(tensors):
        import cupy
        with cupy.cuda.Device(tensors[0].context.device_id):
            # CuPy arrays: the core hands them to the GPU collectives
            core.grouped_allreduce_([bridge.to_cupy(t) for t in tensors], op, name,
                                    prescale_factor, postscale_factor, process_set)
            cupy.cuda.get_current_stream().synchronize()  # before MXNet touches them again
        return tensors
    buffers = _buffers(tensors)
    core.grouped_allreduce_(buffers, op, name, prescale_factor, postscale_factor, process_set)
    _write_back(tensors, buffers)
    return tensors


@raises_mxnet_errors
def grouped_allreduce(tensors: Sequence[NDArray], average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op: Any = None) -> List[NDArray]:
    """Like :func:`grouped_allreduce_` but leaves ``tensors`` alone and returns new NDArrays."""
    op = _checked("grouped_allreduce", name, process_set, lambda: _resolve_op(op, average))
    tensors = _checked("grouped_allreduce", name, process_set, lambda: _as_list(tensors))
    return grouped_allreduce_([_copy(t) for t in tensors], None, name, priority,
                              prescale_factor, postscale_factor, process_set, op)


@raises_mxnet_errors
def allreduce_(tensor: NDArray, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Any = None) -> NDArray:
    """Reduce ``tensor`` across ranks in place (Average unless ``op``/``average`` say otherwise).

    The result is ``op`` over ``tensor * prescale_factor`` from every rank, times
    ``postscale_factor``. Returns ``tensor``.
    """
    op = _checked("allreduce", name, process_set, lambda: _resolve_op(op, average))
    _checked("allreduce", name, process_set, lambda: bridge.check_dense(tensor, "tensor"))
    if bridge.on_cupy_gpus([tensor]):
        return grouped_allreduce_([tensor], None, name, priority, prescale_factor,
                                  postscale_factor, process_set, op)[0]
    buffers = _buffers([tensor])
    core.allreduce_(buffers[0], op, name, prescale_factor, postscale_factor, process_set)
    _write_back([tensor], buffers)
    return tensor


@raises_mxnet_errors
def allreduce(tensor: NDArray, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Any = None) -> NDArray:
    """Like :func:`allreduce_` but leaves ``tensor`` alone and returns a new NDArray."""
    op = _checked("allreduce", name, process_set, lambda: _resolve_op(op, average))
    _checked("allreduce", name, process_set, lambda: bridge.check_dense(tensor, "tensor"))
    return allreduce_(_copy(tensor), None, name, priority,
                      prescale_factor, postscale_factor, process_set, op)


# -- allgather ------------------------------------------------------------------------------
@raises_mxnet_errors
def allgather(tensor: NDArray, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """Concatenate every rank's ``tensor`` along dim 0 (whose length may differ per rank)."""
    _checked("allgather", name, process_set, lambda: bridge.check_dense(tensor, "tensor"))
    gathered = core.allgather(bridge.read_view(tensor), name, process_set)
    return bridge.like(bridge.to_ndarray(gathered, tensor.context), tensor)


@raises_mxnet_errors
def grouped_allgather(tensors: Sequence[NDArray], name: Optional[str] = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> List[NDArray]:
    """:func:`allgather` each NDArray of a list; returns the gathered NDArrays in order."""
    tensors = _checked("grouped_allgather", name, process_set, lambda: _as_list(tensors))
    gathered = core.grouped_allgather([bridge.read_view(t) for t in tensors], name, process_set)
    return [bridge.like(bridge.to_ndarray(g, t.context), t) for g, t in zip(gathered, tensors)]


# -- broadcast ------------------------------------------------------------------------------
@raises_mxnet_errors
def broadcast_(tensor: NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> NDArray:
    """Overwrite ``tensor`` on every rank with ``root_rank``'s values; returns ``tensor``."""
    _checked("broadcast", name, process_set, lambda: bridge.check_dense(tensor, "tensor"))
    buffers = _buffers([tensor])
    core.broadcast_(buffers[0], root_rank, name, process_set)
    _write_back([tensor], buffers)
    return tensor


@raises_mxnet_errors
def broadcast(tensor: NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """A new NDArray holding ``root_rank``'s ``tensor``, on this rank's ``tensor.context``."""
    _checked("broadcast", name, process_set, lambda: bridge.check_dense(tensor, "tensor"))
    return broadcast_(_copy(tensor), root_rank, name, priority, process_set)


# -- alltoall -------------------------------------------------------------------------------
@raises_mxnet_errors
def alltoall(tensor: NDArray, splits: Union[None, Sequence[int], np.ndarray, NDArray] = None,
             name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set
             ) -> Union[NDArray, Tuple[NDArray, NDArray]]:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank i; return what arrives.

    Without ``splits`` dim 0 is divided equally. As in Horovod, ``(output, received_splits)``
    is returned only when ``splits`` is given; ``received_splits`` is an int32 NDArray on the
    CPU.
    """
    _checked("alltoall", name, process_set, lambda: bridge.check_dense(tensor, "tensor"))
    if isinstance(splits, NDArray):
        splits = splits.asnumpy()
    result = core.alltoall(bridge.read_view(tensor), splits, name, process_set)
    if splits is None:
        return bridge.like(bridge.to_ndarray(result, tensor.context), tensor)
    output, received = result
    return (bridge.like(bridge.to_ndarray(output, tensor.context), tensor),
            bridge.like(mx.nd.array(received, ctx=mx.cpu(), dtype=np.int32), tensor))


# -- reducescatter --------------------------------------------------------------------------
@raises_mxnet_errors
def grouped_reducescatter(tensors: Sequence[NDArray], op: Any = Average,
                          name: Optional[str] = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[NDArray]:
    """:func:`reducescatter` of each NDArray of a list, agreed on in one exchange."""
    tensors = _checked("grouped_reducescatter", name, process_set, lambda: _as_list(tensors))
    shares = core.grouped_reducescatter([bridge.read_view(t) for t in tensors], op, name,
                                        process_set, prescale_factor, postscale_factor)
    return [bridge.like(bridge.to_ndarray(s, t.context), t) for s, t in zip(shares, tensors)]


@raises_mxnet_errors
def reducescatter(tensor: NDArray, op: Any = Average, name: Optional[str] = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> NDArray:
    """Reduce ``tensor`` across ranks and return this rank's rows of the result.

    Dim 0 is split as evenly as possible, the lower ranks taking one extra row each.
    """
    _checked("grouped_reducescatter", name, process_set,
             lambda: bridge.check_dense(tensor, "tensor"))
    return grouped_reducescatter([tensor], op, name, priority, process_set,
                                 prescale_factor, postscale_factor)[0]
