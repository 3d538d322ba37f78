"""What runs next on a communicator, and how calls are matched across ranks.

Every collective on a process set's communicator is an :class:`~.jobs.Entry` in that
communicator's :class:`Schedule`: its matching key (the name the user gave, or an automatic
one, see automatic_names.py), its description and its flags. A thread that makes a
collective enqueues its entry and waits; one waiting thread at a time *drives* a round of
agreement (the exchange itself is the caller's function, see agreement.py) over the entries
pending at that moment, and the round decides (matching.py), identically on every rank, which
entries run, in which order, and which raise. Then each decided entry's own thread takes the
*turn* in that order and runs its data phase; the next round waits for the turn to be free.
When and on which thread a call reaches its schedule is the rank's order of work
(work_order.py).

Invariants (unit tests drive them without MPI):

- **One user of the communicator at a time.** Either one thread drives a round, or one
  thread holds the turn (a data phase, a covered block, a joined rank's service); never both,
  never two. The turn is re-entrant for its holder.
- **Same decisions everywhere.** A round's decisions are a pure function of what every rank
  contributed (:func:`~.matching.match`), so every rank runs the same entries in the same
  order.
- **Keys are unique while pending.** A second call with a key that is still pending raises
  :class:`DuplicateNameError` on the rank that made it, at the call, and changes nothing else.
  A named asynchronous call that has run keeps its name *held* until its handle is polled
  done or waited on, or until another collective here starts or ends: reusing a name back
  to back, with nothing between, raises whether or not the peers were quick enough to
  finish the first call already (Horovod's duplicate-name check; a small call can finish in
  one exchange when the peers already wait).
- **Automatic names never mismatch by themselves.** They are taken in program order on the
  thread that makes (or submits) the call, counted per thread (automatic_names.py), so
  threads that interleave their calls differently on different ranks still pair thread by
  thread; an asynchronous job takes its key at submission (:class:`~.jobs.Job`), and the
  further unnamed calls of the same job derive theirs from it. Calls that fail locally before
  they reach the schedule take no key.
"""
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple
import weakref

import numpy as np

from . import automatic_names
from ..runtime import runtime
from ..backends import Communicator
from .jobs import Claim, Entry, Job, running_job, running_park
from .matching import Summary, Verdict


class DuplicateNameError(ValueError):
    """A collective was started with a name that a pending collective of this rank still has."""


class _Use:
    """Who uses a communicator now (shared by every communicator where MPI serialises calls)."""

    def __init__(self) -> None:
        # The condition's lock, held directly where nothing waits on the condition (a
        # Condition's own enter and exit are Python functions, and every collective takes
        # the lock twice).
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.holder: Optional[int] = None
        self.depth = 0
        self.driving = False
        self.waiters = 0  # threads in wait(): nobody to wake when 0, the common case

    def free(self) -> bool:
        return self.holder is None and not self.driving

    def wait(self, timeout: Optional[float] = None) -> None:
        """``cv.wait``, counted (hold ``cv``)."""
        self.waiters += 1
        try:
            self.cv.wait(timeout)
        finally:
            self.waiters -= 1

    def wake(self) -> None:
        """``cv.notify_all`` where a thread waits (hold ``cv``)."""
        if self.waiters:
            self.cv.notify_all()


Round = Callable[[List[Entry]], List[Verdict]]


class Memo(NamedTuple):
    """The last description agreed on a communicator with its digest: the same ``given``
    object (and flag ``count``) next time reuses the digest (see agreement.agree)."""

    given: Any
    count: int
    digest: int
    description: Dict[str, Any]


class Counts(NamedTuple):
    """A rank's counts of automatic names on a communicator: the shared one and each
    thread's that counts its own (see automatic_names)."""

    shared: int
    threads: Dict[str, int]


class _Covered(threading.local):
    """Per thread: how deep it is in covered blocks (a class default: a getattr default
    would cost every collective a caught exception)."""

    depth = 0


