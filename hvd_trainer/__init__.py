"""hvd_trainer: Horovod-style data-parallel training for MXNet Gluon, installable with pip.

This package is framework-free: the collectives below work on NumPy arrays and importing it
does not import MXNet. ``DistributedTrainer`` and ``broadcast_parameters`` resolve lazily to
the MXNet adapter in :mod:`hvd_trainer.mxnet`; ``DistributedOptimizer`` exists in both adapters,
so it is taken from :mod:`hvd_trainer.mxnet` or :mod:`hvd_trainer.torch` by name. ``run`` is
horovod.run (:mod:`hvd_trainer_launch.engines.run`).
"""
from .coordination.messages import MismatchError
from .runtime.timeline import start_timeline, stop_timeline
from .collectives.joined import join
from .collectives.arguments import Average, Max, Min, Product, ReduceOp, Sum
from .collectives.ops import (allgather, allreduce, allreduce_, alltoall, barrier, broadcast,
                              broadcast_, grouped_allgather, grouped_allreduce, grouped_allreduce_,
                              grouped_reducescatter, reducescatter)
from .collectives.objects import allgather_object, broadcast_object
from .coordination.process_sets import add_process_set, init, remove_process_set
from .runtime.runtime import (ProcessSet, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                              gloo_built, gloo_enabled, global_process_set, is_homogeneous,
                              is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                              mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from .coordination.scheduler import DuplicateNameError
from .collectives import memory as _memory

__version__ = "0.1.0"

__all__ = ["add_process_set", "allgather", "allgather_object", "allreduce", "allreduce_",
           "alltoall", "Average", "barrier", "broadcast", "broadcast_", "broadcast_object",
           "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "DuplicateNameError", "global_process_set", "gloo_built", "gloo_enabled",
           "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter",
           "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "Max",
           "Min", "MismatchError", "mpi_built", "mpi_enabled", "mpi_threads_supported",
           "nccl_built", "ProcessSet", "Product", "rank", "ReduceOp", "reducescatter",
           "remove_process_set", "rocm_built", "run", "shutdown", "size", "start_timeline",
           "stop_timeline", "Sum"]

_MXNET_NAMES = ("DistributedTrainer", "broadcast_parameters")


def _gpu_memory() -> None:
    """Register the GPU's memory for CuPy arrays (imports CuPy): the collectives call it on
    the first CuPy array they see."""
    from .cuda import ops  # noqa: F401  (registers on import)


_memory.register_provider("cupy", _gpu_memory)


def __getattr__(name: str):
    if name == "run":  # imported on use: ``import hvd_trainer`` loads no launcher engine
        from hvd_trainer_launch.engines.run import run
        return run
    if name in _MXNET_NAMES:
        from . import mxnet as adapter
        return getattr(adapter, name)
    if name == "DistributedOptimizer":
        # Both adapters have one, for different optimizers; neither is the obvious default.
        raise AttributeError("hvd_trainer.DistributedOptimizer is ambiguous: use "
                             "hvd_trainer.mxnet.DistributedOptimizer (an mx.optimizer.Optimizer, "
                             "for Module.fit) or hvd_trainer.torch.DistributedOptimizer")
    raise AttributeError(f"module 'hvd_trainer' has no attribute {name!r}")
