"""Named collectives on CuPy arrays: ops.py for tensors that live on a GPU.

Same operators, scaling, names, argument errors and agreement as ops.py (the agreement runs
over the host communicator, with the same descriptions); the bytes move through the process set's GPU communicator. That is NCCL when
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
from ..ops import (_BACKEND_OP, Average, _check_root, _check_rows, describe_tensor,
                   check_reduction, describe_reduction, rows_per_rank, scales)
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
    choice = runtime.setting("GPU_COMMUNICATOR")
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
def _grouped_allreduce(tensors: Sequence[Any], op: Any, name: Optional[str],
                       prescale_factor: float, postscale_factor: float,
                       process_set: ProcessSet, kind: str, inplace: bool) -> List[cupy.ndarray]:
    """Reduce ``tensors`` in place, or copies of them, fused into device buckets."""
    host = runtime.communicator(process_set)
    with diagnostics.collective(host, kind, name) as call:
        with call.checks():
            arg = "tensor" if kind == "allreduce" else "tensors[{}]"
            tensors = [_check_array(t, arg.format(i), inplace) for i, t in enumerate(tensors)]
            op = check_reduction(op, prescale_factor, postscale_factor)
        call.agree(lambda: describe_reduction(call.name, tensors, op, prescale_factor,
                                              postscale_factor))
        if not inplace:
            tensors = [cupy.array(t, order="C") for t in tensors]
        comm = communicator(process_set)
        pre, post = scales(op, host, prescale_factor, postscale_factor)
        plan = host_fusion.plan_buckets([t.nbytes for t in tensors], [t.dtype for t in tensors],
                                        runtime.fusion_threshold())
        for slot, members in enumerate(plan):
            group = [tensors[i] for i in members]
            with call.communicate():
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


@_on_rank_device
def grouped_allreduce_(tensors: Sequence[cupy.ndarray], op: Any = Average,
                       name: Optional[str] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[cupy.ndarray]:
    """Reduce each tensor across the process set's ranks in place, fused into device buckets;
    returns ``tensors``."""
    return _grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor, process_set,
                              "grouped_allreduce", True)


@_on_rank_device
def allreduce_(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Reduce ``tensor`` across the process set's ranks in place; returns ``tensor``."""
    return _grouped_allreduce([tensor], op, name, prescale_factor, postscale_factor,
                              process_set, "allreduce", True)[0]


@_on_rank_device
def allreduce(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """:func:`allreduce_` on a copy; returns the new array."""
    return _grouped_allreduce([tensor], op, name, prescale_factor, postscale_factor,
                              process_set, "allreduce", False)[0]


@_on_rank_device
def grouped_allreduce(tensors: Sequence[cupy.ndarray], op: Any = Average,
                      name: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[cupy.ndarray]:
    """:func:`grouped_allreduce_` on copies; returns the new arrays."""
    return _grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor, process_set,
                              "grouped_allreduce", False)


# -- allgather, broadcast, reducescatter ----------------------------------------------------
@_on_rank_device
def allgather(tensor: cupy.ndarray, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0, which may differ per rank."""
    host = runtime.communicator(process_set)
    with diagnostics.collective(host, "allgather", name) as call:
        with call.checks():
            _check_array(tensor, "tensor")
            _check_rows(tensor, "tensor", "allgather")
            tensor = cupy.ascontiguousarray(tensor)
        rows = call.agree_gather(lambda: {"tensors": [describe_tensor(tensor, call.name, False)]},
                                 lambda: tensor.shape[0])
        row = int(np.prod(tensor.shape[1:], dtype=np.int64))
        out = cupy.empty((sum(rows),) + tensor.shape[1:], tensor.dtype)
        with call.communicate():
            communicator(process_set).allgatherv(tensor.reshape(-1), out.reshape(-1),
                                                 [r * row for r in rows])
        return out


def _broadcast(tensor: Any, root_rank: Any, name: Optional[str], process_set: ProcessSet,
               inplace: bool) -> cupy.ndarray:
    host = runtime.communicator(process_set)
    with diagnostics.collective(host, "broadcast", name) as call:
        with call.checks():
            _check_array(tensor, "tensor", inplace)
            root = _check_root(root_rank, process_set)
        call.agree(lambda: {"root_rank": int(root_rank),
                            "tensors": [describe_tensor(tensor, call.name)]})
        if not inplace:
            tensor = cupy.array(tensor, order="C")
        with call.communicate():
            communicator(process_set).broadcast(tensor.reshape(-1), root)
        return tensor


@_on_rank_device
def broadcast_(tensor: cupy.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Overwrite ``tensor`` on every rank with the root rank's values; returns ``tensor``."""
    return _broadcast(tensor, root_rank, name, process_set, True)


@_on_rank_device
def broadcast(tensor: cupy.ndarray, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Return a new array holding the root rank's ``tensor`` on every rank."""
    return _broadcast(tensor, root_rank, name, process_set, False)


@_on_rank_device
def reducescatter(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> cupy.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of dim 0's rows
    (Horovod's split: as even as possible, the first ranks taking one extra row)."""
    host = runtime.communicator(process_set)
    with diagnostics.collective(host, "reducescatter", name) as call:
        with call.checks():
            _check_array(tensor, "tensor")
            _check_rows(tensor, "tensor", "reducescatter")
            op = check_reduction(op, prescale_factor, postscale_factor)
        call.agree(lambda: describe_reduction(call.name, [tensor], op, prescale_factor,
                                              postscale_factor))
        pre, post = scales(op, host, prescale_factor, postscale_factor)
        row = int(np.prod(tensor.shape[1:], dtype=np.int64))
        shares = rows_per_rank(tensor.shape[0], host.size)
        work = cupy.array(tensor, order="C").reshape(-1)
        fusion.scale_(work, pre)
        with call.communicate():
            mine = communicator(process_set).reduce_scatter(work, [s * row for s in shares],
                                                            _BACKEND_OP[op])
        fusion.scale_(mine, post)
        return mine.reshape((shares[host.rank],) + tensor.shape[1:])
