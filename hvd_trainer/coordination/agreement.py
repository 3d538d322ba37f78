"""Agreement between ranks before a collective runs.

A collective (:func:`collective`, a :class:`Call`) agrees with the other ranks on what it is
about to do in one small exchange of a fixed-size record (records.py: a digest reduced by
allreduce, 208 bytes per rank at any rank count); if the ranks' digests differ, they exchange
their full descriptions and every rank raises the same error (messages.py). Rounds over the
calls pending on a rank, and joined ranks' part in them, are rounds.py's.

**Small calls carry their data.** A small collective that every rank agreed on at once (no
rank joined) gathers its data (its payload: the tensor to reduce or gather, the root's
tensor or pickled object) in one persistent gather right after (:meth:`Call.exchange`):
allreduce (under ``HVD_ALLREDUCE_ALGO=auto``) reduces the gathered payloads in rank order,
identically on every rank; broadcast, allgather and the object collectives read them. When
the digests differ, or a rank has joined, the call runs its own data phase after the usual
outcome of the agreement (its error, or a match by name). A small broadcast's payload may
ride in its root's record instead (``root`` of :meth:`Call.exchange`).

**Argument errors are collective.** A collective runs its argument checks inside
:meth:`Call.checks`; a check that fails on one rank travels in the agreement, so every rank
raises it and every rank has made the same exchange: the next collective works.

**The common case.** A call that finds nothing pending and the communicator free (one thread,
one call at a time) makes its round at once, holding the turn from the start
(:meth:`scheduler.Schedule.claim`); only if that round does not run it does the call go the
way of the schedule. A thread that already holds the turn (inside another call's data phase)
agrees in step with the other ranks, without the schedule.

**Cache.** A caller whose agreement already fixes the collectives that follow (the trainer's
step: the names, shapes and dtypes of its gradients, and which are fresh, carried as flags)
runs them inside :func:`covered`, where they skip their own exchange. So a steady-state
training step pays one small exchange, and it carries the freshness flags it needs anyway.

Phases are timed on the timeline (timeline.py).
"""
import contextlib
import functools
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..runtime import timeline
from . import matching, scheduler, stall, work_order
from ..backends import Communicator
from .stall import Called, waiting
from ..runtime.timeline import span
from .records import (INLINE_ROOM, Carried, Inline, carrier_of, description_digest,
                      records_of, signed_digest)
from .rounds import CallEntry, agree_in_step, decide, post_record, run_round


# What an agreement gives its caller: the or-ed flags, and whether a call that carries its
# data is to carry it now (every rank agreed at once and none has joined; the same on every
# rank). A pair, unpacked where it is returned: it is made for every collective.
Agreed = Tuple[Optional[np.ndarray], bool]


def agree(comm: Communicator, describe: Callable[[], Dict[str, Any]],
          flags: Optional[np.ndarray] = None, error: Optional[Exception] = None,
          key: Optional[str] = None, keep: bool = False,
          automatic: bool = False) -> Optional[np.ndarray]:
    """Agree with the other ranks on the collective ``describe()`` describes, and take the
    communicator's turn for its data phase (see scheduler.py).

    ``describe()`` returns a dict of plain values with the call's ``kind`` and ``name``; its
    ``tensors`` entry, if any, is a list of per-tensor dicts. ``key`` matches the call across
    ranks (by default its name; ``automatic``: an automatic one); ``keep``: keep the turn
    afterwards (a :class:`Call` gives it back when it ends). Raise :class:`MismatchError` on
    all ranks if their descriptions differ. ``error`` is this rank's argument error (``describe`` then gives just
    the kind and name): every rank raises it.
    ``flags`` (booleans) are or-ed across ranks in the same exchange and returned. Inside
    :func:`covered` an agreement without flags is skipped and ``describe`` is not called.
    A thread that holds the turn already (a data phase, a covered block) agrees in step with
    the other ranks, in one exchange, without the schedule.
    When ``describe`` returns the very object it returned last time on this communicator, its
    digest is reused: a caller may keep a description while nothing in it changes, but must
    not modify it.
    """
    flags, _ = _agree(comm, scheduler.of(comm), describe, flags, error, key, keep=keep,
                      automatic=automatic)
    return flags


