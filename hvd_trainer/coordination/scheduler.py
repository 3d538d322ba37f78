"""What runs next on a communicator, on which thread, and how calls are matched across ranks.

Every collective on a process set's communicator is an :class:`Entry` in that
communicator's :class:`Schedule`: its matching key (the name the user gave, or an automatic
one, see automatic_names.py), its description and its flags. A thread that makes a
collective enqueues its entry and waits; one waiting thread at a time *drives* a round of
agreement (the exchange itself is the caller's function, see agreement.py) over the entries
pending at that moment, and the round decides, identically on every rank, which entries
run, in which order, and which raise. Then each decided entry's own thread takes the *turn*
in that order and runs its data phase; the next round waits for the turn to be free.

Before a call reaches a schedule, the rank's *order of work* decides when it is made, and on
which thread; it is one per process, since a rank's program order spans its process sets
(and, where MPI serialises calls, its communicators share one user). Every way of making a
collective goes through it: a synchronous call (:func:`flush` with ``here``, from
agreement.py and joined.py), an asynchronous one (:func:`start`, under handles.py's
``submit`` and the adapters' ``*_async``) and a training step's program (:func:`defer`,
:func:`start` and :func:`run_deferred`, from reducer.py):

- :func:`start` hands work to a *communication thread*, which runs the handed work in order.
  When that work waits for a match that has not come (other ranks submitted theirs in another
  order), its thread *parks*: the next work starts on another thread, so calls submitted in
  different orders on different ranks still meet.
- :func:`defer` queues work in that order without waking the thread (a training step whose
  gradients are still to come): whatever the process starts next goes behind it. The next
  :func:`start` hands it to the thread first, a synchronous call (``flush(here=True)``) runs
  it first on the calling thread, and if nothing comes first :func:`run_deferred` runs it
  where its result is needed: a step whose gradients all came at once costs no thread
  switches, yet is ordered as if it had been submitted.
- A thread may register a *closer* (:func:`on_own_collective`): a collective that the same
  thread starts later (submitted, or synchronous) runs it first. A training step that began
  at a hook registers one (steps.py), so that a collective the script starts between backward
  and the step's close first closes the step, instead of waiting behind a step that waits
  for the script.

Invariants (unit tests drive them without MPI):

- **One user of the communicator at a time.** Either one thread drives a round, or one
  thread holds the turn (a data phase, a covered block, a joined rank's service); never both,
  never two. The turn is re-entrant for its holder.
- **Same decisions everywhere.** A round's decisions are a pure function of what every rank
  contributed (:func:`match`), so every rank runs the same entries in the same order.
- **Fast path.** When every rank's oldest pending entry is the same call, one small exchange
  decides it; otherwise the ranks exchange their pending lists and match by key (Horovod's
  coordinator matches by name): the keys pending on every rank run in the order of the lowest
  active rank's list; a key whose descriptions differ raises a mismatch on every rank; keys
  not yet pending everywhere wait for a later round.
- **No wait forever.** When every active rank waits for a call (its own thread's, or an
  asynchronous one whose handle a thread waits for) and rounds match nothing for a moment,
  the ranks settle it by :func:`deadlock`, joined ranks or not.
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
  thread; an asynchronous job takes its key at submission (:class:`Job`), and the further
  unnamed calls of the same job derive theirs from it. Calls that fail locally before they
  reach the schedule take no key.
- **Handed work runs in the order of handing.** Work handed to the communication thread
  starts in that order; a later one starts before an earlier one ends only when the earlier
  one has parked (it waits for a match).
- **Deferred work goes first.** At most one work is deferred at a time; it runs before any
  work the process starts after it (on the thread, or here for a synchronous call), and
  exactly once.
- **Closers run on their own thread only,** before that thread's next collective, until one
  returns True or is forgotten; other threads' collectives never run them.
"""
import contextlib
import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import (Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Sequence,
                    Tuple)

import weakref

import numpy as np

from . import automatic_names
from ..runtime import runtime
from ..backends import Communicator


class DuplicateNameError(ValueError):
    """A collective was started with a name that a pending collective of this rank still has."""


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
        ``synchronize``, the torch adapter's synchronous calls)."""
        return self.synchronous or bool(self.job is not None and self.job.awaited)

    def summary(self) -> "Summary":
        """What the other ranks see of this entry when heads differ."""
        return Summary(self.key, self.description, self.waited(), self.automatic)


