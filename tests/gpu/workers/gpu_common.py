"""What the GPU workers share: the GPUs each rank sees, set before CuPy is imported, the case
runner (tests/parallel/workers/case_runner.py), and every rank's data from its seed.

HVD_TEST_GPU_LAYOUT (set by tests/gpu/gpu.py) places the ranks of a host:
  own      each rank sees one GPU of its own (CUDA_VISIBLE_DEVICES=<local rank>), as Slurm's
           --gpus-per-task gives them: every rank's device 0, all different GPUs;
  rotated  every rank sees every GPU, listed so that its own device (its local rank) is the
           machine's GPU 0: different device numbers, one GPU;
  shared   every rank sees only the machine's first GPU.
"""
import os
import sys
from typing import Callable, Type

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "parallel", "workers"))
from case_runner import run_cases  # noqa: E402,F401 - the workers' runner

__all__ = ["data", "expect", "place_gpus", "run_cases"]


def place_gpus() -> None:
    """Set CUDA_VISIBLE_DEVICES for this rank by HVD_TEST_GPU_LAYOUT (before CuPy starts)."""
    layout = os.environ.get("HVD_TEST_GPU_LAYOUT")
    local = int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
    ranks = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1"))
    if layout == "own":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local)
    elif layout == "rotated":
        order = list(range(1, ranks))
        order.insert(local, 0)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, order))
    elif layout == "shared":
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        os.environ["CUDA_VISIBLE_DEVICES"] = first


def data(r: int, shape, dtype="float32") -> np.ndarray:
    """Rank ``r``'s values of ``shape``: every rank can compute every rank's."""
    return (np.random.default_rng(100 + r).standard_normal(shape) * 10).astype(dtype)


def expect(error: Type[Exception], words: str, call: Callable[[], object]) -> None:
    """``call()`` raises ``error`` with ``words`` in its message."""
    try:
        call()
    except error as e:
        assert words in str(e), str(e)
    else:
        raise AssertionError(f"no {error.__name__} naming {words!r}")
