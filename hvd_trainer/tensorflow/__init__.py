"""horovod.tensorflow's API on eager TensorFlow 2: a Horovod script runs after
``import hvd_trainer.tensorflow as hvd``.

Runtime functions, process sets and reduction ops come from the framework-free core; the
collectives take and return tf.Tensor (ops.py), eagerly or inside a ``tf.function``
(bridge.py). ``DistributedGradientTape`` and ``DistributedOptimizer`` reduce gradients with
the core's reducer (gradients.py). Host tensors only. TensorFlow is imported only when this
package is.
"""
from typing import Any

from hvd_trainer_launch.installs import require, TENSORFLOW

tf = require("tensorflow", TENSORFLOW, "hvd_trainer.tensorflow")  # first: says how to add it

from ..coordination.messages import MismatchError  # noqa: E402
from ..collectives.arguments import Average, Max, Min, Product, Sum
from ..coordination.process_sets import add_process_set, init, remove_process_set
from ..runtime.runtime import (ProcessSet, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                               gloo_built, gloo_enabled, global_process_set, is_homogeneous,
                               is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                               mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from ..runtime.timeline import start_timeline, stop_timeline
from . import elastic
from .compression import Compression
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .ops import (Adasum, allgather, allgather_object, allreduce, alltoall, broadcast, broadcast_,
                  broadcast_global_variables, broadcast_object, broadcast_object_fn,
                  broadcast_variables, grouped_allgather, grouped_allreduce,
                  grouped_reducescatter, join, reducescatter)


__all__ = ["Adasum", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall",
           "Average", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "ccl_built", "Compression", "cross_rank",
           "cross_size", "cuda_built", "ddl_built", "DistributedGradientTape",
           "DistributedOptimizer", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
           "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init",
           "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
           "local_size_op", "Max", "Min", "MismatchError", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "PartialDistributedGradientTape",
           "process_set_included_op", "ProcessSet", "Product", "rank", "rank_op", "reducescatter",
           "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
           "stop_timeline", "Sum", "SyncBatchNormalization"]


def size_op(process_set_id: int = 0, name: str = None) -> tf.Tensor:
    """The number of ranks in the process set, as a tensor."""
    return tf.constant(_process_set(process_set_id).size(), tf.int32, name=name)


def local_size_op(name: str = None) -> tf.Tensor:
    """The number of ranks on this host, as a tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


def rank_op(name: str = None) -> tf.Tensor:
    """This process's global rank, as a tensor."""
    return tf.constant(rank(), tf.int32, name=name)


def local_rank_op(name: str = None) -> tf.Tensor:
    """This process's rank on its host, as a tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str = None) -> tf.Tensor:
    """1 when this rank belongs to the process set, else 0, as a tensor."""
    return tf.constant(int(_process_set(process_set_id).included()), tf.int32, name=name)


def _process_set(process_set_id: int) -> ProcessSet:
    if process_set_id != 0:
        raise ValueError(f"process_set_id={process_set_id!r}: the *_op functions here answer "
                         "for the global process set (id 0) only; use "
                         "process_set.size() or process_set.included() for another set")
    return global_process_set


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """horovod.tensorflow's DistributedOptimizer for a Keras 3 or Keras 2 optimizer: that of
    :mod:`hvd_trainer.tensorflow.keras` (TF1's ``tf.compat.v1.train.Optimizer`` is not
    supported)."""
    from .keras import DistributedOptimizer as keras_optimizer
    return keras_optimizer(optimizer, *args, **kwargs)


def __getattr__(name: str) -> Any:
    # SyncBatchNormalization derives from tf.keras's BatchNormalization, so it is built on
    # first use: importing this package must not import Keras 2 (TF_USE_LEGACY_KERAS=1
    # without tf-keras installed would fail here).
    if name == "SyncBatchNormalization":
        from .sync_batch_norm import SyncBatchNormalization
        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