@dataclasses.dataclass
class Claim:
    """A key that an asynchronous job reserved on one schedule at submission."""

    key: str
    automatic: bool  # an automatic name, not one the caller gave
    claimed: bool = False  # its first call here has taken it


class Job:
    """The keys an asynchronous job reserved when it was submitted, one per schedule, for its
    first collective there; the job's later unnamed calls derive their keys from it."""

    def __init__(self, hold: bool = False) -> None:
        self.claims: Dict["Schedule", Claim] = {}
        self.derived = 0
        self.awaited = 0  # threads that wait for this job's handle now (see await_job)
        self.hold = hold  # its given name stays held after it ran (see Schedule.forget)
        self.held: List["Schedule"] = []

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


class _Use:
    """Who uses a communicator now (shared by every communicator where MPI serialises calls)."""

    def __init__(self) -> None:
        self.cv = threading.Condition(threading.Lock())
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


class Verdict(NamedTuple):
    """A round's decision on one entry: ``action`` "run" (``value``: the agreed description
    or flags), "raise" (``value``: the exception) or "wait" (the entry stays pending: a
    barrier, see :func:`_verdict_on_mismatch`)."""

    action: str
    key: str
    value: Any


Round = Callable[[List[Entry]], List[Verdict]]


class Memo(NamedTuple):
    """The last description agreed on a communicator with its digest: the same ``given``
    object (and flag ``count``) next time reuses the digest (see agreement.agree)."""

    given: Any
    count: int
    digest: int
    description: Dict[str, Any]


class Summary(NamedTuple):
    """What the other ranks see of a pending entry when the ranks' heads differ."""

    key: str
    description: Dict[str, Any]
    waited: bool  # a thread waits for it, as of now
    automatic: bool  # its key is an automatic name


Failure = Callable[[List[Optional[Dict[str, Any]]]], BaseException]


class Counts(NamedTuple):
    """A rank's counts of automatic names on a communicator: the shared one and each
    thread's that counts its own (see automatic_names)."""

    shared: int
    threads: Dict[str, int]


def match(lists: Sequence[Optional[Sequence[Summary]]], failure: Failure,
          single: bool = False, me: int = -1) -> List[Verdict]:
    """Decide a round from every rank's pending list (None: a joined rank), for rank ``me``.

    The keys pending on every active rank, in the lowest active rank's order; each runs when
    all its descriptions are equal and free of argument errors, else raises
    ``failure(descriptions by rank)`` (see :func:`_verdict_on_mismatch` for barriers). ``single``:
    decide at most the first such key.
    """
    active = [lst for lst in lists if lst is not None]
    if not active:
        return []
    by_rank = [{s.key: s.description for s in lst} for lst in lists if lst is not None]
    verdicts: List[Verdict] = []
    for head in active[0]:
        key = head.key
        if not all(key in d for d in by_rank[1:]):
            continue
        every = [None if lst is None else {s.key: s.description for s in lst}[key]
                 for lst in lists]
        described = [d for d in every if d is not None]
        first = described[0] if described else None
        if any("error" in d for d in described) or any(d != first for d in described):
            verdicts.append(_verdict_on_mismatch(key, every, me, failure))
        else:
            verdicts.append(Verdict("run", key, first))
        if single:
            break
    return verdicts


def _verdict_on_mismatch(key: str, every: List[Optional[Dict[str, Any]]], me: int,
               failure: Failure) -> Verdict:
    """Rank ``me``'s verdict on calls ``every`` (by rank) that cannot run together.

    A barrier waits for every rank: when some ranks wait in one and the others in other
    calls, the others' calls raise, naming the barrier, and the barrier goes on waiting (a
    rank that ran ahead or fell behind, as a script that caught a failure on some ranks only
    does, gets an error at each call until it reaches the barrier too, where the ranks meet
    again). Otherwise every rank raises.
    """
    at_barrier = [r for r, d in enumerate(every) if d is not None and d.get("kind") == "barrier"]
    if not at_barrier or len(at_barrier) == sum(d is not None for d in every):
        return Verdict("raise", key, failure(every))
    if me in at_barrier:
        return Verdict("wait", key, None)
    error = failure(every)
    ranks = ", ".join(map(str, at_barrier))
    many = len(at_barrier) > 1
    error.args = (f"{error.args[0]}; rank{'s' if many else ''} {ranks} wait{'' if many else 's'} "
                  "in a barrier for this rank, and go on waiting until it calls barrier() "
                  "too",) + error.args[1:]
    return Verdict("raise", key, error)


