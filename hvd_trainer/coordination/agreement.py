"""Agreement between ranks before a collective runs.

**Agreement.** Before a collective every rank contributes a record to one small nonblocking
allgather: an 8-byte digest of what it is about to do (kind, names, dtypes, shapes, op, root,
scale factors), a state word (active or joined, see below), optional flags, and room for a
small payload. If the digests differ, the ranks exchange their full descriptions and every
rank raises the same error. Every agreement on a communicator uses records of the same size,
so even ranks that reached different kinds of collective meet in it: a disagreement never
hangs and never reads past a buffer.

**Small calls in one exchange.** A small collective puts its data in its record (its
payload: the tensor to reduce or gather, the root's tensor or pickled object), so that when
the ranks agree its data has travelled too: allreduce (under ``HVD_ALLREDUCE_ALGO=auto``)
reduces the gathered payloads in rank order, identically on every rank; broadcast, allgather
and the object collectives read them. When the records differ, or a rank has joined, the
payloads are dropped and the call runs its own data phase after the usual outcome of the
agreement (its error, or a match by name). The room is the same on every rank of a
communicator (:func:`room`): 4 KiB up to 4 ranks, 16 KiB shared among more, none from 257
ranks on, so an agreement moves at most 16 KiB plus 72 bytes per rank.

**Digests from signatures.** A call that knows what fixes its description (kind, name, op,
scale factors, dtypes, shapes, root: its *signature*, a tuple) has its digest made from that
(:func:`_signed_digest`), and its description is made only if the records differ; the
description and its text would cost more than the exchange of a small call.

**Argument errors are collective.** A collective runs its argument checks inside
:meth:`Call.checks`; a check that fails on one rank does not raise there at once but travels
in the agreement (as a description that cannot match), so every rank raises it, naming the
rank, and every rank has made the same exchange: the next collective works.

**Rounds and turns.** Which call runs next, and on which thread, is the communicator's
schedule's (scheduler.py): a call enqueues its description, one waiting thread drives a
round of the exchange above over every call pending on the rank, and the calls the round
decides run one after another, each on its own thread, holding the communicator's turn.
When every rank's oldest pending call is the same, the round is the one small exchange;
otherwise the ranks exchange their pending lists and match calls by name, as Horovod's
coordinator does. A call that finds nothing pending and the communicator free (one thread,
one call at a time: the common case) makes its round at once, holding the turn from the
start (:meth:`scheduler.Schedule.claim`); only if that round does not run it does the call
go the way of the schedule. A thread that already holds the turn (inside another call's
data phase) agrees in step with the other ranks, without the schedule.

**Joined ranks.** A rank that called :func:`hvd_trainer.collectives.joined.join` (it ran out of
data) takes part in every agreement without a call of its own: its record carries a *joined*
state bit and no digest, so the others' digests are still compared among themselves. When an
agreement finds a joined rank, the ranks make one more exchange (only then), in which the
joined ranks learn the full description of the call, so they can run its data phase with
zeros; a call they cannot serve (:func:`refusal_while_joined`) raises on every rank that made
it, and the joined ranks wait for the next. When every rank is joined, join ends.

**Cache.** A caller whose agreement already fixes the collectives that follow (the trainer's
step: the names, shapes and dtypes of its gradients, and which are fresh, carried as flags)
runs them inside :func:`covered`, where they skip their own exchange. So a steady-state
training step pays one small exchange, and it carries the freshness flags it needs anyway.

Waits are watched by the stall inspector (stall.py); phases are timed on the timeline
(timeline.py).
"""
import contextlib
import functools
import hashlib
import weakref
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

import numpy as np

from ..runtime import runtime, timeline
from . import jobs, matching, scheduler, stall, work_order
from ..backends import Communicator
from .stall import drain_posts, waiting
from ..runtime.timeline import span

