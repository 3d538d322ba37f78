"""Named collectives on CuPy arrays: ops.py for tensors that live on a GPU.

Same operators, scaling, names and agreement check as ops.py (the check runs over the host
communicator); the bytes move through the process set's GPU communicator. That is NCCL when
CuPy has it and every rank of the set has a GPU of its own, and host-staged MPI otherwise;
``HVD_GPU_COMMUNICATOR=nccl`` or ``=mpi`` forces one. Grouped allreduces fuse tensors into
device buckets packed by one kernel each.
"""
import functools
import socket
import weakref
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import cupy
import numpy as np

from .. import diagnostics, fusion as host_fusion, runtime
from ..backends import nccl
from ..backends.host_staged import HostStagedCommunicator
from ..ops import (_BACKEND_OP, Average, _check_op, _check_root, _describe, _name,
                   _rows_per_rank, _scales)
from ..runtime import ProcessSet, global_process_set
from . import fusion

_SUPPORTED_KINDS = {"b", "i", "u", "f", "c"}
# A process set's host communicator -> its GPU communicator; an entry goes with the host
# communicator (remove_process_set, shutdown).
_communicators: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_pool = fusion.device_pool()
F = TypeVar("F", bound=Callable[..., Any])


def device() -> int:
    """The GPU this rank uses: its local rank, modulo the GPUs it can see."""
    return runtime.local_rank() % cupy.cuda.runtime.getDeviceCount()


def _on_rank_device(fn: F) -> F:
    """Run ``fn`` with this rank's GPU current, where its buckets and kernels must be."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with cupy.cuda.Device(device()):
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


@_on_rank_device
def communicator(process_set: ProcessSet = global_process_set):
    """The process set's GPU communicator, made on first use (a collective call)."""
    host = runtime.communicator(process_set)
    held = _communicators.get(host)
    if held is not None:
        return held
    choice = runtime.env("GPU_COMMUNICATOR", "auto")
    if choice not in ("auto", "nccl", "mpi"):
        raise ValueError(f"HVD_GPU_COMMUNICATOR={choice!r} is unknown; use auto, nccl or mpi")
    places = host.allgather_object((socket.gethostname(), device()))
    shared = len(set(places)) < len(places)
    if choice == "nccl" and (shared or not nccl.available()):
        why = (f"ranks share a GPU ({places}); give each rank its own GPU"
               if shared else "CuPy found no NCCL library; pip install nvidia-nccl-cu12 "
               "(nvidia-nccl-cu13 for CUDA 13)")
        raise RuntimeError(f"HVD_GPU_COMMUNICATOR=nccl but NCCL cannot run: {why}, or set "
                           "HVD_GPU_COMMUNICATOR=mpi")
    if choice == "mpi" or shared or not nccl.available():
        held = HostStagedCommunicator(host)
    else:
        held = nccl.NCCLCommunicator(host, device())
    _communicators[host] = held
    return held


def _check_array(tensor: Any, arg: str, inplace: bool = False) -> cupy.ndarray:
    if not isinstance(tensor, cupy.ndarray):
        raise TypeError(f"{arg} must be a cupy.ndarray, got {type(tensor).__name__}")
    if tensor.dtype.kind not in _SUPPORTED_KINDS:
        raise TypeError(f"{arg} has dtype {tensor.dtype}, which collectives do not support")
    if inplace and not tensor.flags.c_contiguous:
        raise ValueError(f"{arg} must be C-contiguous for an in-place collective; pass "
                         "cupy.ascontiguousarray(...) or use the out-of-place function")
    if tensor.device.id != device():
        raise ValueError(f"{arg} is on GPU {tensor.device.id}, but rank {runtime.rank()} "
                         f"works on GPU {device()} (its local rank); move it there")
    return tensor


