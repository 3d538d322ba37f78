"""MPI's shared-memory files in /dev/shm (mpi.SEGMENT_PREFIXES) that a rank uses, watched from
the rank's output relay (wrapper.py), which outlives the rank and its wrapper: when the rank is
gone, the relay removes those that MPI left (a rank that failed, ended by ``os._exit`` or was
killed never removes them; MPICH's 2 MiB ``mpich_shm_*`` stayed in about half of such runs).

Only files seen in the rank's own maps or open files go, and each only while it is still the
same file (its inode) and this user's: never another job's. A rank may end a few milliseconds
after MPI made its files (a rank that calls ``os._exit`` after ``init``, peers killed at once
after it), so the relay looks at the rank's open files every :data:`QUICK_SECONDS` until it
finds one (MPICH keeps its file open), for :data:`QUICK_PHASE_SECONDS` at most, and at its
maps (where Open MPI's files show) every :data:`LOOK_SECONDS`. Standard library only.
"""
import os
import socket
import stat
import time
from typing import Dict, List

from hvd_trainer_launch import mpi
from hvd_trainer_launch.processes import started_at

# How often the rank's open files are read until one is MPI's (a listing and a readlink per
# file: tens of microseconds), and for how long after the rank starts.
QUICK_SECONDS = 0.01
QUICK_PHASE_SECONDS = 60.0
# How often the rank's maps are read: until it maps some, and after.
LOOK_SECONDS = 0.25
LOOK_AGAIN_SECONDS = 2.0
_FOLDER = mpi.SHARED_MEMORY + "/"


def _is_segment(path: str) -> bool:
    return path.startswith(_FOLDER) and path[len(_FOLDER):].startswith(mpi.SEGMENT_PREFIXES)


def mapped_segments(pid: int) -> Dict[str, int]:
    """The files of MPI's shared memory (mpi.SEGMENT_PREFIXES) in /dev/shm that process ``pid``
    maps, with their inode numbers; those already removed are left out."""
    found: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            for line in maps:
                fields = line.rstrip(b"\n").split(None, 5)  # address, mode, offset, dev, inode, path
                if len(fields) == 6 and not fields[5].endswith(b" (deleted)") and \
                        _is_segment(os.fsdecode(fields[5])):
                    found[os.fsdecode(fields[5])] = int(fields[4])
    except (OSError, ValueError):  # gone, or not Linux
        pass
    return found


def open_segments(pid: int) -> Dict[str, int]:
    """The files of MPI's shared memory in /dev/shm that process ``pid`` holds open, with
    their inode numbers."""
    found: Dict[str, int] = {}
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not Linux
        return found
    for descriptor in descriptors:
        link = f"/proc/{pid}/fd/{descriptor}"
        try:
            path = os.readlink(link)
            if _is_segment(path):
                found[path] = os.stat(link).st_ino
        except OSError:  # closed meanwhile
            pass
    return found


class Segments:
    """The files of MPI's shared memory that the rank (process ``pid``) uses: see above."""

    def __init__(self, pid: int):
        self.pid, self.started = pid, started_at(pid)
        self.found: Dict[str, int] = {}
        self._quick_until = time.monotonic() + QUICK_PHASE_SECONDS
        self._next_quick = self._next_maps = 0.0

    def wait_seconds(self) -> float:
        """How long the relay may wait before the next :meth:`look`."""
        return max(0.0, min(self._next_quick, self._next_maps) - time.monotonic())

    def look(self) -> None:
        """Note the files the rank holds open or maps now, each at its own pace."""
        now = time.monotonic()
        if self.started is None:
            return
        seen: Dict[str, int] = {}
        if now >= self._next_quick:
            seen.update(open_segments(self.pid))
            quick = not self.found and not seen and now < self._quick_until
            self._next_quick = now + QUICK_SECONDS if quick else float("inf")
        if now >= self._next_maps:
            seen.update(mapped_segments(self.pid))
            self._next_maps = now + (LOOK_AGAIN_SECONDS if self.found or seen else LOOK_SECONDS)
        if seen and started_at(self.pid) == self.started:  # the rank, not a reused number
            self.found.update(seen)

    def remove(self) -> None:
        """Remove what the rank used and MPI left."""
        self._next_maps = 0.0
        self.look()
        for path, inode in self.found.items():
            try:
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_ino == inode and \
                        info.st_uid == os.geteuid():
                    os.unlink(path)
            except OSError:  # already removed (by another rank of this host, or by MPI)
                pass


def _in_use() -> set:
    """Every MPI segment in /dev/shm that some process we can see holds open or maps."""
    used: set = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            used.update(open_segments(int(entry)))
            used.update(mapped_segments(int(entry)))
    return used


def sweep_orphans() -> List[str]:
    """Remove this user's Open MPI segments of this host (``sm_segment.HOST.UID.JOB.RANK``)
    that no process holds open or maps; return their paths. A job killed whole (hvdrun
    SIGKILLed: its ranks and their relays end at once) leaves them, and only a later job on
    the host can remove them, so each rank's wrapper calls this as it starts. The name must
    carry this host and this user, so another user's segments, and another host's that shares
    the folder from a PID namespace we cannot see into, are never candidates."""
    host = socket.gethostname()
    prefixes = tuple(f"sm_segment.{name}.{os.geteuid()}." for name in {host, host.split(".")[0]})
    candidates: Dict[str, int] = {}
    try:
        names = os.listdir(mpi.SHARED_MEMORY)
    except OSError:
        return []
    for name in names:
        path = _FOLDER + name
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if name.startswith(prefixes) and stat.S_ISREG(info.st_mode) and \
                info.st_uid == os.geteuid():
            candidates[path] = info.st_ino
    if not candidates:
        return []
    used = _in_use()
    removed = []
    for path, inode in candidates.items():
        try:
            if path not in used and os.lstat(path).st_ino == inode:
                os.unlink(path)
                removed.append(path)
        except OSError:  # removed meanwhile (another rank of this host sweeps too)
            pass
    return removed