# Flags that travel inside the agreement record; more go in a second exchange once agreed.
INLINE_FLAG_WORDS = 6
# The record, in int64 words: digest, state bits, the payload's length in bytes (-1: none),
# inline flags (72 bytes up to here), then room for the payload.
_DIGEST, _STATE, _LENGTH, _FLAGS_AT = 0, 1, 2, 3
_HEADER_WORDS = _FLAGS_AT + INLINE_FLAG_WORDS
# Payload room per rank: 4 KiB up to 4 ranks, then 16 KiB shared among the ranks, and none
# below 64 bytes. Every agreement moves the whole record: on 2 ranks an allgather of 4 KiB
# records took 3.9-4.2 µs against 2.4-3.1 µs for 72-byte ones, and of 8 KiB ones 9.8-21 µs
# (MPICH 5.0.2, 2 shared cores, 2026-12-02), so the room stops at 4 KiB, the size.
_ROOM_MAX, _ROOM_SHARED, _ROOM_MIN = 4096, 16384, 64
# State bits of a rank: active (it makes the call) or joined (it serves).
_ACTIVE, _JOINED = 1, 2
# What a joined rank serves (with zeros, or nothing to send): the other kinds raise.
_SERVED_WHILE_JOINED = ("allreduce", "grouped_allreduce", "adasum", "barrier", "trainer step")
# Ranks whose synchronous calls have matched nothing for this long, with nothing else to
# come, raise instead of waiting forever (see scheduler.deadlock).
_MATCH_GRACE_SECONDS = 0.5
# Argument errors that travel to every rank keep their type; anything else is a RuntimeError.
_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


def carried(cls: type) -> type:
    """Class decorator: an argument error of ``cls`` (a ValueError or TypeError subclass)
    that one rank finds is raised as ``cls`` on every rank, not as its base class."""
    _ERROR_TYPES[cls.__name__] = cls
    return cls


