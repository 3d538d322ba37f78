"""The timeline: phases per tensor as a Chrome trace (Perfetto, chrome://tracing).

``HVD_TIMELINE=file`` or :func:`start_timeline` turns it on (rank 0 writes); off, a phase
costs one call.
"""
import atexit
import contextlib
import json
import threading
import time
from typing import Any, ContextManager, Dict, Iterator, Optional

from hvd_trainer_launch.files.outputs import Output

from . import config, runtime

class Timeline:
    """A Chrome-trace (Perfetto, chrome://tracing) file of phases, one track per tensor.

    Phases: WAIT_FOR_GRADIENT (the trainer waits for backward to write a gradient),
    NEGOTIATE (agreement), COMPRESS, FUSE (packing into and out of fusion buffers; contains
    COMMUNICATE), COMMUNICATE (bytes on the wire), DECODE (decompression) and UPDATE (the
    optimizer). Events are appended as they finish, so a job that dies still leaves a
    readable prefix (the trace format tolerates a missing closing bracket); :meth:`close`
    completes the JSON.
    """

    def __init__(self, path: str):
        # A fresh owner-only file, never through a symlink; a write error (a full disk, a
        # missing folder) warns once on this rank and stops the timeline, not the training.
        self._file = Output(path, what="timeline")
        self._file.write("[\n")
        self._tracks: Dict[str, int] = {}
        self._origin = time.perf_counter()
        self._lock = threading.Lock()

    def _track(self, tensor: str) -> int:
        track = self._tracks.get(tensor)
        if track is None:
            track = self._tracks[tensor] = len(self._tracks)
            self._write({"name": "process_name", "ph": "M", "pid": track, "args": {"name": tensor}})
        return track

    def _write(self, event: Dict[str, Any]) -> None:
        self._file.write(json.dumps(event) + ",\n")

    def record(self, tensor: str, phase: str, start: float, end: float) -> None:
        """Add one complete event: ``phase`` of ``tensor`` between two perf_counter() times."""
        with self._lock:
            self._write({"name": phase, "ph": "X", "pid": self._track(tensor), "tid": 0,
                         "ts": round((start - self._origin) * 1e6, 3),
                         "dur": round((end - start) * 1e6, 3)})

    def close(self) -> None:
        """Finish the JSON array and close the file."""
        with self._lock:
            # A metadata event without a trailing comma closes the array validly.
            self._file.write(json.dumps({"name": "trace_end", "ph": "M", "pid": 0,
                                         "args": {}}) + "\n]\n")
            self._file.close()


_timeline: Optional[Timeline] = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline to ``file_path`` (on rank 0; other ranks record nothing).

    ``mark_cycles`` is accepted for Horovod compatibility; there are no background cycles
    to mark, since collectives run when they are called.
    """
    global _timeline
    stop_timeline()
    if runtime.rank() == 0:
        _timeline = Timeline(file_path)


def stop_timeline() -> None:
    """Stop writing the timeline and close its file; harmless when none is running."""
    global _timeline
    if _timeline is not None:
        _timeline.close()
        _timeline = None


@contextlib.contextmanager
def _span(tensor: str, phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        if _timeline is not None:
            _timeline.record(tensor, phase, start, time.perf_counter())


_OFF = contextlib.nullcontext()


def running() -> bool:
    """Whether a timeline is being written."""
    return _timeline is not None


def span(tensor: str, phase: str) -> ContextManager[None]:
    """Time a phase of ``tensor`` into the timeline; costs one call when the timeline is off."""
    return _span(tensor, phase) if _timeline is not None else _OFF


def _from_environment(st: Any) -> None:
    """At init: HVD_TIMELINE=file starts the timeline, closed at exit."""
    trace = config.env("TIMELINE")
    if trace:
        start_timeline(trace)
        atexit.register(stop_timeline)


runtime.at_start(_from_environment)
runtime.at_abort(stop_timeline)
