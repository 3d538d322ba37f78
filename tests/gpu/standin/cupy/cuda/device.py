"""The stand-in machine's GPUs: how many it has, which this process sees, which is current.

``HVD_STANDIN_GPUS`` (default 1) is the number of GPUs of the machine; ``CUDA_VISIBLE_DEVICES``
picks and orders the ones this process sees, as CUDA does (the list ends at its first entry
that is not a GPU of the machine). Device ordinals are indices into that list; the physical
index is what tells two processes' GPUs apart (NCCL's duplicate check, ``pci_bus_id``).
"""
import os
import threading
from typing import List, Optional

__all__ = ["CUDARuntimeError", "Device", "current_id", "physical", "visible_count"]


class CUDARuntimeError(RuntimeError):
    """CuPy's error for a failed CUDA runtime call; ``status`` is the cudaError number."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_NO_DEVICE, _INVALID_DEVICE = 100, 101


def _visible() -> List[int]:
    total = int(os.environ.get("HVD_STANDIN_GPUS", "1"))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(total))
    seen: List[int] = []
    for item in listed.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= total or int(item) in seen:
            break
        seen.append(int(item))
    return seen


_VISIBLE = _visible()  # read once, as the CUDA runtime reads it when it starts
_local = threading.local()


def visible_count() -> int:
    """How many GPUs this process sees; CUDARuntimeError where it sees none."""
    if not _VISIBLE:
        raise CUDARuntimeError(_NO_DEVICE, "cudaErrorNoDevice: no CUDA-capable device is detected")
    return len(_VISIBLE)


def check(ordinal: int) -> int:
    """``ordinal`` if this process sees such a GPU, else CUDA's invalid-ordinal error."""
    if not 0 <= ordinal < visible_count():
        raise CUDARuntimeError(_INVALID_DEVICE, "cudaErrorInvalidDevice: invalid device ordinal")
    return ordinal


def current_id() -> int:
    """This thread's current GPU (0 until a thread selects another)."""
    return getattr(_local, "device", 0)


def physical(ordinal: int) -> int:
    """The machine's index of this process's GPU ``ordinal``."""
    return _VISIBLE[check(ordinal)]


class Device:
    """A GPU of this process; as a context, current on this thread inside it."""

    def __init__(self, device: Optional[int] = None):
        self.id = current_id() if device is None else check(int(device))

    def use(self) -> None:
        """Make this GPU current on this thread."""
        _local.device = self.id

    def __enter__(self) -> "Device":
        _local.__dict__.setdefault("entered", []).append(current_id())
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        _local.device = _local.entered.pop()

    def synchronize(self) -> None:
        """Wait for (here: run) the work of every stream of this GPU."""
        from .stream import synchronize_device  # stream.py imports this module
        synchronize_device(self.id)

    @property
    def pci_bus_id(self) -> str:
        """The GPU's bus address: one per physical GPU of the machine."""
        return f"0000:{physical(self.id):02X}:00.0"

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"