def _agree(comm: Communicator, sched: scheduler.Schedule,
           describe: Callable[[], Dict[str, Any]], flags: Optional[np.ndarray],
           error: Optional[Exception], key: Optional[str], *, keep: bool,
           automatic: bool, claimed: bool = False) -> "Agreed":
    """:func:`agree` on ``comm``, whose schedule is ``sched``; returns the or-ed flags (and
    False: it carries no data)."""
    holder = sched.holds()
    if flags is None and error is None and holder and sched.covered_depth():
        return None, False
    if error is not None and (comm.size == 1 or (holder and sched.covered_depth())):
        raise error  # nobody else takes part in an exchange here
    if comm.size == 1:
        return None if flags is None else np.asarray(flags, bool).copy(), False
    given = describe()
    if error is not None:
        # The rank makes the description unlike any other rank's, so every rank takes the
        # full exchange and raises this error.
        description = dict(given, error=(type(error).__name__, str(error)), rank=comm.rank)
        digest = description_digest(description)
    else:
        count = -1 if flags is None else len(flags)
        memo = sched.memo
        if memo.given is given and memo.count == count:
            digest, description = memo.digest, memo.description
        else:
            description = given if flags is None else dict(given, flags=count)
            digest = description_digest(description)
            sched.memo = scheduler.Memo(given, count, digest, description)
    key = description.get("name") if key is None else key
    what = Called(description.get("kind") or "collective", description.get("name"))
    return _run(comm, sched, str(key), describe, description, flags, digest, automatic,
                False, what, keep, claimed)


def _run(comm: Communicator, sched: scheduler.Schedule, key: str,
         describe: Callable[[], Dict[str, Any]], description: Optional[Dict[str, Any]],
         flags: Optional[np.ndarray], digest: int, automatic: bool, carries: bool,
         what: Any, keep: bool, claimed: bool) -> "Agreed":
    """The agreement of a call whose ``digest`` is made: in step where this thread holds the
    turn, else at once where it can claim the communicator, else through the schedule.
    ``description`` None: ``describe()`` makes it if the ranks' digests differ (a call agreed
    on from its signature); ``carries``: the call carries its data when agreed at once;
    ``what`` says which call it is (its ``str()``, made only if a wait lasts); ``claimed``:
    this thread claimed the communicator for this call (:meth:`scheduler.Schedule.open`).
    Returns the or-ed flags and whether the call carries its data now (see :data:`Agreed`)."""
    if description is None and flags is not None:
        described = describe  # no flags, but an exchange even in a covered block
        describe = lambda: dict(described(), flags=0)  # noqa: E731
    if not claimed:
        if sched.holds():
            entry = CallEntry(key, describe, description, flags, digest, automatic, carries,
                              what)
            return agree_in_step(comm, sched, entry), entry.direct
        claimed = sched.claim()
    number, going = sched.exchanges, None
    if claimed:
        # Nothing else waits here: this thread makes the round over its call at once, and
        # when every rank agrees (and none has joined) it runs without more ado. Its wait is
        # watched only if it does not end at once (see stall.poll).
        try:
            gathered = post_record(comm, sched, digest, flags, what)
            if gathered.agreed and not sched.peers_joined:
                if flags is not None and len(flags):
                    flags = gathered.flags(comm, len(flags))
                if not keep:
                    sched.give()
                return flags, carries
            going = functools.partial(decide, comm, sched, gathered)
        except BaseException as failure:  # the schedule fails the call, freeing the turn
            going = functools.partial(_reraise, failure)
    entry = CallEntry(key, describe, description, flags, digest, automatic, carries, what)
    return _settled(comm, sched, entry, number, keep, going)


def _settled(comm: Communicator, sched: scheduler.Schedule, entry: CallEntry, number: int,
             keep: bool, going: Optional[scheduler.Round]) -> "Agreed":
    """The agreement of ``entry`` through the schedule (``going``: the round this thread's
    claim began, see :meth:`scheduler.Schedule.settle`); exchange ``number`` names the wait."""
    with waiting(comm, entry.what, "agreement", number):
        flags = sched.settle(entry, functools.partial(run_round, comm, sched), stall.pace, going)
    if not keep:
        sched.give()
    return flags, entry.direct


def _reraise(error: BaseException, entries: List[CallEntry]) -> List[matching.Verdict]:
    """A round whose exchange failed with ``error`` (the schedule makes it its entries')."""
    raise error


@contextlib.contextmanager
def turn(comm: Communicator) -> Iterator[None]:
    """Hold ``comm``'s turn: other threads' collectives on it wait until the block ends."""
    sched = scheduler.of(comm)
    sched.take()
    try:
        yield
    finally:
        sched.give()