def _unnamed(description: Any) -> Any:
    """``description`` without names, which hold the automatic counters."""
    if isinstance(description, dict):
        return {k: _unnamed(v) for k, v in description.items() if k != "name"}
    if isinstance(description, list):
        return [_unnamed(v) for v in description]
    return description


def _oldest_waited(lists: Sequence[Optional[Sequence[Summary]]]) -> List[Optional[Summary]]:
    """Each rank's oldest call that a thread waits for (None: a joined rank, or none)."""
    return [None if lst is None else next((s for s in lst if s.waited), None) for lst in lists]


def _alike_unnamed(oldest: Sequence[Summary]) -> bool:
    """Whether the calls ``oldest`` are all automatically named and alike but for names."""
    first = _unnamed(oldest[0].description) if oldest else None
    return bool(oldest) and all(s.automatic for s in oldest) and \
        all(_unnamed(s.description) == first for s in oldest)


def deadlock_runs(lists: Sequence[Optional[Sequence[Summary]]]) -> bool:
    """Whether, in a deadlock (see :func:`deadlock`), the active ranks' oldest waited calls
    run together: all automatically named by threads of one name, and alike but for their
    names' counts."""
    oldest = [s for s in _oldest_waited(lists) if s is not None]
    return _alike_unnamed(oldest) and \
        len({automatic_names.thread_of(s.key) for s in oldest}) == 1


def deadlock(lists: Sequence[Optional[Sequence[Summary]]], me: int,
             failure: Failure) -> List[Verdict]:
    """When no key matched and every active rank is stuck (see :meth:`Schedule.stuck`), each
    active rank's oldest waited call decides.

    If all are automatically named by threads of one name and alike but for their names,
    they run together (the ranks' counts of automatic names had drifted apart, say after a
    call that failed on one rank before it reached the others; no automatic name causes a
    mismatch by itself). Otherwise they cannot run together (the ranks wait for calls that
    differ, or come from threads whose names differ, and none can start another): see
    :func:`_verdict_on_mismatch`. Joined ranks (None in ``lists``) serve the calls that run,
    as in any round; join() itself, like a barrier, waits for every rank.
    """
    oldest = _oldest_waited(lists)
    mine = oldest[me]
    if mine is None:
        return []
    if deadlock_runs(lists):
        return [Verdict("run", mine.key, mine.description)]
    verdict = _verdict_on_mismatch(mine.key, [None if s is None else s.description
                                              for s in oldest], me, failure)
    if verdict.action == "raise" and _alike_unnamed([s for s in oldest if s is not None]):
        error = verdict.value
        error.args = (f"{error.args[0]}; automatic names are counted per thread, by the "
                      "thread's name: make unnamed collectives from threads named alike on "
                      "every rank (threads started in the same order have the same default "
                      "names), or give each call a name=",) + error.args[1:]
    return [verdict]


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
        self.local = threading.local()  # .covered: this thread's covered-block depth
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
        use, job = self.use, running_job()
        with use.cv:
            if self.keys.get(key) is owner:
                del self.keys[key]
                claim = job.claims.get(self) if job is not None else None
                if claim is not None and ran and job.hold and claim.key == key \
                        and not claim.automatic:
                    self.held[key] = job
                    job.held.append(self)
            if self.held:
                self._release_held(key, job)
            if give and use.holder == threading.get_ident():
                use.depth -= 1
                if use.depth == 0:
                    use.holder = None
                    use.wake()

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
        with use.cv:
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
        with use.cv:
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
            park = _context.park
            if park is not None:  # let the next asynchronous job start while this one waits
                use.cv.release()
                try:
                    park()
                finally:
                    use.cv.acquire()

    def stuck(self, summaries: Sequence[Summary], grace: float) -> bool:
        """Whether this rank can add nothing that could match: a thread waits for one of the
        calls ``summaries`` describes (see :meth:`Entry.summary`), no submitted job is still
        to reach the schedule, and rounds have matched nothing for ``grace`` seconds."""
        since = self.undecided_since
        return (since is not None and time.monotonic() - since >= grace
                and any(s.waited for s in summaries)
                and not any(isinstance(owner, Job) and not owner.claims[self].claimed
                            for owner in list(self.keys.values())))

    # -- covered blocks ---------------------------------------------------------------------
    def covered_depth(self) -> int:
        """How deep the calling thread is in covered blocks here."""
        return getattr(self.local, "covered", 0)

    def set_covered(self, depth: int) -> None:
        self.local.covered = depth


