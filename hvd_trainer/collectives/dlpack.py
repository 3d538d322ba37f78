"""DLPack hand-off: pass a framework's ``dltensor`` capsule to a consumer that takes the
``__dlpack__`` protocol (``cupy.from_dlpack``, ``numpy.from_dlpack``), without a copy.

MXNet 1.x, like PyTorch's ``to_dlpack``, hands out bare capsules; the consumers of the array
API want an object with ``__dlpack__`` and ``__dlpack_device__``. :class:`Capsule` is that
object. A capsule can be consumed once.
"""
from typing import Any, Tuple

# DLPack's device types.
CPU, CUDA = 1, 2


class Capsule:
    """A ``dltensor`` capsule on ``device`` = (DLPack device type, device id).

    The producer must have finished writing the memory before it made the capsule (MXNet's
    ``to_dlpack_for_read`` and ``to_dlpack_for_write`` wait for its engine), so the stream a
    consumer names has nothing to wait for.
    """

    def __init__(self, capsule: Any, device: Tuple[int, int]):
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._device