class Schedule:
    """The entries and the turn of one communicator (see the module docstring)."""

    def __init__(self, use: _Use):
        self.use = use
        self.pending: List[Entry] = []
        self.ready: Deque[Entry] = deque()
        self.keys: Dict[str, Any] = {}  # pending or reserved keys -> their owner
        self.held: Dict[str, Job] = {}  # names of asynchronous calls that ran (see forget)
        self.unnamed = 0  # automatic names are counted per communicator (shared count)
        self.threads = automatic_names.ThreadCounts()  # and per thread that counts its own
        self.exchanges = 0
        self.peers_joined = False
        self.local = _Covered()  # this thread's covered-block depth
        self.undecided_since: Optional[float] = None  # rounds have decided nothing since
        self.next_round: Optional[float] = None  # then: no round before this time
        self.memo = Memo(None, -1, 0, {})
        self.abandoned = False  # see abandon()

    def abandon(self) -> bool:
        """At shutdown: fail the calls still pending here (other ranks may never make them)
        and start no more rounds; a round already in flight gives up (see
        stall.poll). Returns whether one was in flight or calls were pending, so that the
        communicator may still have an active request."""
        use = self.use
        with use.cv:
            self.abandoned = True
            busy = use.driving or bool(self.pending)
            for entry in self.pending:
                entry.state = "raise"
                entry.failure = RuntimeError(
                    f"collective {entry.key!r} was still pending on this rank when "
                    "hvd_trainer shut down; wait for every handle before shutdown()")
            self.pending.clear()
            use.wake()
        return busy

    # -- names ------------------------------------------------------------------------------
    def open(self, kind: str, given: Optional[str], owner: Any) -> Tuple[str, str, bool, bool]:
        """:meth:`name` a synchronous call of ``kind`` made by ``owner``, and :meth:`claim` the
        communicator for it where it can, in one step; returns (name, key, whether the
        calling thread held the turn already, whether it claimed it now). Claimed, the call
        holds the turn until it ends (``forget`` with ``give``) or its round goes on in
        :meth:`settle`."""
        use, me = self.use, threading.get_ident()
        if use.holder == me or self.held or running_job() is not None:
            name, key = self.name(kind, given, owner)
            return name, key, use.holder == me, False
        with use.lock:
            if given is not None:
                key = name = given
                self._reserve(key, owner)
            else:
                key = self._automatic()
                self.keys[key] = owner  # automatic keys are unique: no check
                name = f"{kind}.{key}"
            if self.pending or self.ready or use.holder is not None or use.driving \
                    or self.abandoned:
                return name, key, False, False
            use.holder, use.depth = me, 1
            return name, key, False, True

    def open_again(self, kind: str, given: Optional[str], owner: Any) -> Optional[Tuple[str, str]]:
        """:meth:`open` where it claims the communicator at once for a call that reserves its
        key (the steady-state fast path, see agreement.again): (name, key) with the turn
        held, or None, having changed nothing, where anything else is pending, decided, held,
        running or reserved under ``given`` here, or the calling thread runs a job."""
        use = self.use
        if use.holder is not None or self.held or running_job() is not None:
            return None
        with use.lock:
            if self.pending or self.ready or use.holder is not None or use.driving \
                    or self.abandoned or given in self.keys:
                return None
            if given is None:
                key = self._automatic()
                name = f"{kind}.{key}"
            else:
                key = name = given
            self.keys[key] = owner
            use.holder, use.depth = threading.get_ident(), 1
        return name, key

    def name(self, kind: str, given: Optional[str], owner: Any) -> Tuple[str, str]:
        """(name, key) for a call of ``kind`` named ``given`` (None: automatic), reserved for
        ``owner`` until :meth:`forget`; raises :class:`DuplicateNameError` if the key is
        still pending here. A call made while its thread holds the turn runs in step inside
        another call and reserves nothing."""
        job = running_job()
        with self.use.cv:
            if self.use.holder == threading.get_ident():
                if given is not None:
                    return given, given
                key = f"noname.{self.unnamed}"
                self.unnamed += 1
                return f"{kind}.{key}", key
            if self.held:
                self._release_held(given, job)
            claim = job.claims.get(self) if job is not None else None
            if claim is not None and not claim.claimed and (given is None) == claim.automatic \
                    and (given is None or given == claim.key):
                claim.claimed = True
                key = claim.key
                self.keys[key] = owner
            else:
                if given is not None:
                    key = given
                elif claim is not None:  # a later unnamed call of the same job
                    key = f"{claim.key}.{job.derived}"
                    job.derived += 1
                else:
                    key = self._automatic()
                self._reserve(key, owner)
        return (f"{kind}.{key}" if given is None else key), key

    def reserve_for(self, job: Job, given: Optional[str]) -> None:
        """Reserve, at submission, the key of ``job``'s first call here (see :class:`Job`)."""
        with self.use.cv:
            if self.held:
                self._release_held(given, job)
            if given is None:
                key = self._automatic()
            else:
                key = given
                self._reserve(key, job)
            self.keys[key] = job
            job.claims[self] = Claim(key, automatic=given is None)

    def _automatic(self) -> str:
        """The calling thread's next automatic key (hold ``use.cv``; see automatic_names)."""
        tag = automatic_names.thread_tag()
        if tag:
            return self.threads.take(tag)
        key = f"noname.{self.unnamed}"
        self.unnamed += 1
        return key

    def counts(self) -> "Counts":
        """This rank's counts of automatic names, for :meth:`align_counts`."""
        return Counts(self.unnamed, self.threads.copy())

    def align_counts(self, key: str, every: Sequence["Counts"]) -> None:
        """The calls with automatic key ``key`` here ran together with calls whose counts
        had drifted apart (see :func:`deadlock`): count on from the highest of the ranks'
        counts ``every`` of that key's thread."""
        tag = automatic_names.thread_of(key)
        if tag:
            self.threads.set_count(tag, max(c.threads.get(tag, 0) for c in every))
        else:
            self.unnamed = max(c.shared for c in every)

    def _reserve(self, key: str, owner: Any) -> None:
        if key in self.keys or key in self.held:
            state = "still pending" if key in self.keys else "just run, its handle not waited on,"
            raise DuplicateNameError(
                f"a collective named {key!r} is {state} on this rank; wait for it "
                "(synchronize its handle) before starting another with that name, or give "
                "this one another name")
        self.keys[key] = owner

    def _release_held(self, given: Optional[str], job: Optional[Job]) -> None:
        """A call with key ``given`` (of ``job``) starts or ends: the names other jobs hold
        are free."""
        for key, holder in list(self.held.items()):
            if key != given and holder is not job:
                del self.held[key]

    def unhold(self, job: Job) -> None:
        """Free the name ``job`` holds here, if it still does."""
        with self.use.cv:
            for key, holder in list(self.held.items()):
                if holder is job:
                    del self.held[key]

    def forget(self, key: str, owner: Any, give: bool = False, ran: bool = False) -> None:
        """Release ``key`` if ``owner`` still holds it; with ``give``, also the turn, if the
        calling thread holds it (:meth:`give`), in the same step. ``ran``: the call ran
        without error; a holding job's given name is then held (see the module docstring)."""
        use, job, keys = self.use, running_job(), self.keys
        with use.lock:
            if keys.get(key) is owner:
                del keys[key]
                claim = job.claims.get(self) if job is not None else None
                if claim is not None and ran and job.hold and claim.key == key \
                        and not claim.automatic:
                    self.held[key] = job
                    job.held.append(self)
            if self.held:
                self._release_held(key, job)
            if give and use.holder == threading.get_ident():
                depth = use.depth = use.depth - 1
                if not depth:
                    use.holder = None
                    if use.waiters:  # use.wake(), without a call in the common case
                        use.cv.notify_all()

    # -- the turn ---------------------------------------------------------------------------
    def holds(self) -> bool:
        """Whether the calling thread holds the turn."""
        return self.use.holder == threading.get_ident()

    def take(self) -> None:
        """Hold the turn (wait until the communicator is free and nothing decided waits)."""
        use, me = self.use, threading.get_ident()
        with use.cv:
            if use.holder == me:
                use.depth += 1
                return
            while not (use.free() and not self.ready):
                use.wait()
            use.holder, use.depth = me, 1

    def give(self) -> None:
        """End one :meth:`take` (or one turn taken by :meth:`settle`)."""
        use = self.use
        with use.lock:
            use.depth -= 1
            if use.depth == 0:
                use.holder = None
                use.wake()

    # -- rounds -----------------------------------------------------------------------------
    def claim(self) -> bool:
        """Take the turn at once if nothing is pending or decided here and the communicator
        is free (the common case: one thread, one call at a time). The caller then makes the
        round's exchange for its own call alone, in its turn: if that decides the call to
        run, the caller goes on holding the turn (end it with :meth:`give`); else it hands
        the round on to :meth:`settle`."""
        use = self.use
        with use.lock:
            if self.pending or self.ready or not use.free() or self.abandoned:
                return False
            use.holder, use.depth = threading.get_ident(), 1
            return True

    def settle(self, entry: Entry, run_round: Round, pace: Callable[[float], float],
               claimed: Optional[Round] = None) -> Optional[np.ndarray]:
        """Enqueue ``entry``, take part in rounds until it is decided, then return its or-ed
        flags holding the turn (end it with :meth:`give`), or raise its failure.

        ``run_round(entries)`` makes one round's exchange and returns its verdicts (the same
        on every rank); ``pace(since)`` is how long to wait before another round after rounds
        that decided nothing since ``since``. ``claimed``: this thread has claimed the
        communicator (:meth:`claim`) and begun a round over ``entry`` alone, which
        ``claimed([entry])`` ends.
        """
        use, me = self.use, threading.get_ident()
        with use.cv:
            if self.abandoned:
                raise RuntimeError(f"collective {entry.key!r} on a process set left at "
                                   "shutdown; call it after init()")
            self.pending.append(entry)
            self.undecided_since = self.next_round = None  # something new: a round at once
            use.wake()
            if claimed is not None:  # the claim's turn becomes this round's drive
                use.holder, use.depth = None, 0
                self._drive(claimed, entry, pace, [entry])
            while True:
                if entry.state == "raise":
                    raise entry.failure
                if entry.state == "run":
                    if self.ready and self.ready[0] is entry and use.free():
                        self.ready.popleft()
                        use.holder, use.depth = me, 1
                        return entry.flags_out
                elif use.free() and not self.ready:
                    wait = 0.0 if self.next_round is None else self.next_round - time.monotonic()
                    if wait <= 0:
                        self._drive(run_round, entry, pace)
                        continue
                    use.wait(wait)
                    continue
                use.wait()

    def _drive(self, run_round: Round, mine: Entry, pace: Callable[[float], float],
               entries: Optional[List[Entry]] = None) -> None:
        """One round over ``entries`` (by default every pending one), with ``use.cv`` held
        on entry and exit (released while exchanging)."""
        use = self.use
        use.driving = True
        entries = list(self.pending) if entries is None else entries
        use.cv.release()
        try:
            verdicts = run_round(entries)
        except BaseException as error:  # the exchange itself failed: so do its entries
            verdicts = [Verdict("raise", e.key, error) for e in entries]
        finally:
            use.cv.acquire()
            use.driving = False
        verdicts = [v for v in verdicts if v.action != "wait"]
        by_key = {e.key: e for e in entries}
        for verdict, key, value in verdicts:
            entry = by_key[key]
            if entry.state != "pending":  # failed by abandon() while the round ran
                continue
            self.pending.remove(entry)
            if verdict == "run":
                entry.state, entry.flags_out = "run", value
                self.ready.append(entry)
            else:
                entry.state, entry.failure = "raise", value
        if verdicts:
            self.undecided_since = self.next_round = None
        else:
            if self.undecided_since is None:
                self.undecided_since = time.monotonic()
            self.next_round = time.monotonic() + pace(self.undecided_since)
        use.wake()
        if mine.state == "pending":
            park = running_park()
            if park is not None:  # let the next asynchronous job start while this one waits
                use.cv.release()
                try:
                    park()
                finally:
                    use.cv.acquire()

    def stuck(self, summaries: Sequence[Summary], grace: float) -> bool:
        """Whether this rank can add nothing that could match: a thread (or a graph's op)
        waits for one of the calls ``summaries`` describes (see :meth:`Entry.summary`), no
        submitted job is still to reach the schedule, and rounds have matched nothing for
        ``grace`` seconds."""
        since = self.undecided_since
        return (since is not None and time.monotonic() - since >= grace
                and any(s.waited or s.in_graph for s in summaries)
                and not any(isinstance(owner, Job) and not owner.claims[self].claimed
                            for owner in list(self.keys.values())))

    # -- covered blocks ---------------------------------------------------------------------
    def covered_depth(self) -> int:
        """How deep the calling thread is in covered blocks here."""
        return self.local.depth

    def set_covered(self, depth: int) -> None:
        self.local.depth = depth