# -- allreduce ------------------------------------------------------------------------------
@_on_rank_device
def grouped_allreduce_(tensors: Sequence[cupy.ndarray], op: Any = Average,
                       name: Optional[str] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[cupy.ndarray]:
    """Reduce each tensor across the process set's ranks in place, fused into device buckets;
    returns ``tensors``."""
    tensors = [_check_array(t, f"tensors[{i}]", inplace=True) for i, t in enumerate(tensors)]
    op = _check_op(op)
    host = runtime.communicator(process_set)
    base = _name("grouped_allreduce" if len(tensors) > 1 else "allreduce", name)
    names = [base] if len(tensors) == 1 else [f"{base}.{i}" for i in range(len(tensors))]
    with diagnostics.span(base, "NEGOTIATE"):
        diagnostics.agree(host, lambda: {
            "kind": "allreduce", "name": base, "op": op.name,
            "prescale_factor": float(prescale_factor), "postscale_factor": float(postscale_factor),
            "tensors": [_describe(t, n) for t, n in zip(tensors, names)]})
    comm = communicator(process_set)
    pre, post = _scales(op, host, prescale_factor, postscale_factor)
    plan = host_fusion.plan_buckets([t.nbytes for t in tensors], [t.dtype for t in tensors],
                                    runtime.fusion_threshold())
    for slot, members in enumerate(plan):
        group = [tensors[i] for i in members]
        with diagnostics.span(base, "COMMUNICATE"):
            if len(group) == 1:  # reduced where it is, no bucket copy
                flat = group[0].reshape(-1)
                fusion.scale_(flat, pre)
                comm.allreduce(flat, _BACKEND_OP[op])
                fusion.scale_(flat, post)
                continue
            bucket = _pool.get(group[0].dtype, slot, sum(t.size for t in group))
            fusion.pack(group, bucket, pre)
            comm.allreduce(bucket, _BACKEND_OP[op])
            fusion.unpack(bucket, group, post)
    return list(tensors)


def allreduce_(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Reduce ``tensor`` across the process set's ranks in place; returns ``tensor``."""
    return grouped_allreduce_([tensor], op, name, prescale_factor, postscale_factor,
                              process_set)[0]


@_on_rank_device
def allreduce(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """:func:`allreduce_` on a copy; returns the new array."""
    _check_array(tensor, "tensor")
    return allreduce_(cupy.array(tensor, order="C"), op, name, prescale_factor,
                      postscale_factor, process_set)


@_on_rank_device
def grouped_allreduce(tensors: Sequence[cupy.ndarray], op: Any = Average,
                      name: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[cupy.ndarray]:
    """:func:`grouped_allreduce_` on copies; returns the new arrays."""
    copies = [cupy.array(_check_array(t, f"tensors[{i}]"), order="C")
              for i, t in enumerate(tensors)]
    return grouped_allreduce_(copies, op, name, prescale_factor, postscale_factor, process_set)


# -- allgather, broadcast, reducescatter ----------------------------------------------------
@_on_rank_device
def allgather(tensor: cupy.ndarray, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0, which may differ per rank."""
    _check_array(tensor, "tensor")
    if tensor.ndim == 0:
        raise ValueError("tensor must have at least one dimension for allgather; "
                         "reshape a scalar to shape (1,)")
    host = runtime.communicator(process_set)
    tensor = cupy.ascontiguousarray(tensor)
    name = _name("allgather", name)
    with diagnostics.span(name, "NEGOTIATE"):
        rows = diagnostics.agree_gather(
            host, lambda: {"kind": "allgather", "name": name,
                           "tensors": [_describe(tensor, name, dim0=False)]},
            extra=tensor.shape[0])
    row = int(np.prod(tensor.shape[1:], dtype=np.int64))
    out = cupy.empty((sum(rows),) + tensor.shape[1:], tensor.dtype)
    with diagnostics.span(name, "COMMUNICATE"):
        communicator(process_set).allgatherv(tensor.reshape(-1), out.reshape(-1),
                                             [r * row for r in rows])
    return out


@_on_rank_device
def broadcast_(tensor: cupy.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Overwrite ``tensor`` on every rank with the root rank's values; returns ``tensor``."""
    _check_array(tensor, "tensor", inplace=True)
    host = runtime.communicator(process_set)
    root = _check_root(root_rank, host)
    name = _name("broadcast", name)
    with diagnostics.span(name, "NEGOTIATE"):
        diagnostics.agree(host, lambda: {"kind": "broadcast", "name": name, "root_rank": root,
                                         "tensors": [_describe(tensor, name)]})
    with diagnostics.span(name, "COMMUNICATE"):
        communicator(process_set).broadcast(tensor.reshape(-1), root)
    return tensor


def broadcast(tensor: cupy.ndarray, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Return a new array holding the root rank's ``tensor`` on every rank."""
    _check_array(tensor, "tensor")
    return broadcast_(cupy.array(tensor, order="C"), root_rank, name, process_set)


@_on_rank_device
def reducescatter(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> cupy.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of dim 0's rows
    (Horovod's split: as even as possible, the first ranks taking one extra row)."""
    _check_array(tensor, "tensor")
    op = _check_op(op)
    if tensor.ndim == 0:
        raise ValueError("tensor must have at least one dimension for reducescatter")
    host = runtime.communicator(process_set)
    name = _name("reducescatter", name)
    with diagnostics.span(name, "NEGOTIATE"):
        diagnostics.agree(host, lambda: {
            "kind": "reducescatter", "name": name, "op": op.name,
            "prescale_factor": float(prescale_factor), "postscale_factor": float(postscale_factor),
            "tensors": [_describe(tensor, name)]})
    pre, post = _scales(op, host, prescale_factor, postscale_factor)
    row = int(np.prod(tensor.shape[1:], dtype=np.int64))
    shares = _rows_per_rank(tensor.shape[0], host.size)
    work = cupy.array(tensor, order="C").reshape(-1)
    fusion.scale_(work, pre)
    with diagnostics.span(name, "COMMUNICATE"):
        mine = communicator(process_set).reduce_scatter(work, [s * row for s in shares],
                                                        _BACKEND_OP[op])
    fusion.scale_(mine, post)
    return mine.reshape((shares[host.rank],) + tensor.shape[1:])
