"""Waiting for other ranks, and the stall inspector that watches long waits.

A thread that waits for the other ranks (in an agreement, or in a collective's data phase)
registers its wait (:func:`waiting`). A watchdog thread looks at every rank's waits: a wait
longer than ``HVD_STALL_CHECK_TIME_SECONDS`` logs which ranks have not arrived and where the
others wait (waiting ranks tell each other through the communicators' mailboxes); after
``HVD_STALL_SHUTDOWN_TIME_SECONDS`` it ends the job. Waits poll without sleeping at first,
as MPI's blocking calls do, then sleep a small share of the time waited.
"""
import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any, ContextManager, Dict, NamedTuple, Optional, Tuple, Union

from ..runtime import runtime
from . import scheduler
from ..backends import Communicator, Request

log = logging.getLogger("hvd_trainer")
_OFF = contextlib.nullcontext()

# A wait first polls without sleeping, as MPI's blocking calls do (nearly every wait in a
# training step is shorter), then sleeps between polls for at most 1/20 of the time waited so
# far (so sleeping adds at most 5% to a wait), up to 20 ms. For its first 100 µs it keeps its
# core between polls, as a blocking MPI call's busy wait does: on a busy host a yield hands
# the core to another process for a time slice while the peer is about to answer, and a
# small collective's wait is a few microseconds.
_KEEP_SECONDS = 0.0001
_SPIN_SECONDS = 0.1
# Where this host's ranks outnumber its cores, a wait yields for 1 ms only, then sleeps: a
# rank that yields in a loop is scheduled again at once while the rank it waits for still
# computes, and burns that rank's core. Tests' 3-rank jobs on 2 busy cores spent about 6%
# less CPU so (2026-12-07, docs/getting-started.md#testing); the agreement's own waits are
# shorter (0.18 ms with 8 ranks on 2 cores, below).
_CROWDED_SPIN_SECONDS = 0.001
_spin = _SPIN_SECONDS
_PAUSE_SHARE, _MAX_PAUSE = 0.05, 0.02
# Where this host's ranks outnumber the cores they may run on, a wait keeps its core for no
# time at all: the rank it waits for needs a core to get there (see _start). With 8 ranks on
# 2 cores a step's agreement took 1.6 ms keeping it 100 µs and 0.18 ms not (MPICH's blocking
# allreduce, which yields after its polls, 0.3 ms; benchmarks/agreement.py --scaling).
_keep = _KEEP_SECONDS
# Polls of a wait made before it is registered with the stall watchdog (and has the mailbox
# read after it): a small collective's peer is most often a few microseconds behind, and the
# registration, its clock reads and the mailbox's probe cost more than the wait. 64 polls of
# a pending persistent request take about 30 µs on 2 cores; where ranks outnumber cores,
# one (see _keep). Within 100 µs a wait keeps its core anyway (pause).
_POLLS_UNREGISTERED = 64
_polls = _POLLS_UNREGISTERED


def pause(start: float) -> None:
    """Between polls of a wait that began at ``start`` (monotonic): nothing for the first
    100 µs (none where ranks outnumber cores), then give the core away, by a yield for the
    first moments, then by sleeps of a small share of the time waited."""
    waited = time.monotonic() - start
    if waited < _keep:
        return
    if waited < _spin:
        os.sched_yield()
    else:
        time.sleep(min(_PAUSE_SHARE * waited, _MAX_PAUSE))


def drain_posts(comm: Communicator) -> None:
    """Read the stall posts that have arrived into each peer's last one (see :func:`heard`).

    MPICH may kill a process that exits with unreceived messages, so waits (every one that
    had to wait, the others every few exchanges, see :func:`poll`) and the runtime at exit
    empty the mailbox; it costs one probe when it is empty. The posts
    are kept, not dropped: a wait on a call that other ranks match by name spans many
    agreement rounds, and its inspector reads what arrived during them.
    """
    arrived = comm.collect_posts()
    if arrived:
        with _heard_lock:
            _heard.setdefault(comm, {}).update(arrived)


def heard(comm: Communicator) -> Dict[int, Tuple[int, str]]:
    """Each peer's last stall post on ``comm``: (its exchange count, what it waits for)."""
    drain_posts(comm)
    with _heard_lock:
        return dict(_heard.get(comm, {}))


_heard: "weakref.WeakKeyDictionary[Communicator, Dict[int, Tuple[int, str]]]" = \
    weakref.WeakKeyDictionary()
_heard_lock = threading.Lock()


