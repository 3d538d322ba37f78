"""A script written for Horovod, run unmodified under ``hvdrun --horovod`` by
tests/parallel/test_horovod_shim.py: ``import horovod.torch as hvd`` and ``horovod.mxnet``
are hvd_trainer's. Rank 0 prints ``SHIM <folder>``, the folder its shim was written to, so
the test can check that it is gone after the job."""
import os
import stat
import subprocess
import sys

import mxnet as mx
import numpy as np
import torch

import horovod
import horovod.mxnet as mxhvd
import horovod.torch as hvd
from case_runner import run_cases

hvd.init()
failures = []
SHIM = os.path.dirname(os.path.dirname(horovod.__file__))
if hvd.rank() == 0:
    print(f"SHIM {SHIM}", flush=True)


def rank_values(rank):
    """What each rank contributes: a float64 vector that differs by rank."""
    return np.arange(7, dtype=np.float64) * (rank + 1) + rank


EXPECTED_SUM = sum(rank_values(rank) for rank in range(hvd.size()))


def torch_allreduce():
    total = hvd.allreduce(torch.from_numpy(rank_values(hvd.rank())), op=hvd.Sum, name="t")
    if not np.array_equal(total.numpy(), EXPECTED_SUM):
        failures.append(f"torch Sum {total.numpy()} != NumPy's {EXPECTED_SUM}")
    average = hvd.allreduce(torch.from_numpy(rank_values(hvd.rank())), name="t.avg")
    if not np.allclose(average.numpy(), EXPECTED_SUM / hvd.size()):
        failures.append(f"torch Average {average.numpy()} != {EXPECTED_SUM / hvd.size()}")


def mxnet_allreduce():
    total = mxhvd.allreduce(mx.nd.array(rank_values(mxhvd.rank()), dtype="float64"),
                            op=mxhvd.Sum, name="m")
    if not np.array_equal(total.asnumpy(), EXPECTED_SUM):
        failures.append(f"mxnet sum {total.asnumpy()} != NumPy's {EXPECTED_SUM}")


def root_names():
    import hvd_trainer
    if horovod.run is not hvd_trainer.run or horovod.__version__ != "0.28.1":
        failures.append(f"horovod.run {horovod.run!r}, __version__ {horovod.__version__!r}")
    from horovod.torch.mpi_ops import synchronize
    if synchronize is not hvd.synchronize or hvd.size() != mxhvd.size():
        failures.append("horovod.torch.mpi_ops.synchronize is not horovod.torch's")


def private_folder():
    mode = stat.S_IMODE(os.stat(SHIM).st_mode)
    if mode != 0o700 or os.stat(SHIM).st_uid != os.getuid():
        failures.append(f"{SHIM} has mode {mode:o}, not 700 of this user")


def child_process_imports_it():
    # A process the script starts sees the shim too (PYTHONPATH), not a rank of its own.
    check = "import horovod.torch, hvd_trainer.torch as t; print(horovod.torch.rank is t.rank)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120)
    if out.stdout.strip() != "True":
        failures.append(f"a child's import horovod.torch: {out.stdout} {out.stderr}")


run_cases({"torch_allreduce": torch_allreduce, "mxnet_allreduce": mxnet_allreduce,
           "root_names": root_names, "private_folder": private_folder,
           "child_process_imports_it": child_process_imports_it},
          failures, rank=hvd.rank())
