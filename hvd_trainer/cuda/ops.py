"""Collectives on CuPy arrays: the GPU memory that ops.py's collectives run on.

``hvd_trainer.allreduce`` and its siblings take CuPy arrays as they take NumPy ones: they run
on :class:`DeviceMemory`, with the same operators, scaling, names, argument errors and
agreement (over the host communicator, with the same descriptions); the bytes move through the process set's GPU communicator. That is NCCL when
CuPy has it and every rank of the set has a GPU of its own, and host-staged MPI otherwise;
``HVD_GPU_COMMUNICATOR=nccl`` or ``=mpi`` forces one. Grouped allreduces fuse tensors into
device buckets packed by one kernel each.
"""
import functools
import socket
import weakref
from typing import Any, Callable, ContextManager, TypeVar

import cupy

from hvd_trainer_launch import installs

from ..runtime import runtime
from ..backends import nccl
from ..backends.companions import Companions
from ..backends.host_staged import HostStagedCommunicator
from ..collectives.fusion import BufferPool
from ..collectives.memory import Memory, register
from ..runtime.runtime import ProcessSet, global_process_set
from . import fusion

# A process set's host communicator -> its GPU communicator, which holds the host one only
# through a weak proxy, so the entry goes (and the GPU communicator is freed) with the host
# communicator (remove_process_set, shutdown).
_communicators: Companions[Any] = Companions()
F = TypeVar("F", bound=Callable[..., Any])


@functools.lru_cache(maxsize=None)
def _visible_gpus() -> int:
    """How many GPUs this process sees: fixed for its life (CUDA reads CUDA_VISIBLE_DEVICES
    once, when it starts), so asked once."""
    return cupy.cuda.runtime.getDeviceCount()


def device() -> int:
    """The GPU this rank uses: its local rank, modulo the GPUs it can see."""
    return runtime.local_rank() % _visible_gpus()


def on_rank_device(fn: F) -> F:
    """Run ``fn`` with this rank's GPU current, where its buckets and kernels must be."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with cupy.cuda.Device(device()):
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


def communicator(process_set: ProcessSet = global_process_set):
    """The process set's GPU communicator, made on first use (a collective call)."""
    host = runtime.communicator(process_set)
    held = _communicators.get(host)
    return _made(host) if held is None else held


@on_rank_device
def _made(host: Any) -> Any:
    """A new GPU communicator for the host communicator ``host`` (a collective call)."""
    choice = runtime.setting("GPU_COMMUNICATOR")
    # A GPU is told apart by its bus address: device numbers are per process
    # (CUDA_VISIBLE_DEVICES), so ranks that each see one GPU all call theirs GPU 0.
    places = host.allgather_object((socket.gethostname(),
                                    cupy.cuda.Device(device()).pci_bus_id))
    shared = len(set(places)) < len(places)
    if choice == "nccl" and (shared or not nccl.available()):
        why = (f"ranks share a GPU ({places}); give each rank its own GPU"
               if shared else f"CuPy found no NCCL library; {installs.NCCL.command}")
        raise RuntimeError(f"HVD_GPU_COMMUNICATOR=nccl but NCCL cannot run: {why}, or set "
                           "HVD_GPU_COMMUNICATOR=mpi")
    if choice == "mpi" or shared or not nccl.available():
        return _communicators.add(host, HostStagedCommunicator)
    return _communicators.add(host, lambda proxy: nccl.NCCLCommunicator(proxy, device()))


class DeviceMemory(Memory):
    """CuPy arrays on this rank's GPU, moved by the process set's GPU communicator."""

    xp = cupy
    where = "gpu"
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
        if tensor.data.device_id != device():  # its memory's GPU, without a Device object
            raise ValueError(f"{arg} is on GPU {tensor.data.device_id}, but rank {runtime.rank()} "
                             f"works on GPU {device()} (its local rank); move it there")
        return tensor

    def active(self) -> ContextManager[Any]:
        return cupy.cuda.Device(device())

    def mover(self, process_set: ProcessSet) -> Any:
        return communicator(process_set)

    def pool(self, comm: Any) -> BufferPool:
        pool = _pools.get(comm)
        if pool is None:
            pool = _pools[comm] = fusion.device_pool()
        return pool


DEVICE = DeviceMemory()
register("cupy", DEVICE)
# Device fusion buffers per GPU communicator.
_pools: "weakref.WeakKeyDictionary[Any, BufferPool]" = weakref.WeakKeyDictionary()