# Without MPI_THREAD_MULTIPLE every communicator shares one user at a time.
_shared_use = _Use()
_schedules: "weakref.WeakKeyDictionary[Communicator, Schedule]" = weakref.WeakKeyDictionary()
_schedules_lock = threading.Lock()


def of(comm: Communicator) -> Schedule:
    """``comm``'s schedule, made on first use."""
    found = _schedules.get(comm)
    if found is None:
        with _schedules_lock:
            found = _schedules.get(comm)
            if found is None:
                multiple = comm.size == 1 or runtime.threads_multiple()
                found = _schedules[comm] = Schedule(_Use() if multiple else _shared_use)
    return found


def _leave(comm: Communicator) -> bool:
    """At shutdown: abandon ``comm``'s schedule, if it has one (see Schedule.abandon)."""
    found = _schedules.get(comm)
    return found is not None and found.abandon()


runtime.at_leave(_leave)


# -- the rank's order of work: communication threads, deferred steps, closers --------------
class _Work(NamedTuple):
    """Work for a communication thread: ``run`` completes ``future``; ``job`` is the
    asynchronous job it runs for (None for a deferred step)."""

    future: "Future[Any]"
    run: Callable[[], Any]
    job: Optional[Job]


_lock = threading.Lock()
_queue: Deque[_Work] = deque()  # handed to the thread, not started
_busy = 0  # work handed to the thread and not finished
_slot = False  # a thread runs the queue's work in order (none is parked)
_idle: List["_Worker"] = []
_deferred: Optional[_Work] = None
_closers: Dict[int, List[Callable[[], bool]]] = {}  # by thread ident
_IDLE_SECONDS = 30.0  # an idle worker thread ends after this long without work


class _Worker:
    """A thread that runs handed work in order while it holds the slot (see park())."""

    def __init__(self, work: _Work):
        self.work: Optional[_Work] = work
        self.parked = False
        self.wake = threading.Condition(_lock)
        threading.Thread(target=self._loop, name="hvd_trainer-comm", daemon=True).start()

    def _park(self) -> None:
        """This work waits for a match: let the next work start on another thread."""
        global _slot
        with _lock:
            if not self.parked:
                self.parked = True
                _slot = False
                _dispatch_locked()

    def _loop(self) -> None:
        global _busy, _slot
        automatic_names.share_count()  # it runs work in the order the work was handed
        while True:
            future, work, job = self.work
            set_job(job, self._park)
            try:
                _complete(future, work)
            finally:
                set_job(None, None)
                if job is not None:
                    job.release()
            with _lock:
                _busy -= 1
                self.work = None
                if self.parked:  # the slot went on without it
                    self.parked = False
                elif _queue:
                    self.work = _queue.popleft()
                    continue
                else:
                    _slot = False
                if _queue and not _slot:
                    _slot = True
                    self.work = _queue.popleft()
                    continue
                _idle.append(self)
                if not self.wake.wait_for(lambda: self.work is not None, _IDLE_SECONDS):
                    _idle.remove(self)
                    return


def _dispatch_locked() -> None:
    """Start the queue's next work if no thread runs the queue (the caller holds ``_lock``)."""
    global _slot
    if _slot or not _queue:
        return
    _slot = True
    work = _queue.popleft()
    if _idle:
        worker = _idle.pop()
        worker.work = work
        worker.wake.notify()
    else:
        _Worker(work)


