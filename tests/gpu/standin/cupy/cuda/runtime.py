"""The CUDA runtime calls of the stand-in: how many GPUs this process sees, and what they are."""
from typing import Any, Dict

from .device import CUDARuntimeError, check, visible_count

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDeviceProperties", "runtimeGetVersion"]


def getDeviceCount() -> int:
    """The GPUs this process sees (HVD_STANDIN_GPUS, filtered by CUDA_VISIBLE_DEVICES)."""
    return visible_count()


def getDeviceProperties(device: int) -> Dict[str, Any]:
    """The properties the project reads: the name."""
    check(device)
    return {"name": b"hvd_trainer CPU stand-in"}


def runtimeGetVersion() -> int:
    """No CUDA runtime: 0."""
    return 0
