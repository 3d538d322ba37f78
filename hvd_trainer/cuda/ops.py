"""Named collectives on CuPy arrays: ops.py for tensors that live on a GPU.

The collectives are ops.py's own, run on :class:`DeviceMemory`: same operators, scaling,
names, argument errors and agreement (over the host communicator, with the same
descriptions); the bytes move through the process set's GPU communicator. That is NCCL when
CuPy has it and every rank of the set has a GPU of its own, and host-staged MPI otherwise;
``HVD_GPU_COMMUNICATOR=nccl`` or ``=mpi`` forces one. Grouped allreduces fuse tensors into
device buckets packed by one kernel each.
"""
import functools
import socket
import weakref
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import cupy

from .. import runtime
from ..backends import nccl
from ..backends.host_staged import HostStagedCommunicator
from ..fusion import BufferPool
from ..ops import Average, Memory, broadcast_in, gather, reduce_group, scatter_reduce
from ..runtime import ProcessSet, global_process_set
from . import fusion

# A process set's host communicator -> its GPU communicator; an entry goes with the host
# communicator (remove_process_set, shutdown).
_communicators: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
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


class DeviceMemory(Memory):
    """CuPy arrays on this rank's GPU, moved by the process set's GPU communicator."""

    xp = cupy
    pack = staticmethod(fusion.pack)
    unpack = staticmethod(fusion.unpack)

    def check(self, tensor: Any, arg: str, inplace: bool = False) -> cupy.ndarray:
        if not isinstance(tensor, cupy.ndarray):
            raise TypeError(f"{arg} must be a cupy.ndarray, got {type(tensor).__name__}")
        if tensor.dtype.kind not in "biufc":
            raise TypeError(f"{arg} has dtype {tensor.dtype}, which collectives do not support")
        if inplace and not tensor.flags.c_contiguous:
            raise ValueError(f"{arg} must be C-contiguous for an in-place collective; pass "
                             "cupy.ascontiguousarray(...) or use the out-of-place function")
        if tensor.device.id != device():
            raise ValueError(f"{arg} is on GPU {tensor.device.id}, but rank {runtime.rank()} "
                             f"works on GPU {device()} (its local rank); move it there")
        return tensor

    def mover(self, process_set: ProcessSet) -> Any:
        return communicator(process_set)

    def pool(self, comm: Any) -> BufferPool:
        pool = _pools.get(comm)
        if pool is None:
            pool = _pools[comm] = fusion.device_pool()
        return pool


DEVICE = DeviceMemory()
# Device fusion buffers per GPU communicator.
_pools: "weakref.WeakKeyDictionary[Any, BufferPool]" = weakref.WeakKeyDictionary()


@_on_rank_device
def grouped_allreduce_(tensors: Sequence[cupy.ndarray], op: Any = Average,
                       name: Optional[str] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[cupy.ndarray]:
    """Reduce each tensor across the process set's ranks in place, fused into device buckets;
    returns ``tensors``."""
    return reduce_group(DEVICE, tensors, op, name, prescale_factor, postscale_factor,
                        process_set, "grouped_allreduce", True)


@_on_rank_device
def allreduce_(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Reduce ``tensor`` across the process set's ranks in place; returns ``tensor``."""
    return reduce_group(DEVICE, [tensor], op, name, prescale_factor, postscale_factor,
                        process_set, "allreduce", True)[0]


@_on_rank_device
def allreduce(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Reduce ``tensor`` across the process set's ranks into a new array."""
    return reduce_group(DEVICE, [tensor], op, name, prescale_factor, postscale_factor,
                        process_set, "allreduce", False)[0]


@_on_rank_device
def grouped_allreduce(tensors: Sequence[cupy.ndarray], op: Any = Average,
                      name: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[cupy.ndarray]:
    """:func:`grouped_allreduce_` into new arrays."""
    return reduce_group(DEVICE, tensors, op, name, prescale_factor, postscale_factor,
                        process_set, "grouped_allreduce", False)


@_on_rank_device
def allgather(tensor: cupy.ndarray, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0, which may differ per rank."""
    return gather(DEVICE, tensor, name, process_set)


@_on_rank_device
def broadcast_(tensor: cupy.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Overwrite ``tensor`` on every rank with the root rank's values; returns ``tensor``."""
    return broadcast_in(DEVICE, tensor, root_rank, name, process_set, True)


@_on_rank_device
def broadcast(tensor: cupy.ndarray, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Return a new array holding the root rank's ``tensor`` on every rank."""
    return broadcast_in(DEVICE, tensor, root_rank, name, process_set, False)


@_on_rank_device
def reducescatter(tensor: cupy.ndarray, op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> cupy.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of dim 0's rows
    (Horovod's split: as even as possible, the first ranks taking one extra row)."""
    return scatter_reduce(DEVICE, [tensor], op, name, process_set, prescale_factor,
                          postscale_factor, "reducescatter")[0]
