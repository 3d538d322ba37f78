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

__version__ = "0.1.0"

_MXNET_NAMES = ("DistributedTrainer", "broadcast_parameters")


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