def finish_join(comm: Communicator, newly: bool) -> int:
    """End join on every rank of ``comm`` (each has read None from a :class:`JoinedRecord`);
    ``newly``: this rank joined in that last agreement. Returns the rank in ``comm`` that
    joined last (the highest of those that joined together). Sets the count of automatic
    names to the other ranks' (they named calls that this rank served). A collective."""
    sched = scheduler.of(comm)
    highest = np.array([sched.unnamed, comm.rank if newly else -1], np.int64)
    comm.allreduce(highest, "max")
    unnamed, last = highest.tolist()
    sched.unnamed = int(unnamed)
    sched.peers_joined = False
    return int(last)


def meet(comm: Communicator) -> None:
    """Wait until every rank of ``comm`` has come here, without holding the core: a covered
    block's collective that may wait long for a late peer (a training step's bucket, while
    backward still computes) meets first, so that the wait gives the core to the rank's own
    computation (MPI's blocking calls spin), and then moves its bytes at MPI's full pace.
    Costs one small nonblocking allgather; only for a block whose ranks all come (no joined
    rank)."""
    start = _meetings.get(comm)
    if start is None:
        start = _meetings[comm] = comm.repeated_allgather(np.zeros(1, np.uint8),
                                                          np.empty(comm.size, np.uint8))
    sched = scheduler.of(comm)
    stall.poll(start(), sched, comm, "a training step's bucket", "data", sched.exchanges)


_meetings: "weakref.WeakKeyDictionary[Communicator, Callable[[], Any]]" = \
    weakref.WeakKeyDictionary()


def peers_joined(comm: Communicator) -> bool:
    """Whether the last agreement on ``comm`` found a joined rank (its collectives after it
    need their own agreements, so that the joined rank learns each one)."""
    return scheduler.of(comm).peers_joined


def pending(comm: Communicator) -> int:
    """How many collectives of this rank wait for their match on ``comm``."""
    return len(scheduler.of(comm).pending)


class _Checks:
    """Keeps a ValueError or TypeError raised in its block for :meth:`Call.agree`."""

    __slots__ = ("call",)

    def __init__(self, call: "Call"):
        self.call = call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        if kind is not None and issubclass(kind, (ValueError, TypeError)):
            self.call.error = error
            return True
        return False