class MismatchError(RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank alike."""


_dual_classes: Dict[Tuple[type, type], type] = {}


def also_raised_as(error: Exception, base: type, prefix: str, module: str) -> Exception:
    """``error`` as an instance of a class deriving from both ``base`` (a framework's error,
    e.g. MXNetError) and the error's own class, with the same message and fields, so that
    ``except base`` and ``except ValueError`` (say) both catch it; ``error`` itself if it
    already is a ``base``. The class is named ``prefix`` + its own name, in ``module``."""
    cls = type(error)
    if issubclass(cls, base):
        return error
    dual = _dual_classes.get((base, cls))
    if dual is None:
        dual = _dual_classes[(base, cls)] = type(f"{prefix}{cls.__name__}", (base, cls), {
            "__module__": module,
            "__doc__": f"A {cls.__name__} that is also a {base.__name__}."})
    translated = dual.__new__(dual)
    translated.args = error.args
    translated.__dict__.update(error.__dict__)
    return translated


def _digest(description: Dict[str, Any]) -> int:
    raw = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _argument_error(comm: Communicator,
                    every: Sequence[Optional[Dict[str, Any]]]) -> Optional[Exception]:
    """The first rank's argument error in ``every`` (None: a joined rank), if any."""
    for r, d in enumerate(every):
        if d is not None and "error" in d:  # the first rank's argument error wins everywhere
            kind, message = d["error"]
            what = f"{d.get('kind', 'collective')} {d.get('name')!r}"
            return _ERROR_TYPES.get(kind, RuntimeError)(
                f"{what} on rank {runtime.world_rank(comm, r)}: {message}")
    return None


def _failure(comm: Communicator, every: Sequence[Optional[Dict[str, Any]]]) -> Exception:
    """What every rank raises for a call whose descriptions ``every`` differ."""
    return _argument_error(comm, every) or MismatchError(describe_mismatch(every))


class RoundShare(NamedTuple):
    """What each active rank shares in a round whose records differed (a joined rank shares
    None): whether it is stuck (:meth:`scheduler.Schedule.stuck`), its pending entries, and
    its counts of automatic names."""

    stuck: bool
    pending: List[matching.Summary]
    counts: Any  # scheduler.Counts; 0 where a disagreement is raised in step


class Agreed(NamedTuple):
    """What an agreement returns: the or-ed flags, and every rank's payload where the
    payloads travelled with it."""

    flags: Optional[np.ndarray]
    carried: Optional["Carried"]


class Signed(NamedTuple):
    """A call whose digest comes from its signature (see :meth:`Call.agree`)."""

    kind: str
    name: str
    signature: Any


def _raise_error(comm: Communicator, every: Sequence[Optional[Dict[str, Any]]]) -> None:
    """Raise the first rank's argument error in ``every``, if any."""
    error = _argument_error(comm, every)
    if error is not None:
        raise error


def _raise_disagreement(comm: Communicator, key: str, description: Dict[str, Any]) -> None:
    """Inside a held turn, where ranks run in step: exchange full descriptions (in the form
    of a round's lists, which a joined rank reads) and raise the same error on every rank."""
    mine = matching.Summary(key, description, waited=True, automatic=False)
    gathered = comm.allgather_object(RoundShare(stuck=False, pending=[mine], counts=0))
    raise _failure(comm, [None if g is None else _first(g.pending).description
                          for g in gathered])


def refusal_while_joined(description: Dict[str, Any]) -> Optional[str]:
    """Why a joined rank cannot serve the call ``description`` describes (None if it can)."""
    kind = description.get("kind")
    if kind not in _SERVED_WHILE_JOINED:
        hint = ("; a DistributedOptimizer or trainer with sparse gradients or packed "
                "compression reduces by allgather: pass sparse_as_dense=True, and "
                "compression=Compression.none or fp16" if kind == "allgather" else "")
        return (f"a joined rank serves only allreduce, grouped_allreduce (Adasum included), "
                f"barrier and the gradient steps of DistributedOptimizer and "
                f"DistributedTrainer, as in Horovod, whose join refuses allgather, broadcast, "
                f"alltoall and reducescatter; make this call before join() on every rank"
                f"{hint}")
    if any(t.get("memory", "host") != "host" for t in description.get("tensors", ())):
        return "a joined rank serves host (NumPy, CPU tensor) arrays only, not GPU arrays"
    return None


def _meet_joined(comm: Communicator, description: Dict[str, Any]) -> None:
    """An active rank's side of the exchange that tells joined ranks what to serve; raises
    this call's argument error, or why it cannot run while a rank is joined."""
    every = comm.allgather_object(description)
    _raise_error(comm, every)
    refusal = refusal_while_joined(description)
    if refusal is not None:
        joined = [runtime.world_rank(comm, r) for r, d in enumerate(every) if d is None]
        who = (f"rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} "
               f"{'have' if len(joined) > 1 else 'has'}")
        raise RuntimeError(f"{description.get('kind')} {description.get('name')!r} cannot run "
                           f"while {who} joined (hvd.join()): {refusal}")


def pack_flags(flags: np.ndarray) -> np.ndarray:
    """Booleans as bits in int64 words, so that a bitwise-or allreduce ors them."""
    bits = np.packbits(np.asarray(flags, bool))
    words = np.zeros(-(-bits.size // 8) * 8, np.uint8)
    words[:bits.size] = bits
    return words.view(np.int64)


def unpack_flags(words: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` booleans of :func:`pack_flags`' words."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8))[:count].astype(bool)


class _Entry(jobs.Entry):
    """A scheduler entry whose description is made only when needed (a call whose digest
    comes from a signature, see :func:`_signed_digest`, and that every rank agrees on at
    once never needs it), with the payload its record carries."""

    __slots__ = ("describe", "payload", "carries", "carried")
    carried: Optional["Carried"]  # annotated here: in __init__ it would be evaluated each time

    def __init__(self, key: str, describe: Callable[[], Dict[str, Any]],
                 description: Optional[Dict[str, Any]], flags: Optional[np.ndarray],
                 digest: int, automatic: bool, payload: Optional[np.ndarray], carries: bool):
        super().__init__(key, description, flags, digest, automatic)  # type: ignore[arg-type]
        self.describe, self.payload, self.carries = describe, payload, carries
        self.carried = None

    def described(self) -> Dict[str, Any]:
        if self.description is None:
            self.description = self.describe()
        return self.description

    def summary(self) -> matching.Summary:
        self.described()
        return super().summary()


# Digests of signatures without the call's name (see _signed_digest), bounded.
_signed: Dict[Any, bytes] = {}
_SIGNED_KEPT = 4096


def _signed_digest(kind: str, name: str, signature: Any) -> int:
    """The digest of a call whose description is fixed by its kind, its name and
    ``signature`` (a hashable tuple of plain values): the signature's digest, kept, with
    the name's, so that neither the description nor its text is made for every call."""
    key = (kind, signature)
    base = _signed.get(key)
    if base is None:
        if len(_signed) >= _SIGNED_KEPT:
            _signed.clear()
        base = _signed[key] = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    raw = hashlib.blake2b(base + name.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


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
    return _agree(comm, scheduler.of(comm), describe, flags, error, key, keep=keep,
                  automatic=automatic).flags


def _agree(comm: Communicator, sched: scheduler.Schedule,
           describe: Callable[[], Dict[str, Any]], flags: Optional[np.ndarray],
           error: Optional[Exception], key: Optional[str], *, keep: bool, automatic: bool,
           payload: Optional[np.ndarray] = None, carries: bool = False,
           signed: Optional[Signed] = None) -> Agreed:
    """:func:`agree` on ``comm``, whose schedule is ``sched``, with ``payload`` (bytes, or
    None) in the record when ``carries``; returns the or-ed flags and, where the payloads
    travelled, every rank's. ``signed``: a call whose digest comes from its signature (then
    ``key`` is given)."""
    holder = sched.holds()
    if flags is None and error is None and holder and sched.covered_depth():
        return Agreed(None, None)
    if error is not None and (comm.size == 1 or (holder and sched.covered_depth())):
        raise error  # nobody else takes part in an exchange here
    if comm.size == 1:
        return Agreed(None if flags is None else np.asarray(flags, bool).copy(), None)
    if signed is not None and error is None and (flags is None or not len(flags)):
        description, digest = None, _signed_digest(*signed)
        what = f"{signed.kind} {signed.name!r}"
        if flags is not None:  # no flags, but an exchange even in a covered block
            described = describe
            describe = lambda: dict(described(), flags=0)  # noqa: E731
    else:
        given = describe()
        if error is not None:
            # The rank makes the description unlike any other rank's, so every rank takes
            # the full exchange and raises this error.
            description = dict(given, error=(type(error).__name__, str(error)), rank=comm.rank)
            digest = _digest(description)
        else:
            count = -1 if flags is None else len(flags)
            memo = sched.memo
            if memo.given is given and memo.count == count:
                digest, description = memo.digest, memo.description
            else:
                description = given if flags is None else dict(given, flags=count)
                digest = _digest(description)
                sched.memo = scheduler.Memo(given, count, digest, description)
        key = description.get("name") if key is None else key
        what = f"{description.get('kind') or 'collective'} {description.get('name')!r}"
    if holder:
        entry = _Entry(str(key), describe, description, flags, digest, automatic, payload,
                       carries)
        return Agreed(_in_step(comm, sched, entry, what), entry.carried)
    with waiting(comm, what, "agreement", sched.exchanges):
        claimed = None
        if sched.claim():
            # Nothing else waits here: this thread makes the round over its call at once,
            # and when every rank agrees (and none has joined) it runs without more ado.
            try:
                gathered = _record(comm, sched, digest, flags, payload)
                if gathered.agreed and not sched.peers_joined:
                    if flags is not None and len(flags):
                        flags = gathered.flags(comm, len(flags))
                    if not keep:
                        sched.give()
                    return Agreed(flags, gathered.carried() if carries else None)
                claimed = functools.partial(_decide, comm, sched, gathered)
            except BaseException as failure:  # the schedule fails the call, freeing the turn
                claimed = functools.partial(_reraise, failure)
        entry = _Entry(str(key), describe, description, flags, digest, automatic, payload,
                       carries)
        flags = sched.settle(entry, functools.partial(_round, comm, sched), stall.pace, claimed)
    if not keep:
        sched.give()
    return Agreed(flags, entry.carried)


def _reraise(error: BaseException, entries: List[_Entry]) -> List[matching.Verdict]:
    """A round whose exchange failed with ``error`` (the schedule makes it its entries')."""
    raise error


class _Records:
    """A communicator's agreement buffers: this rank's record and every rank's, reused by
    each agreement (the communicator's user makes one at a time)."""

    __slots__ = ("room", "send", "payload", "recv", "carried", "words", "start")

    def __init__(self, comm: Communicator):
        room = min(_ROOM_MAX, _ROOM_SHARED // comm.size) // 8 * 8
        self.room = room if room >= _ROOM_MIN else 0
        self.send = np.zeros(_HEADER_WORDS + self.room // 8, np.int64)
        self.payload = self.send[_HEADER_WORDS:].view(np.uint8)
        self.recv = np.zeros((comm.size, self.send.size), np.int64)
        self.carried = self.recv[:, _HEADER_WORDS:].view(np.uint8)
        self.words: Optional[np.ndarray] = None  # this rank's flags of the last record, packed
        self.start = comm.repeated_allgather(self.send, self.recv)


_records: "weakref.WeakKeyDictionary[Communicator, _Records]" = weakref.WeakKeyDictionary()


def _records_of(comm: Communicator) -> _Records:
    found = _records.get(comm)
    if found is None:
        found = _records[comm] = _Records(comm)
    return found


def room(comm: Communicator) -> int:
    """How many bytes of payload an agreement on ``comm`` can carry (0 for a single rank)."""
    return 0 if comm.size == 1 else _records_of(comm).room


class Carried:
    """Every rank's payload from one agreement: rank r's is the first ``lengths[r]`` bytes
    of ``rows[r]`` (-1: it sent none). Valid until the block of the call that made it ends."""

    __slots__ = ("rows", "lengths")

    def __init__(self, rows: np.ndarray, lengths: List[int]):
        self.rows, self.lengths = rows, lengths

    def of(self, rank: int) -> Optional[np.ndarray]:
        """Rank ``rank``'s payload (None: it sent none)."""
        length = self.lengths[rank]
        return None if length < 0 else self.rows[rank, :length]

    def every(self) -> bool:
        """Whether every rank sent a payload."""
        return min(self.lengths) >= 0


class _Gathered:
    """Every rank's record of one exchange: whether the active ranks' digests agree, the
    or-ed state bits, and what else the ranks sent."""

    __slots__ = ("records", "agreed", "state", "lengths")

    def __init__(self, records: _Records):
        self.records = records
        self.state, first, self.agreed, self.lengths = 0, None, True, []
        for digest, state, length in records.recv[:, :_FLAGS_AT].tolist():
            self.state |= state
            self.lengths.append(length)
            if state & _ACTIVE:  # a joined rank has no digest: the others' are compared
                if first is None:
                    first = digest
                elif digest != first:
                    self.agreed = False

    def carried(self) -> "Carried":
        """Every rank's payload."""
        return Carried(self.records.carried, self.lengths)

    def flags(self, comm: Communicator, count: int) -> np.ndarray:
        """The or-ed flags (``count`` of them) of the entry whose record this rank sent last,
        which every rank agreed on."""
        words = self.records.words
        if not count:
            return np.zeros(0, bool)
        inline = min(words.size, INLINE_FLAG_WORDS)
        ored = [0] * inline
        for row in self.records.recv[:, _FLAGS_AT:_FLAGS_AT + inline].tolist():
            for i, word in enumerate(row):
                ored[i] |= word
        words[:inline] = ored
        if words.size > inline:  # the ranks agree on the count, so this exchange matches
            comm.allreduce(words[inline:], "bor")
        return unpack_flags(words, count)


def _exchange(comm: Communicator, sched: scheduler.Schedule, digest: int, state: int,
              flags: Optional[np.ndarray] = None,
              payload: Optional[np.ndarray] = None) -> Tuple[_Records, Any]:
    """Post this rank's record; returns the buffers and the request to poll."""
    records = _records_of(comm)
    send = records.send
    send[_DIGEST] = digest
    send[_STATE] = state
    if payload is not None and payload.size <= records.room:
        send[_LENGTH] = payload.size
        records.payload[:payload.size] = payload
    else:
        send[_LENGTH] = -1
    if flags is not None and len(flags):
        words = pack_flags(flags)
        inline = min(words.size, INLINE_FLAG_WORDS)
        send[_FLAGS_AT:_HEADER_WORDS] = 0
        send[_FLAGS_AT:_FLAGS_AT + inline] = words[:inline]
        records.words = words
    elif records.words is not None:
        send[_FLAGS_AT:_HEADER_WORDS] = 0
        records.words = None
    sched.exchanges += 1
    return records, records.start()


def _record(comm: Communicator, sched: scheduler.Schedule, digest: int,
            flags: Optional[np.ndarray], payload: Optional[np.ndarray]) -> _Gathered:
    """Exchange an active rank's record and return every rank's."""
    records, request = _exchange(comm, sched, digest, _ACTIVE, flags, payload)
    stall.poll(request, sched)
    drain_posts(comm)
    gathered = _Gathered(records)
    sched.peers_joined = bool(gathered.state & _JOINED)
    return gathered


def _outcome(comm: Communicator, entry: _Entry, gathered: _Gathered) -> Optional[np.ndarray]:
    """For an entry whose records agreed: keep the payloads for the caller where no rank has
    joined, and return the or-ed flags."""
    if entry.carries and not gathered.state & _JOINED:
        entry.carried = gathered.carried()
    return None if entry.flags is None else gathered.flags(comm, len(entry.flags))


def _in_step(comm: Communicator, sched: scheduler.Schedule, entry: _Entry,
             what: str) -> Optional[np.ndarray]:
    """An agreement made by the turn's holder, in step with the other ranks' holders."""
    with waiting(comm, what, "agreement"):
        gathered = _record(comm, sched, entry.digest, entry.flags, entry.payload)
    if not gathered.agreed:
        _raise_disagreement(comm, entry.key, entry.described())
    if sched.peers_joined:
        _meet_joined(comm, entry.described())
    return _outcome(comm, entry, gathered)


def _all_stuck(gathered: Sequence[Any]) -> bool:
    """Whether every active rank of a round's exchange (joined ranks gave None) is stuck."""
    return all(g.stuck for g in gathered if g is not None)


def _round(comm: Communicator, sched: scheduler.Schedule,
           entries: List[_Entry]) -> List[matching.Verdict]:
    """One round over this rank's pending ``entries`` (see scheduler.py): when every rank's
    oldest entry is the same call, decide it; else exchange the lists and match by key."""
    head = entries[0]
    return _decide(comm, sched, _record(comm, sched, head.digest, head.flags, head.payload),
                   entries)


def _decide(comm: Communicator, sched: scheduler.Schedule, gathered: _Gathered,
            entries: List[_Entry]) -> List[matching.Verdict]:
    """The rest of a round whose first exchange, of ``entries[0]``'s record, ``gathered``."""
    head = entries[0]
    joined = sched.peers_joined
    if gathered.agreed:
        try:
            if joined:
                _meet_joined(comm, head.described())
        except Exception as error:
            return [matching.Verdict("raise", head.key, error)]
        return [matching.Verdict("run", head.key, _outcome(comm, head, gathered))]
    summaries = [e.summary() for e in entries]
    stuck = sched.stuck(summaries, _MATCH_GRACE_SECONDS)
    shared = comm.allgather_object(RoundShare(stuck, summaries, sched.counts()))
    lists = [None if g is None else g.pending for g in shared]
    failure = functools.partial(_failure, comm)
    verdicts = matching.match(lists, failure, single=joined, me=comm.rank)
    if not verdicts and _all_stuck(shared):
        verdicts = matching.deadlock(lists, comm.rank, failure)
        if verdicts and _first(verdicts).action == "run":
            # Ranks whose automatic names had drifted apart run their oldest calls together;
            # from here they count on from the same number.
            sched.align_counts(_first(verdicts).key, [g.counts for g in shared if g is not None])
    by_key = {e.key: e for e in entries}
    decided: List[matching.Verdict] = []
    for verdict, key, value in verdicts:
        if verdict == "run":
            try:
                if joined:
                    _meet_joined(comm, value)
            except Exception as error:
                decided.append(matching.Verdict("raise", key, error))
                continue
            flags = by_key[key].flags
            if flags is not None:  # every rank runs this exchange for this entry, in order
                words = pack_flags(flags)
                comm.allreduce(words, "bor")
                flags = unpack_flags(words, len(flags))
            value = flags
        decided.append(matching.Verdict(verdict, key, value))
    return decided


class JoinedRecord:
    """A joined rank's record in the next agreement on ``comm``, posted without waiting.

    Hold ``comm``'s turn while it is pending. The wait is not watched as a stall: the other
    ranks may compute for long between collectives.
    """

    def __init__(self, comm: Communicator):
        self.comm = comm
        self._records, self._request = _exchange(comm, scheduler.of(comm), 0, _JOINED)
        self._done = False

    def done(self) -> bool:
        """Whether the other ranks have reached the agreement; never blocks."""
        self._done = self._done or self._request.test()
        return self._done

    def read(self) -> Optional[Dict[str, Any]]:
        """Once :meth:`done`: the description of the call the other ranks make, if this rank
        is to serve it; ``{}`` if there is nothing to serve (the call raised on the ranks that
        made it, or their oldest calls differ and none was matched); None if every rank of
        ``comm`` has joined."""
        comm = self.comm
        drain_posts(comm)
        gathered = _Gathered(self._records)
        if not gathered.state & _ACTIVE:
            return None
        words_total = -1
        if not gathered.agreed:
            # The active ranks exchange their pending lists; at most the first key pending on
            # all of them runs, and this rank serves it; when none is and every active rank
            # is stuck, their oldest waited calls run together or raise (see _round).
            gathered = comm.allgather_object(None)
            lists = [None if g is None else g.pending for g in gathered]
            verdicts = matching.match(lists, lambda every: RuntimeError(), single=True)
            runs = (_first(verdicts).action == "run" if verdicts else
                    _all_stuck(gathered) and matching.deadlock_runs(lists))
            if not runs:
                return {}
            words_total = 0
        every = comm.allgather_object(None)  # _meet_joined on the active ranks
        description = next(d for d in every if d is not None)
        if "error" in description or refusal_while_joined(description) is not None:
            return {}
        count = description.get("flags", -1)
        if count >= 0:
            words = pack_flags(np.zeros(count, bool))
            if words_total == 0:  # matched by key: the flags' own exchange, with none set
                comm.allreduce(words, "bor")
            elif words.size > INLINE_FLAG_WORDS:  # the flags' second exchange, with none set
                comm.allreduce(words[INLINE_FLAG_WORDS:], "bor")
        return description


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
    the communicator's schedule) and, once :meth:`agree` has matched it, holds the
    communicator's turn until the block ends. Its pieces are plain classes, not generators:
    every collective pays for them.
    """

    __slots__ = ("comm", "kind", "name", "key", "error", "_given", "_schedule", "_held")
    error: Optional[Exception]  # annotated here: in __init__ it would be evaluated each call

    def __init__(self, comm: Communicator, kind: str, name: Optional[str]):
        self.comm, self.kind, self._given = comm, kind, name
        self.name = self.key = ""
        self.error = None
        self._schedule = scheduler.of(comm)
        self._held = False

    def __enter__(self) -> "Call":
        work_order.flush(here=True)  # a deferred training step goes first (see work_order.py)
        given = self._given
        if given is not None and not isinstance(given, str):
            self.error = TypeError(f"name={given!r} must be a string or None")
            given = repr(given)
        self.name, self.key = self._schedule.name(self.kind, given, self)
        self._held = self._schedule.holds()
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
        return self._agree(describe, flags, signature=signature).flags

    def exchange(self, describe: Callable[[], Dict[str, Any]], payload: Optional[np.ndarray],
                 signature: Any = None) -> Optional[Carried]:
        """:meth:`agree`, with this rank's ``payload`` (bytes, or None) in its record.

        Returns every rank's payload when they travelled with the agreement (a rank's is
        None if it sent none, or more than :func:`room`); None when the call must run its
        own data phase (one rank, a covered block, records that differed at first, a joined
        rank).
        """
        return self._agree(describe, None, payload=payload, carries=True,
                           signature=signature).carried

    def _agree(self, describe: Callable[[], Dict[str, Any]], flags: Optional[np.ndarray], *,
               payload: Optional[np.ndarray] = None, carries: bool = False,
               signature: Any = None) -> Agreed:
        if not timeline.running():
            return self._agreed(describe, flags, payload, carries, signature)
        with span(self.name, "NEGOTIATE"):
            return self._agreed(describe, flags, payload, carries, signature)

    def _agreed(self, describe: Callable[[], Dict[str, Any]], flags: Optional[np.ndarray],
                payload: Optional[np.ndarray], carries: bool, signature: Any) -> Agreed:
        automatic = self._given is None
        if self.error is not None:
            _agree(self.comm, self._schedule, lambda: {"kind": self.kind, "name": self.name},
                   flags, self.error, self.key, keep=True, automatic=automatic)
        return _agree(self.comm, self._schedule,
                      lambda: {"kind": self.kind, "name": self.name, **describe()},
                      flags, None, self.key, keep=True, automatic=automatic, payload=payload,
                      carries=carries,
                      signed=None if signature is None else Signed(self.kind, self.name,
                                                                   signature))

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
        wait = waiting(self.comm, f"{self.kind} {self.name!r}", "data")
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


def agreements(comm: Communicator) -> int:
    """How many agreement exchanges this rank has made on ``comm`` (tests count them)."""
    return scheduler.of(comm).exchanges


def _first(values: Sequence[Any]) -> Any:
    """The first of ``values`` (a round's lists and verdicts are read from their heads)."""
    return values[0]


def _any_differs(values: Sequence[Any]) -> bool:
    return any(v != values[0] for v in values)


def _by_rank(ranks: Sequence[int], values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))


def _missing_tensors(ranks: Sequence[int], every: Sequence[Dict[str, Any]]) -> Optional[str]:
    """'tensor 'x' is missing on rank 1' for tensors named on some ranks and not on others."""
    names = [[t.get("name") for t in d.get("tensors", ())] for d in every]
    notes = []
    for name in dict.fromkeys(n for per_rank in names for n in per_rank):
        absent = [r for r, per_rank in zip(ranks, names) if name not in per_rank]
        if absent:
            where = ", ".join(str(r) for r in absent)
            notes.append(f"tensor {name!r} is missing on rank{'s' if len(absent) > 1 else ''} "
                         f"{where}")
    return "; ".join(notes) if notes else None


def describe_mismatch(given: Sequence[Optional[Dict[str, Any]]]) -> str:
    """One message naming the first field (and tensor) on which the ranks' descriptions differ
    (``given`` by rank; None for a joined rank, which made no call)."""
    ranks = [r for r, d in enumerate(given) if d is not None]
    every = [d for d in given if d is not None]
    first = every[0]
    what = f"{first.get('kind', 'collective')} {first.get('name')!r}"
    for field in dict.fromkeys(key for d in every for key in d):
        if field in ("tensors", "flags"):
            continue
        values = [d.get(field) for d in every]
        if _any_differs(values):
            return f"{what}: ranks disagree on {field} ({_by_rank(ranks, values)})"
    counts = [len(d.get("tensors", ())) for d in every]
    if _any_differs(counts):
        missing = _missing_tensors(ranks, every)
        detail = f"; {missing}" if missing else ""
        return (f"{what}: ranks disagree on the number of tensors ({_by_rank(ranks, counts)})"
                f"{detail}")
    for i, tensor in enumerate(first.get("tensors", ())):
        for field in tensor:
            values = [d["tensors"][i][field] for d in every]
            if _any_differs(values):
                return (f"{what}: ranks disagree on {field} of tensor {i} "
                        f"{tensor.get('name')!r} ({_by_rank(ranks, values)})")
    values = [d.get("flags") for d in every]
    if _any_differs(values):
        return f"{what}: ranks disagree on the number of flags ({_by_rank(ranks, values)})"
    return f"{what}: ranks disagree ({_by_rank(ranks, every)})"

