"""``cupy.cuda`` of the stand-in: GPUs, streams, events, the runtime and (imported on demand,
as in CuPy) ``cupy.cuda.nccl``."""
from . import runtime
from .device import Device
from .stream import Event, ExternalStream, Stream, get_current_stream

__all__ = ["Device", "Event", "ExternalStream", "Stream", "get_current_stream", "runtime"]