class Call:
    """One collective on a communicator: its name, its argument checks, its agreement.

    Made by :func:`collective`. As a context manager it names the call (reserving its key in
    the communicator's schedule), claiming the communicator at once where nothing else
    waits or runs on it (the common case, see :meth:`scheduler.Schedule.open`), and, once
    :meth:`agree` has matched it, holds the communicator's turn until the block ends. Its
    pieces are plain classes, not generators: every collective pays for them.
    """

    __slots__ = ("comm", "kind", "name", "key", "error", "_given", "_schedule", "_held",
                 "_claimed", "_describe")
    error: Optional[Exception]  # annotated here: in __init__ it would be evaluated each call

    def __init__(self, comm: Communicator, kind: str, name: Optional[str]):
        self.comm, self.kind, self._given = comm, kind, name
        self.name = self.key = ""
        self.error = None
        self._schedule = scheduler.of(comm)
        self._held = self._claimed = False

    def __enter__(self) -> "Call":
        work_order.flush(here=True)  # a deferred training step goes first (see work_order.py)
        given = self._given
        if given is not None and not isinstance(given, str):
            self.error = TypeError(f"name={given!r} must be a string or None")
            given = repr(given)
        self.name, self.key, self._held, self._claimed = self._schedule.open(self.kind, given,
                                                                              self)
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self._schedule.forget(self.key, self, give=not self._held, ran=kind is None)

    def checks(self) -> ContextManager[None]:
        """Run argument checks: a ValueError or TypeError is kept for :meth:`agree`, which
        raises it on every rank, instead of raising on this rank alone."""
        return _Checks(self)

    def agree(self, describe: Callable[[], Dict[str, Any]],
              flags: Optional[np.ndarray] = None, signature: Any = None) -> Optional[np.ndarray]:
        """:func:`agree` with this call's kind, name and argument error. ``signature``: a
        hashable tuple of plain values that, with the kind and the name, fixes what
        ``describe()`` returns; the digest is then made from it, and ``describe()`` is called
        only if the ranks' records differ."""
        if not timeline.running():
            flags, _ = self._agreed(describe, flags, False, signature)
            return flags
        with span(self.name, "NEGOTIATE"):
            flags, _ = self._agreed(describe, flags, False, signature)
        return flags

    def exchange(self, describe: Callable[[], Dict[str, Any]], payload: Optional[np.ndarray],
                 signature: Any = None, root: Optional[int] = None) -> "Carried | Inline | None":
        """:meth:`agree`, then, when every rank agreed at once and none has joined, gather
        every rank's ``payload`` (bytes, or None) in the communicator's carrier.

        Returns every rank's payload when they travelled so (a rank's is None if it sent
        none, or more than :func:`room`); None when the call must run its own data phase
        (one rank, a covered block, records that differed at first, a joined rank).
        ``root``: a broadcast's root in ``comm``, the one rank whose payload is read; on the
        steady-state fast path a payload of at most ``records.INLINE_ROOM`` bytes from it
        rides in its record, and the others' payloads are then not gathered (None, on every
        rank alike: not a broadcast, or one whose payload every rank knows to be larger).
        """
        timed = timeline.running()
        if not timed:
            _, direct = self._agreed(describe, None, True, signature)
        else:
            with span(self.name, "NEGOTIATE"):
                _, direct = self._agreed(describe, None, True, signature)
        return self._carried(payload, root, timed) if direct else None

    def _carried(self, payload: Optional[np.ndarray], root: Optional[int],
                 timed: bool) -> "Carried | Inline | None":
        """After an agreement reached at once: a broadcast ``root``'s payload if it rode in
        the record (every rank reads one reduced record: all take it or all gather), else
        every rank's ``payload`` gathered in the carrier (None: the communicator has none)."""
        comm, sched = self.comm, self._schedule
        inline = None if root is None else records_of(comm).inline_carried()
        carrier = None if inline is not None else carrier_of(comm)
        if carrier is None:
            return inline
        carrier.post(payload)
        if not timed:
            stall.poll(carrier.start(), sched, comm, self, "data", sched.exchanges)
        else:
            with span(self.name, "COMMUNICATE"):
                stall.poll(carrier.start(), sched, comm, self, "data", sched.exchanges)
        return carrier.gathered()

    def _agreed(self, describe: Callable[[], Dict[str, Any]], flags: Optional[np.ndarray],
                carries: bool, signature: Any) -> "Agreed":
        comm, sched, claimed = self.comm, self._schedule, self._claimed
        self._claimed = False  # the claim serves this call's first agreement
        if self.error is None and signature is not None and (flags is None or not len(flags)):
            # The digest comes from the signature: no description is made unless the ranks'
            # digests differ.
            if comm.size == 1 or (flags is None and self._held and sched.covered_depth()):
                return None if flags is None else flags.copy(), False
            self._describe = describe
            return _run(comm, sched, self.key, self._full_description, None, flags,
                        signed_digest(self.kind, self.name, signature), self._given is None,
                        carries, self, True, claimed)
        if self.error is not None:
            _agree(comm, sched, self._described_alone, flags, self.error, self.key, keep=True,
                   automatic=self._given is None, claimed=claimed)
        return _agree(comm, sched, functools.partial(self._described, describe), flags, None,
                      self.key, keep=True, automatic=self._given is None, claimed=claimed)

    def _described(self, describe: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        """This call's description: its kind and name, and what ``describe()`` says."""
        return {"kind": self.kind, "name": self.name, **describe()}

    def _full_description(self) -> Dict[str, Any]:
        """:meth:`_described` of the ``describe`` of this call's last agreement."""
        return self._described(self._describe)

    def __str__(self) -> str:
        """Which call this is, as the stall inspector tells it."""
        return f"{self.kind} {self.name!r}"

    def _described_alone(self) -> Dict[str, Any]:
        """This call's kind and name (a call whose arguments failed their checks)."""
        return {"kind": self.kind, "name": self.name}

    def gather_counts(self, count: int) -> List[int]:
        """Every rank's ``count`` (e.g. its first dimension), in the data phase of an agreed
        call."""
        if self.comm.size == 1:
            return [count]
        gathered = np.empty(self.comm.size, np.int64)
        with self.communicate():
            self.comm.allgatherv(np.array([count], np.int64), gathered, [1] * self.comm.size)
        return gathered.tolist()

    def communicate(self) -> ContextManager[Any]:
        """The data phase: timed on the timeline, and watched by the stall inspector."""
        wait = waiting(self.comm, self, "data")
        if not timeline.running():
            return wait
        stack = contextlib.ExitStack()
        stack.enter_context(span(self.name, "COMMUNICATE"))
        stack.enter_context(wait)
        return stack


def collective(comm: Communicator, kind: str, name: Optional[str]) -> Call:
    """One collective on ``comm``, to run as ``with collective(...) as call:``, which takes
    ``comm``'s turn and names the call (``kind.noname.N`` per communicator and thread, see
    automatic_names.py, when ``name`` is None; a name that is not a string is an argument
    error)."""
    return Call(comm, kind, name)


class _Again(Call):
    """A :class:`Call` that :func:`again` has opened: entering it does nothing more, and its
    carried exchange goes straight through (see :meth:`exchange`)."""

    __slots__ = ()

    def __enter__(self) -> "Call":
        return self

    def exchange(self, describe: Callable[[], Dict[str, Any]], payload: Optional[np.ndarray],
                 signature: Any = None, root: Optional[int] = None) -> "Carried | Inline | None":
        """:meth:`Call.exchange` of a call that claimed the communicator at once: the record
        (with a broadcast root's small payload in it) and, where every rank agreed at once
        and none has joined, the carrier, in one function; where not, the schedule's way,
        as any call (:func:`_settled`)."""
        if signature is None or self.error is not None or timeline.running() \
                or not self._claimed:
            return Call.exchange(self, describe, payload, signature, root)
        comm, sched = self.comm, self._schedule
        self._claimed = False
        digest = signed_digest(self.kind, self.name, signature)
        number, going = sched.exchanges, None
        inline = None if root != comm.rank or payload is None or payload.size > INLINE_ROOM \
            else payload
        try:
            gathered = post_record(comm, sched, digest, None, self, inline)
            if not gathered.agreed or sched.peers_joined:
                going = functools.partial(decide, comm, sched, gathered)
        except BaseException as failure:  # the schedule fails the call, freeing the turn
            going = functools.partial(_reraise, failure)
        if going is not None:
            self._describe = describe
            entry = CallEntry(self.key, self._full_description, None, None, digest,
                              self._given is None, True, self)
            _, direct = _settled(comm, sched, entry, number, True, going)
            if not direct:
                return None
        return self._carried(payload, root, False)


def again(comm: Communicator, kind: str, name: Optional[str]) -> Optional[Call]:
    """The steady-state fast path's :func:`collective`, opened: for a caller that repeats its
    last call (its arguments checked then, what they fix kept). Where nothing else waits on
    this rank's order of work (work_order.idle) and ``comm`` is free at once
    (:meth:`scheduler.Schedule.open_again`), the call is named and holds the turn; it goes on
    as any call: its agreement still compares every rank's record, so a call that differs on
    another rank, or a joined rank, takes the full exchange. None: use :func:`collective`."""
    if comm.size == 1 or not work_order.idle() or (name is not None and type(name) is not str):
        return None
    call = _Again(comm, kind, name)
    opened = call._schedule.open_again(kind, name, call)
    if opened is None:
        return None
    call.name, call.key = opened
    call._claimed = True
    return call


@contextlib.contextmanager
def covered(comm: Communicator) -> Iterator[None]:
    """Collectives on ``comm`` in this block skip their agreement exchange.

    Only for a caller whose last :func:`agree` on ``comm`` already fixed, identically on
    every rank, each collective the block runs (kind, names, shapes, dtypes, op), or whose
    block begins with an agreement that has flags (a training step: the ranks' holders make
    it in step). The block holds ``comm``'s turn: other threads' collectives on it wait until
    it ends.
    """
    work_order.flush(here=True)  # a deferred training step goes first (see work_order.py)
    sched = scheduler.of(comm)
    sched.take()
    depth = sched.covered_depth()
    sched.set_covered(depth + 1)
    try:
        yield
    finally:
        sched.set_covered(depth)
        sched.give()


@contextlib.contextmanager
def uncovered(comm: Communicator) -> Iterator[None]:
    """Inside a :func:`covered` block, collectives make their own agreements again (a step
    whose agreement found a joined rank: that rank learns each collective from its own)."""
    sched = scheduler.of(comm)
    outer = sched.covered_depth()
    sched.set_covered(0)
    try:
        yield
    finally:
        sched.set_covered(outer)