class Called(NamedTuple):
    """What a wait is for: a collective's kind and name, made into text (``"allreduce 'x'"``)
    only when a wait lasts long enough for the stall inspector to tell it."""

    kind: str
    name: Any

    def __str__(self) -> str:
        return f"{self.kind} {self.name!r}"


# A wait that completes at its first poll drains the mailboxes only every so many exchanges
# (see drain_posts); one that has to wait drains them each time.
_DRAIN_EVERY = 64


def poll(request: Request, schedule: "scheduler.Schedule", comm: Communicator,
         what: Union[str, Called], phase: str, exchange: int) -> None:
    """Poll ``request`` until it completes, giving the core away between polls; raise if
    ``schedule`` is abandoned meanwhile (shutdown: the request is left active).

    A wait that does not complete within its first polls (:data:`_POLLS_UNREGISTERED`) is
    registered with the stall watchdog as :func:`waiting` registers one (``comm``, ``what``,
    ``phase``, ``exchange``), and reads the mailbox afterwards; most waits of a small
    collective complete by then and pay for neither.
    """
    test = request.test
    for _ in range(_polls):
        if test():
            if not exchange % _DRAIN_EVERY:
                drain_posts(comm)
            return
    with _Wait(comm, what, phase, exchange):
        start = time.monotonic()
        # Yield between polls, as MPI's own busy waits do: with more ranks than free cores
        # the rank we wait for may need this core.
        while not request.test():
            if schedule.abandoned:
                raise RuntimeError("hvd_trainer shut down on this rank while an agreement "
                                   "waited for the other ranks")
            pause(start)
    drain_posts(comm)


class _Wait:
    """A thread waiting for other ranks, in an agreement or in a collective's data phase;
    registered with the stall watchdog while its block lasts."""

    __slots__ = ("comm", "what", "phase", "exchange", "start", "inspector", "_me", "_outer")
    inspector: Optional["StallInspector"]  # here: in __init__ it would be evaluated each wait

    def __init__(self, comm: Communicator, what: Union[str, Called], phase: str,
                 exchange: int):
        self.comm, self.what, self.phase, self.exchange = comm, what, phase, exchange
        self.start = time.monotonic()
        self.inspector = None

    def label(self) -> str:
        return str(self.what) if self.phase == "agreement" else f"the data phase of {self.what}"

    def __enter__(self) -> None:
        self._me = threading.get_ident()
        with _waits_lock:
            self._outer = _waits.get(self._me)
            _waits[self._me] = self

    def __exit__(self, *exc: Any) -> None:
        with _waits_lock:
            if self._outer is None:
                del _waits[self._me]
            else:
                _waits[self._me] = self._outer


_waits: Dict[int, _Wait] = {}
_waits_lock = threading.Lock()


def waiting(comm: Communicator, what: Union[str, Called], phase: str,
            exchange: Optional[int] = None) -> ContextManager[Any]:
    """A block in which this thread waits for the other ranks, watched for stalls.

    ``phase`` is "agreement" or "data"; a data-phase wait belongs to the last agreement.
    ``exchange``: the communicator's count of agreement exchanges, where the caller has it.
    """
    if comm.size == 1:
        return _OFF
    return _Wait(comm, what, phase, scheduler.of(comm).exchanges if exchange is None else exchange)


class Watchdog(threading.Thread):
    """The thread that inspects long waits (see :class:`StallInspector`)."""

    def __init__(self, check_seconds: float, shutdown_seconds: float, post: bool):
        super().__init__(name="hvd_trainer-stall", daemon=True)
        self.check_seconds, self.shutdown_seconds, self.post = (check_seconds, shutdown_seconds,
                                                                post)
        deadlines = [t for t in (check_seconds, shutdown_seconds) if t > 0]
        self.tick = min(1.0, max(0.05, min(deadlines) / 10))
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.tick):
            now = time.monotonic()
            # Under the lock, so no wait ends (and no rank leaves) while its inspector posts.
            with _waits_lock:
                for w in _waits.values():
                    if w.inspector is None:
                        w.inspector = StallInspector(w.comm, w.label(), w.exchange, w.start,
                                                     self.check_seconds, self.shutdown_seconds,
                                                     self.post)
                    w.inspector.check(now)

    def stop(self) -> None:
        """End the thread and wait for it (before MPI is finalised)."""
        self.stopped.set()
        self.join()