class _Submitted(Future):
    """The future of submitted work, with the key reservations of its collective (if any):
    while a thread waits for its result, the collective counts as waited for (see
    :func:`await_job`), so ranks that all wait for calls that cannot match raise instead
    of waiting forever."""

    def __init__(self, job: Optional[Job]):
        super().__init__()
        self.job = job

    def result(self, timeout: Optional[float] = None) -> Any:
        with await_job(self.job):
            try:
                return super().result(timeout)
            finally:
                if self.job is not None and super().done():
                    self.job.unhold()

    def done(self) -> bool:
        finished = super().done()
        if finished and self.job is not None:
            self.job.unhold()
        return finished


def _complete(future: "Future[Any]", work: Callable[[], Any]) -> None:
    try:
        result = work()
    except BaseException as e:  # the waiter raises it
        future.set_exception(e)
    else:
        future.set_result(result)


def _hand(item: _Work) -> None:
    """Give ``item`` to the thread (the caller holds ``_lock``)."""
    global _busy
    _busy += 1
    _queue.append(item)
    _dispatch_locked()


def _job(name: Optional[str], process_set: Any, hold: bool) -> Optional[Job]:
    """The key reservation of a collective submitted now (see Job)."""
    if process_set is None:
        return None
    job = Job(hold)
    of(runtime.communicator(process_set)).reserve_for(job, name)
    return job


def start(work: Callable[[], Any], name: Optional[str] = None,
          process_set: Any = None, waited: bool = True) -> "Future[Any]":
    """Run ``work()`` on the communication thread, behind what was submitted or deferred
    before (after this thread's closers); its future holds the result.

    With ``process_set``, ``work`` is a collective named ``name`` on it: its name (or its
    automatic one) is taken now, in this thread's program order, and a name still pending
    raises :class:`DuplicateNameError` here. With ``waited=False`` a thread waiting for the
    future does not make the collective count as waited for (a graph op that TensorFlow runs
    beside the graph's others, in any order): it waits for its match however long.
    """
    _close()
    job = _job(name, process_set, waited)
    future: "Future[Any]" = _Submitted(job) if waited else Future()
    with _lock:
        _flush_locked()
        _hand(_Work(future, work, job))
    return future


def defer(work: Callable[[], Any]) -> "Future[Any]":
    """Queue ``work()`` in the thread's order without waking it (see the module docstring);
    handed to the thread at once when the thread still has work, or when something else is
    deferred."""
    global _deferred
    future: "Future[Any]" = Future()
    with _lock:
        if _busy or _deferred is not None:
            _flush_locked()
            _hand(_Work(future, work, None))
        else:
            _deferred = _Work(future, work, None)
    return future


def _flush_locked() -> None:
    global _deferred
    if _deferred is not None:
        _hand(_deferred)
        _deferred = None


def on_own_collective(closer: Callable[[], bool]) -> None:
    """Call ``closer()`` when this thread next starts a collective (before it), until it
    returns True once or :func:`forget_closer` removes it."""
    with _lock:
        _closers.setdefault(threading.get_ident(), []).append(closer)


def forget_closer(closer: Callable[[], bool]) -> None:
    """Remove ``closer`` (registered by this thread), if it is still there."""
    with _lock:
        mine = _closers.get(threading.get_ident(), [])
        if closer in mine:
            mine.remove(closer)


def _close() -> None:
    """Run this thread's closers (see :func:`on_own_collective`)."""
    if not _closers:
        return
    me = threading.get_ident()
    with _lock:  # off the list while they run: a closer's own collectives skip it
        mine = _closers.pop(me, [])
    keep = [closer for closer in mine if not closer()]
    if keep:
        with _lock:
            _closers.setdefault(me, [])[:0] = keep


def flush(here: bool = False) -> None:
    """Start the deferred work, if any, ahead of what the caller starts next: on the thread,
    or with ``here`` on the calling thread, before it returns (for a synchronous collective,
    which would otherwise overtake it); with ``here``, this thread's closers run first."""
    global _deferred
    if here:
        _close()
    if _deferred is None:  # the common case, without the lock
        return
    with _lock:
        if not here:
            _flush_locked()
            return
        item, _deferred = _deferred, None
    if item is not None:
        _complete(item.future, item.run)


def run_deferred(future: "Future[Any]") -> None:
    """Run the work of ``future`` here and now if it is still deferred; otherwise it is on
    the thread (or done), and this does nothing."""
    global _deferred
    with _lock:
        if _deferred is None or _deferred.future is not future:
            return
        item, _deferred = _deferred, None
    _complete(item.future, item.run)
