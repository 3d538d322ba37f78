"""horovod.torch's API: a Horovod script runs unchanged after `import hvd_trainer.torch as hvd`.

Runtime functions, process sets and reduction ops come from the framework-free core; the
collectives here take and return torch tensors, on the CPU or on a CUDA device (see ops.py).
"""
from hvd_trainer_launch.installs import PYTORCH, require

require("torch", PYTORCH, "hvd_trainer.torch")  # first: a missing PyTorch says how to add it
from ..coordination.messages import MismatchError
from ..runtime.timeline import start_timeline, stop_timeline
from ..collectives.arguments import Average, Max, Min, Product, Sum
from ..coordination.process_sets import add_process_set, init, remove_process_set
from ..runtime.runtime import (ProcessSet, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                               gloo_built, gloo_enabled, global_process_set, is_homogeneous,
                               is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                               mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from . import elastic
from .compression import Compression
from .errors import HorovodInternalError
from .ops import (Adasum, allgather, allgather_async, allgather_object, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                  broadcast_, broadcast_async, broadcast_async_, broadcast_object,
                  grouped_allgather, grouped_allgather_async, grouped_allreduce,
                  grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                  grouped_reducescatter, grouped_reducescatter_async, join, poll, reducescatter,
                  reducescatter_async, sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .parameters import broadcast_optimizer_state, broadcast_parameters
from .sync_batch_norm import SyncBatchNorm

__all__ = ["Adasum", "add_process_set", "allgather", "allgather_async", "allgather_object",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
           "alltoall_async", "Average", "barrier", "broadcast", "broadcast_", "broadcast_async",
           "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "ccl_built", "Compression", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "DistributedOptimizer", "elastic", "global_process_set",
           "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
           "HorovodInternalError", "init", "is_homogeneous", "is_initialized", "join",
           "local_rank", "local_size", "Max", "Min", "MismatchError", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "poll", "ProcessSet", "Product", "rank",
           "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown",
           "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "Sum",
           "SyncBatchNorm", "synchronize"]
