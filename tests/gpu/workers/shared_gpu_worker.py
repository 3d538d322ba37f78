"""Ranks that share one GPU (HVD_TEST_GPU_LAYOUT=rotated or shared): NCCL itself refuses
them, and forcing hvd_trainer onto NCCL there fails on every rank, naming the fix."""
import os

from gpu_common import place_gpus, run_cases

place_gpus()
import cupy  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

import hvd_trainer as hvd  # noqa: E402
from hvd_trainer import cuda  # noqa: E402

hvd.init()


def nccl_refuses_ranks_that_share_a_gpu() -> None:
    """What hvd_trainer's own check (cuda/ops.py) stands in front of."""
    rank, size = hvd.rank(), hvd.size()
    uid = hvd.broadcast_object(nccl.get_unique_id() if rank == 0 else None, 0, "uid")
    with cupy.cuda.Device(cuda.device()):
        try:
            nccl.NcclCommunicator(size, uid, rank)
        except nccl.NcclError:
            return
    raise AssertionError("NCCL made a communicator of ranks that share a GPU")


def forcing_nccl_on_a_shared_gpu_names_the_fix() -> None:
    hvd.shutdown()
    os.environ["HVD_GPU_COMMUNICATOR"] = "nccl"
    try:
        hvd.init()
        cuda.communicator()
    except RuntimeError as e:
        assert "ranks share a GPU" in str(e) and "HVD_GPU_COMMUNICATOR=mpi" in str(e), str(e)
    else:
        raise AssertionError("HVD_GPU_COMMUNICATOR=nccl made a communicator on a shared GPU")
    finally:
        hvd.shutdown()
        del os.environ["HVD_GPU_COMMUNICATOR"]
        hvd.init()


run_cases({"nccl_refuses_ranks_that_share_a_gpu": nccl_refuses_ranks_that_share_a_gpu,
           "forcing_nccl_on_a_shared_gpu_names_the_fix": forcing_nccl_on_a_shared_gpu_names_the_fix})
