"""What every GPU test module uses: the CuPy each case runs on, and the jobs that run them.

Every case runs in a job of processes of its own (workers/), three times: with the CPU
stand-in for CuPy and NCCL (standin/, first on the job's PYTHONPATH: every commit, in CI) on
each of its two schedules (cupy/cuda/stream.py: the late one, and the early one), and with
CuPy on this machine's GPUs where it has any (benchmarks/gpu_check.sh). The pytest process
never imports the stand-in. A device case that needs more GPUs than the machine has is skipped,
saying so; docs/gpu.md says what only a device shows.
"""
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence

import pytest

from hvd_trainer.runtime import runtime

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = os.path.join(HERE, "standin")
WORKERS = os.path.join(HERE, "workers")
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "parallel")))
from runner import Cases, case_job, case_names  # noqa: E402

# HVD_TEST_GPU_KINDS (a comma-separated list) runs some kinds alone, as the GPU check does.
KINDS = tuple(k for k in ("standin", "standin-early", "device")
              if k in os.environ.get("HVD_TEST_GPU_KINDS", "standin,standin-early,device")
              .split(","))
# A few small tensors make several fusion buckets and reducer buckets.
SMALL_BUCKETS = {"HVD_FUSION_THRESHOLD": "4096", "HVD_BUCKET_THRESHOLD": "2048"}


def _device_gpus() -> int:
    if not runtime.cuda_built():  # CuPy missing, or no GPU: real CuPy is not imported
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


DEVICE_GPUS = _device_gpus()


def names(script: str) -> List[str]:
    """The case names of worker ``script``."""
    return case_names(os.path.join(WORKERS, script))


def require(kind: str, gpus: int) -> None:
    """Skip a device case on a machine with fewer than ``gpus`` GPUs, and a stand-in case on
    one without a C++ compiler, saying why."""
    if kind != "device" and not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("the CPU stand-in for CuPy builds the CUDA kernels with g++, which is not "
                    "installed here (apt-get install g++)")
    if kind == "device" and DEVICE_GPUS < gpus:
        pytest.skip(f"needs CuPy and {gpus} CUDA GPU(s), this machine has {DEVICE_GPUS} "
                    "(pip install '.[gpu]'; benchmarks/gpu_check.sh runs these on a GPU "
                    "machine); the stand-in case ran the same code")


def job(kind: str, scripts: Sequence[str], np_: int, layout: Optional[str] = None,
        gpus: int = 1, env: Optional[Dict[str, str]] = None, timeout: float = 300) -> Cases:
    """The records of ``scripts`` (one job; several run one after another) on ``np_`` ranks,
    on the stand-in (a machine of ``gpus`` GPUs) or on this machine's GPUs, the ranks placed
    by ``layout`` (workers/gpu_common.py)."""
    require(kind, gpus)
    paths = tuple(os.path.join(WORKERS, s) for s in scripts)
    standin = kind != "device"
    full = {"PYTHONPATH": os.pathsep.join(filter(None, [
        STANDIN if standin else "", WORKERS, os.environ.get("PYTHONPATH")]))}
    if standin:
        full["HVD_STANDIN_GPUS"] = str(gpus)
        full["HVD_STANDIN_SCHEDULE"] = "early" if kind == "standin-early" else "late"
    if layout:
        full["HVD_TEST_GPU_LAYOUT"] = layout
    full.update(env or {})
    script: Any = paths[0] if len(paths) == 1 else paths
    return case_job(script, np_, timeout=timeout, env=full)


def one_rank_job(kind: str) -> Cases:
    """The one-process job: the kernels, the collectives at world size 1 and, on the
    stand-in, its own checks (on a machine of 2 GPUs)."""
    extra = ("standin_worker.py",) if kind == "standin" else ()
    return job(kind, ("kernels_worker.py", "collectives_worker.py") + extra, 1,
               gpus=1 if kind == "device" else 2, env=SMALL_BUCKETS)


def shared_gpu_job(kind: str, np_: int) -> Cases:
    """The collectives on ``np_`` ranks that share one GPU: each rank's own device number
    is the same GPU where the machine has enough GPUs (the stand-in's has 3), else every
    rank sees only the first GPU."""
    gpus = max(DEVICE_GPUS, 1) if kind == "device" else 3
    return job(kind, ("collectives_worker.py", "shared_gpu_worker.py"), np_,
               layout="rotated" if gpus >= np_ else "shared", gpus=gpus, env=SMALL_BUCKETS)
