"""Automatic names of unnamed collectives, counted per thread.

Ranks match an unnamed call by its automatic name, so the name must say which call it is the
same way on every rank. One count per process set is enough while one thread makes the
calls; two threads that make theirs in different orders on different ranks would pair one
thread's array with the other's (a silently wrong sum when shapes agree). So a thread that
the script started (``threading.Thread``) counts its own calls, under its name:
``noname[<thread name>].N``; threads that start in the same order have the same default
names on every rank (``Thread-1 (...)``), and named threads keep their names.

The main thread, threads that Python did not start (those of TensorFlow, PyTorch or MPI,
whose names follow the order in which they first ran Python) and hvd_trainer's own
communication threads (which run work in the order it was handed) share the process set's
count, ``noname.N``, as Horovod's names do.
"""
import threading
from typing import Dict, Optional

# Past this many threads counted on one process set, the counts of ended threads are dropped.
_KEPT_THREADS = 256
_PREFIX = "noname["


class _Local(threading.local):
    """Per thread: its name as counted (None: not looked up yet; "": the shared count)."""

    tag: Optional[str] = None


_local = _Local()


def share_count() -> None:
    """The calling thread (a communication thread) uses the process set's shared count."""
    _local.tag = ""


def thread_tag() -> str:
    """The calling thread's name as counted ("": it shares the process set's count); fixed
    at its first unnamed collective."""
    tag = _local.tag
    if tag is None:
        thread = threading.current_thread()
        # A thread Python did not start is a _DummyThread, named in order of first contact.
        shared = (thread is threading.main_thread()
                  or isinstance(thread, threading._DummyThread))  # type: ignore[attr-defined]
        tag = _local.tag = "" if shared else thread.name
    return tag


class ThreadCounts:
    """One process set's counts of automatic names of threads that count their own."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}

    def take(self, tag: str) -> str:
        """The next automatic key of the thread ``tag`` (not ""), counted."""
        count = self.counts.get(tag)
        if count is None:
            if len(self.counts) >= _KEPT_THREADS:
                live = {t.name for t in threading.enumerate()}
                self.counts = {t: c for t, c in self.counts.items() if t in live}
            count = 0
        self.counts[tag] = count + 1
        return f"{_PREFIX}{tag}].{count}"

    def copy(self) -> Dict[str, int]:
        """Each thread's count, by name."""
        return dict(self.counts)

    def set_count(self, tag: str, count: int) -> None:
        """Count on from ``count`` on the thread ``tag``."""
        self.counts[tag] = count


def thread_of(key: str) -> str:
    """The thread part of an automatic key: the counting thread's name, "" for the shared
    count (a derived key, ``<key>.M``, has its base key's)."""
    if not key.startswith(_PREFIX):
        return ""
    return key[len(_PREFIX):key.rindex("]")]