class StallInspector:
    """Watches one long wait and reports the ranks that have not arrived.

    Halfway to the first deadline this rank posts where it waits ((exchange number, what))
    to every other rank; a waiting rank that receives such a post answers with its own. At
    ``check_seconds`` it logs a warning naming the ranks it has not heard from (they have not
    submitted this collective: still computing, stuck, or gone) and those waiting in a
    different collective; at ``shutdown_seconds`` it logs the same as an error and ends the
    job. Zero disables either.
    """

    def __init__(self, comm: Communicator, what: str, exchange: int, start: float,
                 check_seconds: float, shutdown_seconds: float, post: bool = True):
        self.comm, self.what, self.exchange, self.start = comm, what, exchange, start
        self.check_seconds, self.shutdown_seconds = check_seconds, shutdown_seconds
        self.post = post  # False where MPI cannot take calls from this thread
        deadlines = [t for t in (check_seconds, shutdown_seconds) if t > 0]
        self.announce_after = min(deadlines) / 2 if deadlines else None
        self.peers: Dict[int, Tuple[int, str]] = {}
        self.announced = self.warned = False

    def _announce(self) -> None:
        self.announced = True
        for peer in range(self.comm.size):
            if peer != self.comm.rank:
                self.comm.post(peer, (self.exchange, self.what))

    def check(self, now: float) -> None:
        """Exchange posts and act on the deadlines; call it while the wait goes on."""
        waited = now - self.start
        for source, (exchange, what) in heard(self.comm).items() if self.post else ():
            if exchange < self.exchange or self.peers.get(source) == (exchange, what):
                continue  # from a wait that has ended since, or known
            self.peers[source] = (exchange, what)
            if not self.announced:
                self._announce()
        if self.announce_after is None:
            return
        if self.post and not self.announced and waited >= self.announce_after:
            self._announce()
        if self.shutdown_seconds > 0 and waited >= self.shutdown_seconds:
            log.error(self.report(waited))
            runtime.abort_job(f"stalled for {waited:.1f} s, longer than "
                              f"HVD_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown_seconds:g}; "
                              "ending the job")
        if self.check_seconds > 0 and not self.warned and waited >= self.check_seconds:
            self.warned = True
            log.warning(self.report(waited))

    def report(self, waited: float) -> str:
        """Which ranks have not submitted this collective, and where the others wait."""
        def world(r: int) -> int:
            return runtime.world_rank(self.comm, r)

        here = {self.comm.rank} | {r for r, (n, w) in self.peers.items()
                                   if (n, w) == (self.exchange, self.what)}
        elsewhere = {r: w for r, (n, w) in self.peers.items() if r not in here}
        missing = [r for r in range(self.comm.size) if r not in here and r not in elsewhere]
        parts = [f"stall: rank {world(self.comm.rank)} has waited {waited:.1f} s for "
                 f"{self.what}"]
        if missing:
            listed = ", ".join(str(world(r)) for r in missing)
            parts.append(f"rank{'s' if len(missing) > 1 else ''} {listed} "
                         f"{'have' if len(missing) > 1 else 'has'} not submitted it "
                         "(still computing, stuck, or exited)")
        parts += [f"rank {world(r)} waits for {w} instead" for r, w in sorted(elsewhere.items())]
        return "; ".join(parts)



def pace(since: float) -> float:
    """How long to wait before another round when rounds have matched nothing since
    ``since``: at once at first, then a small share of the time waited (see :func:`pause`)."""
    waited = time.monotonic() - since
    return 0.0 if waited < _spin else min(_PAUSE_SHARE * waited, _MAX_PAUSE)


def _start(st: Any) -> None:
    """At init: whether waits keep their core at first (not where this host's ranks
    outnumber its cores), the stall inspector's thread, when a stall time is set
    (HVD_STALL_CHECK_TIME_SECONDS is 60 s unless set to 0), and the mailboxes' last drain."""
    global _keep, _polls, _spin
    crowded = st.local.size > len(os.sched_getaffinity(0))
    _keep = 0.0 if crowded else _KEEP_SECONDS
    _spin = _CROWDED_SPIN_SECONDS if crowded else _SPIN_SECONDS
    _polls = 1 if crowded else _POLLS_UNREGISTERED
    if st.world.size == 1:
        return
    atexit.register(_empty_mailboxes, st)
    if st.stall_check <= 0 and st.stall_shutdown <= 0:
        return
    st.watchdog = Watchdog(st.stall_check, st.stall_shutdown, post=st.threads_multiple)
    st.watchdog.start()


def _empty_mailboxes(st: Any) -> None:
    """At exit, stop the stall watchdog and drop stall posts nobody read (before mpi4py's
    MPI_Finalize)."""
    if st.watchdog is not None:
        st.watchdog.stop()
    for ps in st.process_sets.values():
        if ps.comm is not None:
            drain_posts(ps.comm)


runtime.at_start(_start)
