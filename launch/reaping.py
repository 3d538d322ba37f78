"""What mpiexec leaves behind on this host, found in /proc and killed: a stray ssh or proxy
would hold the job's output open and keep its remote host busy after the job has ended.

Each process is recorded with its start time (:func:`started_at`), so a pid that the system
has reused since is never signalled.
"""
import os
import signal
from typing import Dict, Optional


def started_at(pid: int) -> Optional[bytes]:
    """When process ``pid`` started (its /proc stat field, in clock ticks since boot), telling
    it from a later process that reuses the number; None once it is gone (or without /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[19]
    except (OSError, IndexError):
        return None


def launched(leader: int) -> Dict[int, bytes]:
    """What mpiexec (``leader``) started on this host that may outlive it, with each process's
    start time: its session, and its children in sessions of their own (Hydra's ssh). Open
    MPI's ssh leaves mpiexec's process group but not its session. Empty where /proc is not."""
    found: Dict[int, bytes] = {}
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return found
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
            if leader in (int(fields[1]), int(fields[3])):  # its parent, its session
                found[pid] = fields[19]
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass
    return found


def kill_processes(processes: Dict[int, bytes]) -> None:
    """SIGKILL each of ``processes`` still running since its recorded start time. A stray ssh
    would hold the job's output open and keep its remote host busy."""
    for pid, start in processes.items():
        if started_at(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
