"""The calls a schedule holds and the asynchronous jobs behind them.

An :class:`Entry` is one collective waiting for its round (see scheduler.py). A :class:`Job`
is an asynchronous call (Horovod's ``*_async``): at submission it reserves its key on each
schedule it will use, so that its automatic name is taken in program order on the thread that
submitted it, and its later unnamed calls derive theirs from it. Per thread: the job the thread
runs now, whether a thread waits for a job's handle (:func:`await_job`), and how the thread
parks while its job waits for a match (see work_order.py).
"""
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from .matching import Summary


class Entry:
    """One collective waiting for its round: ``key`` matches it across ranks, ``description``
    (a dict of plain values with its kind and name) is compared, ``flags`` (booleans or None)
    are or-ed across the ranks that run it."""

    __slots__ = ("key", "description", "flags", "digest", "state", "failure", "flags_out",
                 "synchronous", "automatic", "job")

    def __init__(self, key: str, description: Dict[str, Any], flags: Optional[np.ndarray],
                 digest: int, automatic: bool = False):
        self.key, self.description, self.flags, self.digest = key, description, flags, digest
        self.automatic = automatic  # its key is an automatic name
        self.state = "pending"  # then "run" or "raise"
        self.failure: Optional[BaseException] = None
        self.flags_out: Optional[np.ndarray] = None
        # Made by a thread that waits for it (not an asynchronous job's): while it waits, that
        # thread cannot start the call another rank waits for.
        self.job = running_job()
        self.synchronous = self.job is None

    def waited(self) -> bool:
        """Whether a thread waits for this entry: the thread that made it (a synchronous
        call), or one that waits for its asynchronous job's handle (Horovod's
        ``synchronize``, the torch adapter's synchronous calls), a graph's op excepted."""
        return self.synchronous or bool(self.job is not None and self.job.awaited
                                        and not self.job.in_graph)

    def waited_in_graph(self) -> bool:
        """Whether a graph's op waits for this entry (see :class:`Job`)."""
        return bool(self.job is not None and self.job.awaited and self.job.in_graph)

    def summary(self) -> "Summary":
        """What the other ranks see of this entry when heads differ."""
        return Summary(self.key, self.description, self.waited(), self.automatic,
                       self.waited_in_graph())


@dataclasses.dataclass
class Claim:
    """A key that an asynchronous job reserved on one schedule at submission."""

    key: str
    automatic: bool  # an automatic name, not one the caller gave
    claimed: bool = False  # its first call here has taken it


class Job:
    """The keys an asynchronous job reserved when it was submitted, one per schedule, for its
    first collective there; the job's later unnamed calls derive their keys from it.

    ``in_graph``: the job is an op of a TensorFlow graph, whose other ops TensorFlow may
    still start, in any order, while this one waits; a wait for it counts only where
    another rank waits outside a graph (see :func:`matching.deadlocked`)."""

    def __init__(self, hold: bool = False, in_graph: bool = False) -> None:
        self.claims: Dict[Any, Claim] = {}  # by scheduler.Schedule
        self.derived = 0
        self.awaited = 0  # threads that wait for this job's handle now (see await_job)
        self.hold = hold  # its given name stays held after it ran (see Schedule.forget)
        self.in_graph = in_graph
        self.held: List[Any] = []  # scheduler.Schedule

    def unhold(self) -> None:
        """Its handle was polled done or waited on: the name it held is free again."""
        with _await_lock:  # a handle may be polled on several threads
            held, self.held = self.held, []
        for schedule in held:
            schedule.unhold(self)

    def release(self) -> None:
        """Give back the reservations the job never used (it ended without that call)."""
        for schedule, claim in list(self.claims.items()):
            if not claim.claimed:
                schedule.forget(claim.key, self)
        self.claims.clear()


class _Context(threading.local):
    """Per thread: the Job it runs, and how it parks (see Schedule.settle). Defaults as class
    attributes: a getattr default would cost a caught exception in every collective."""

    job: Optional[Job] = None
    park: Optional[Callable[[], None]] = None


_context = _Context()
_await_lock = threading.Lock()


@contextlib.contextmanager
def await_job(job: Optional[Job]) -> Iterator[None]:
    """The calling thread waits for ``job``'s handle in this block: the job's entries count
    as waited for (see :meth:`Schedule.stuck`), as a synchronous call's do."""
    if job is None:
        yield
        return
    with _await_lock:
        job.awaited += 1
    try:
        yield
    finally:
        with _await_lock:
            job.awaited -= 1


def running_job() -> Optional[Job]:
    """The asynchronous job the calling thread runs, if any."""
    return _context.job


def set_job(job: Optional[Job], park: Optional[Callable[[], None]]) -> None:
    """Mark the calling thread as running ``job``; ``park()`` lets the next job start while
    this one waits for a match (the communication thread's, see :func:`start`)."""
    _context.job, _context.park = job, park


def running_park() -> Optional[Callable[[], None]]:
    """How the calling thread lets the next job start while its own waits for a match (None:
    it runs no asynchronous job, or cannot park)."""
    return _context.park
