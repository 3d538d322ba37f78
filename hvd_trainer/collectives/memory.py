"""Where a collective's arrays live: host memory, or a device that registers itself here.

One implementation of each collective (ops.py) serves every kind of memory through a few
hooks of :class:`Memory`: checking an array, packing it into fusion buffers, the
communicator that moves its bytes. Host memory is :data:`HOST`; ``hvd_trainer.cuda``
registers the GPU's (for CuPy arrays) when it is imported, which :func:`memory_of` has done on
the first CuPy array it sees: the package registers how (:func:`register_provider`), so that
this layer names no layer above it.
"""
import contextlib
import weakref
from typing import Any, Callable, ContextManager, Dict

import numpy as np

from . import fusion, hierarchical
from ..runtime import runtime
from ..backends.halves import Kernels
from ..runtime.runtime import ProcessSet

_SUPPORTED_KINDS = {"b", "i", "u", "f", "c"}
# Host fusion buffers per communicator.
_pools: "weakref.WeakKeyDictionary[Any, fusion.BufferPool]" = weakref.WeakKeyDictionary()
# The memory of each registered array module (by its top-level package name), and what
# registers the memory of a module not registered yet.
_registered: Dict[str, "Memory"] = {}
_providers: Dict[str, Callable[[], None]] = {}


def check_array(tensor: Any, arg: str, inplace: bool = False) -> np.ndarray:
    """``tensor`` if it is a NumPy array a collective can take (``arg`` names it in errors)."""
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"{arg} must be a numpy.ndarray, got {type(tensor).__name__} (CuPy "
                        "arrays go to allreduce(_), grouped_allreduce(_), allgather, "
                        "grouped_allgather, broadcast(_) and (grouped_)reducescatter)")
    if (tensor.dtype.kind not in _SUPPORTED_KINDS or tensor.dtype.names is not None) \
            and tensor.dtype.name != "bfloat16":
        raise TypeError(f"{arg} has dtype {tensor.dtype}, which collectives do not support; "
                        "use a boolean, integer, floating (bfloat16 included) or complex dtype")
    if inplace and not (tensor.flags.c_contiguous and tensor.flags.writeable):
        raise ValueError(f"{arg} must be C-contiguous and writeable for an in-place collective; "
                         "pass np.ascontiguousarray(...) or use the out-of-place function")
    return tensor


_ANYWHERE = contextlib.nullcontext()  # reusable: host memory needs no device set


class Memory:
    """Host memory (this class) or a device's (a subclass): the hooks through which one
    implementation of each collective serves both, so host and device ranks check and
    describe a call alike."""

    xp: Any = np  # the array module
    where = "host"  # what a call's description says of its tensors' memory
    pack = staticmethod(fusion.pack)
    unpack = staticmethod(fusion.unpack)

    def check(self, tensor: Any, arg: str, inplace: bool = False) -> Any:
        """``tensor`` if it is an array of this memory that the collective can take."""
        return check_array(tensor, arg, inplace)

    def active(self) -> ContextManager[Any]:
        """Where the collective's work runs (the rank's GPU, for GPU memory)."""
        return _ANYWHERE

    def mover(self, process_set: ProcessSet) -> Any:
        """The communicator that moves this memory's bytes for ``process_set`` (the world's
        may be hierarchical: see hierarchical.py)."""
        return hierarchical.mover(process_set)

    def pool(self, comm: Any) -> fusion.BufferPool:
        """Fusion buffers for ``comm``; calls on one communicator never overlap (its turn)."""
        pool = _pools.get(comm)
        if pool is None:
            pool = _pools[comm] = fusion.BufferPool()
        return pool


HOST = Memory()


class _Summing:
    """A host communicator whose sums of 16-bit floats run on ``kernels``; every other
    collective is the wrapped communicator's own."""

    def __init__(self, comm: Any, kernels: Kernels):
        self.comm = comm
        self.kernels = kernels

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def allreduce(self, buf: np.ndarray, op: str, out: Any = None) -> None:
        self.comm.allreduce(buf, op, out, self.kernels)

    def reduce_scatter(self, buf: np.ndarray, counts: Any, op: str) -> np.ndarray:
        return self.comm.reduce_scatter(buf, counts, op, self.kernels)


class KernelMemory(Memory):
    """Host memory whose 16-bit float sums run on ``kernels``: a framework adapter hands its
    framework's vectorised kernels down this way (see backends/halves.py)."""

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def mover(self, process_set: ProcessSet) -> Any:
        return _Summing(hierarchical.mover(process_set), self.kernels)

    def pool(self, comm: Any) -> fusion.BufferPool:
        return super().pool(comm.comm)


def register(module: str, memory: Memory) -> None:
    """Arrays whose type comes from the package ``module`` live in ``memory``."""
    _registered[module] = memory


def register_provider(module: str, provide: Callable[[], None]) -> None:
    """``provide()`` registers the memory of arrays of the package ``module``; it is called
    when the first such array is seen."""
    _providers[module] = provide


def memory_of(tensor: Any) -> "Memory":
    """HOST for NumPy arrays; the GPU's memory (``hvd_trainer.cuda``) for CuPy arrays. A list
    goes by its first element."""
    if type(tensor) is np.ndarray:  # the common case, at once
        return HOST
    first = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
    module = type(first).__module__.partition(".")[0]
    if module == "numpy":
        return HOST
    if module not in _registered and module in _providers:
        _providers[module]()
    return _registered.get(module, HOST)
