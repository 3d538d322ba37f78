"""Agreement between ranks before a collective runs.

Every collective first exchanges an 8-byte digest of what each rank is about to do (kind,
names, dtypes, shapes, op, root, scale factors), in one small allreduce, or in an allgather
that also carries an integer the collective needs anyway (the first dimension for allgather). If the digests differ, the ranks exchange the full
descriptions and every rank raises the same :class:`MismatchError`, naming the tensor, the
field and each rank's value. So a disagreement never hangs and never reads past a buffer.

The timeline (``HVD_TIMELINE=file`` or :func:`start_timeline`) records each collective's
phases as a Chrome trace.
"""
import contextlib
import hashlib
import json
import threading
import time
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence

import numpy as np

from . import runtime
from .backends import Communicator


class MismatchError(RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank alike."""


def _digest(description: Dict[str, Any]) -> int:
    raw = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _raise_mismatch(comm: Communicator, description: Dict[str, Any]) -> None:
    every = comm.allgather_object(description)
    raise MismatchError(describe_mismatch(every))


def agree(comm: Communicator, description: Dict[str, Any]) -> None:
    """Check that every rank describes the same collective, in one tiny allreduce.

    ``description`` maps field names to plain values; its ``tensors`` entry, if any, is a
    list of per-tensor dicts. Raise :class:`MismatchError` on all ranks if any differ.
    """
    if comm.size == 1:
        return
    digest = _digest(description)
    # max(d) == -max(-d) exactly when every rank's digest is the same.
    both = np.array([digest, -digest], np.int64)
    comm.allreduce(both, "max")
    if both[0] != -both[1]:
        _raise_mismatch(comm, description)


def agree_gather(comm: Communicator, description: Dict[str, Any], extra: int) -> List[int]:
    """:func:`agree`, also returning every rank's ``extra`` (e.g. its first dimension)."""
    if comm.size == 1:
        return [extra]
    mine = np.array([_digest(description), extra], np.int64)
    gathered = np.empty(2 * comm.size, np.int64)
    comm.allgatherv(mine, gathered, [2] * comm.size)
    digests = gathered[0::2]
    if (digests != digests[0]).any():
        _raise_mismatch(comm, description)
    return gathered[1::2].tolist()


def _differing(values: Sequence[Any]) -> bool:
    return any(v != values[0] for v in values)


def _by_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def describe_mismatch(every: Sequence[Dict[str, Any]]) -> str:
    """One message naming the first field (and tensor) on which the ranks' descriptions differ."""
    first = every[0]
    what = f"{first.get('kind', 'collective')} {first.get('name')!r}"
    for field in first:
        if field == "tensors":
            continue
        values = [d.get(field) for d in every]
        if _differing(values):
            return f"{what}: ranks disagree on {field} ({_by_rank(values)})"
    counts = [len(d.get("tensors", ())) for d in every]
    if _differing(counts):
        return f"{what}: ranks disagree on the number of tensors ({_by_rank(counts)})"
    for i, tensor in enumerate(first.get("tensors", ())):
        for field in tensor:
            values = [d["tensors"][i][field] for d in every]
            if _differing(values):
                return (f"{what}: ranks disagree on {field} of tensor {i} "
                        f"{tensor.get('name')!r} ({_by_rank(values)})")
    return f"{what}: ranks disagree ({_by_rank(every)})"


class Timeline:
    """A Chrome-trace (Perfetto, chrome://tracing) file of collective phases, one track per tensor.

    Events are appended as they finish, so a job that dies still leaves a readable prefix
    (the trace format tolerates a missing closing bracket); :meth:`close` completes the JSON.
    """

    def __init__(self, path: str):
        self._file = open(path, "w")
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


def span(tensor: str, phase: str) -> ContextManager[None]:
    """Time a phase of a collective into the timeline; costs almost nothing when it is off."""
    return _span(tensor, phase) if _timeline is not None else contextlib.nullcontext()
