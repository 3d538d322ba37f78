"""horovod.mxnet's API: a Horovod script runs unchanged after `import hvd_trainer.mxnet as hvd`.

Runtime functions, process sets, reduction ops and compressors come from the framework-free
core; the collectives here take and return NDArrays.
"""
from hvd_trainer_launch.installs import MXNET, require

require("mxnet", MXNET, "hvd_trainer.mxnet")  # first: a missing MXNet says how to add it
from ..compression import Compression  # noqa: E402
from ..coordination.messages import MismatchError
from ..runtime.timeline import start_timeline, stop_timeline
from ..collectives.arguments import Average, Max, Min, Product, Sum
from ..coordination.process_sets import add_process_set, init, remove_process_set
from ..runtime.runtime import (ProcessSet, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                               gloo_built, gloo_enabled, global_process_set, is_homogeneous,
                               is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                               mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from .ops import (allgather, allgather_object, allreduce, allreduce_, alltoall, broadcast,
                  broadcast_, broadcast_object, grouped_allgather, grouped_allreduce,
                  grouped_allreduce_, grouped_reducescatter, reducescatter)
from .optimizer import DistributedOptimizer
from .parameters import broadcast_parameters
from .trainer import DistributedTrainer
from . import elastic

__all__ = ["add_process_set", "allgather", "allgather_object", "allreduce", "allreduce_",
           "alltoall", "Average", "broadcast", "broadcast_", "broadcast_object",
           "broadcast_parameters", "ccl_built", "Compression", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "DistributedOptimizer", "DistributedTrainer", "elastic",
           "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
           "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "init",
           "is_homogeneous", "is_initialized", "local_rank", "local_size", "Max", "Min",
           "MismatchError", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
           "ProcessSet", "Product", "rank", "reducescatter", "remove_process_set", "rocm_built",
           "shutdown", "size", "start_timeline", "stop_timeline", "Sum"]