# Without MPI_THREAD_MULTIPLE every communicator shares one user at a time.
_shared_use = _Use()
_schedules: "weakref.WeakKeyDictionary[Communicator, Schedule]" = weakref.WeakKeyDictionary()
_schedules_lock = threading.Lock()


class _Last(NamedTuple):
    """The communicator whose schedule :func:`of` found last (weakly), and that schedule."""

    comm: "weakref.ref[Communicator]"
    schedule: Optional[Schedule]


_last = _Last(weakref.ref(_shared_use), None)  # a referent that is never a communicator


def of(comm: Communicator) -> Schedule:
    """``comm``'s schedule, made on first use."""
    global _last
    last = _last
    if last.comm() is comm:  # most calls use the communicator the last one used
        return last.schedule  # type: ignore[return-value]
    found = _schedules.get(comm)
    if found is None:
        with _schedules_lock:
            found = _schedules.get(comm)
            if found is None:
                multiple = comm.size == 1 or runtime.threads_multiple()
                found = _schedules[comm] = Schedule(_Use() if multiple else _shared_use)
    _last = _Last(weakref.ref(comm), found)
    return found


def _leave(comm: Communicator) -> bool:
    """At shutdown: abandon ``comm``'s schedule, if it has one (see Schedule.abandon)."""
    found = _schedules.get(comm)
    return found is not None and found.abandon()


runtime.at_leave(_leave)
