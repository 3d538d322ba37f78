"""Collectives on GPU arrays (CuPy): NCCL or host-staged MPI underneath, and device kernels for
tensor fusion and gradient compression. The collectives are ``hvd_trainer``'s own, listed here
too; they take CuPy arrays (and NumPy ones) alike.

Importing this package imports CuPy, so it raises ImportError where CuPy is missing;
:func:`hvd_trainer.cuda_built` says whether it can run here.
"""
from ..collectives.ops import (allgather, allreduce, allreduce_, broadcast, broadcast_,
                               grouped_allreduce, grouped_allreduce_, reducescatter)
from .compression import DeviceErrorFeedbackSum, device_codec
from .ops import DEVICE, communicator, device
