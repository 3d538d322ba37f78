"""Processes that must not outlive the job: what mpiexec leaves behind on this host, found in
/proc and killed (a stray ssh or proxy would hold the job's output open and keep its remote
host busy after the job has ended), and children that the kernel ends when their starter dies.

Each process is recorded with its start time (:func:`started_at`), so a pid that the system
has reused since is never signalled.
"""
import ctypes
import os
import signal
from typing import Callable, Dict, Optional, Sequence

# prctl's option: the signal the kernel sends a process when its parent dies.
PR_SET_PDEATHSIG = 1


def started_at(pid: int) -> Optional[bytes]:
    """When process ``pid`` started (its /proc stat field, in clock ticks since boot), telling
    it from a later process that reuses the number; None once it is gone (or without /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[19]
    except (OSError, IndexError):
        return None


def identity(pid: int) -> str:
    """``pid`` and its start time as one word (``PID:START``), for :func:`still_there`; ''
    once it is gone."""
    start = started_at(pid)
    return f"{pid}:{start.decode()}" if start is not None else ""


def still_there(word: str) -> bool:
    """Whether the process an :func:`identity` names still runs (its pid not reused since)."""
    pid, _, start = word.partition(":")
    return pid.isdigit() and started_at(int(pid)) == start.encode()


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


def die_with_parent(signum: int = signal.SIGKILL,
                    unblock: Sequence[int] = ()) -> Callable[[], None]:
    """Return a preexec_fn that makes the kernel send ``signum`` to the child when this
    process dies (hvdrun's mpiexec, the wrapper's child): no process outlives its starter.
    No-op where prctl is missing. ``unblock``: signals the starter blocks, which the child
    must not inherit blocked."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    parent = os.getpid()

    def preexec():
        if unblock:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, unblock)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signum)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
    return preexec
