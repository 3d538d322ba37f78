"""Agreement between ranks before a collective runs.

**Agreement.** Before a collective every rank contributes a record to one small nonblocking
allreduce (bitwise or): an 8-byte digest of what it is about to do (kind, names, dtypes,
shapes, op, root, scale factors), the digest's complement, a state word (active or joined,
see below), and optional flags. The digests were all equal exactly when or(d) == ~or(~d).
If they differ, the ranks exchange their full descriptions and every rank raises the same
error. Every agreement uses the same record, so even ranks that reached different kinds of
collective meet in it: a disagreement never hangs and never reads past a buffer.

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
coordinator does. A thread that already holds the turn (inside another call's data phase)
agrees in step with the other ranks, without the schedule.

**Joined ranks.** A rank that called :func:`hvd_trainer.joined.join` (it ran out of data)
takes part in every agreement without a call of its own: its record carries a *joined*
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
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import numpy as np

from . import runtime, scheduler, stall, timeline
from .backends import Communicator
from .stall import discard_posts, waiting
from .timeline import span

# Flags that travel inside the agreement record; more go in a second exchange once agreed.
INLINE_FLAG_WORDS = 6
# The record: digest, ~digest, state bits, inline flags.
_RECORD_WORDS = 3 + INLINE_FLAG_WORDS
_FLAGS_AT = 3
# State bits, or-ed across ranks: a rank is active (it makes the call) or joined (it serves).
_ACTIVE, _JOINED = 1, 2
# What a joined rank serves (with zeros, or nothing to send): the other kinds raise.
_SERVED_WHILE_JOINED = ("allreduce", "grouped_allreduce", "adasum", "barrier", "trainer step")
# Ranks whose synchronous calls have matched nothing for this long, with nothing else to
# come, raise instead of waiting forever (see scheduler.deadlock).
_MATCH_GRACE_SECONDS = 0.5
# Argument errors that travel to every rank keep their type; anything else is a RuntimeError.
_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


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


def _raise_error(comm: Communicator, every: Sequence[Optional[Dict[str, Any]]]) -> None:
    """Raise the first rank's argument error in ``every``, if any."""
    error = _argument_error(comm, every)
    if error is not None:
        raise error


def _raise_disagreement(comm: Communicator, key: str, description: Dict[str, Any]) -> None:
    """Inside a held turn, where ranks run in step: exchange full descriptions (in the form
    of a round's lists, which a joined rank reads) and raise the same error on every rank."""
    gathered = comm.allgather_object((False, [(key, description, True, False)], 0))
    raise _failure(comm, [None if g is None else g[1][0][1] for g in gathered])


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
    sched = scheduler.of(comm)
    holder = sched.holds()
    if flags is None and error is None and holder and sched.covered_depth():
        return None
    if error is not None and (comm.size == 1 or (holder and sched.covered_depth())):
        raise error  # nobody else takes part in an exchange here
    if comm.size == 1:
        return None if flags is None else np.asarray(flags, bool).copy()
    given = describe()
    if error is not None:
        # The rank makes the description unlike any other rank's, so every rank takes the
        # full exchange and raises this error.
        description = dict(given, error=(type(error).__name__, str(error)), rank=comm.rank)
        digest = _digest(description)
    else:
        count = -1 if flags is None else len(flags)
        if sched.memo[0] is given and sched.memo[1] == count:
            digest, description = sched.memo[2:]
        else:
            description = given if flags is None else dict(given, flags=count)
            digest = _digest(description)
            sched.memo = (given, count, digest, description)
    key = description.get("name") if key is None else key
    entry = scheduler.Entry(str(key), description, flags, digest, automatic)
    if holder:
        return _in_step(comm, sched, entry)
    what = f"{description.get('kind') or 'collective'} {description.get('name')!r}"
    with waiting(comm, what, "agreement"):
        flags = sched.settle(entry, functools.partial(_round, comm, sched), stall.pace)
    if not keep:
        sched.give()
    return flags


def _record(comm: Communicator, sched: scheduler.Schedule,
            entry: scheduler.Entry) -> Tuple[np.ndarray, np.ndarray, int]:
    """Exchange the small record of ``entry``: (the or-ed record, the flag words, how many of
    them travelled inline)."""
    record = np.zeros(_RECORD_WORDS, np.int64)
    record[0], record[1], record[2] = entry.digest, ~entry.digest, _ACTIVE
    words = pack_flags(entry.flags) if entry.flags is not None else record[:0]
    inline = min(words.size, INLINE_FLAG_WORDS)
    record[_FLAGS_AT:_FLAGS_AT + inline] = words[:inline]
    sched.exchanges += 1
    stall.poll(comm.start_allreduce(record, "bor"))
    discard_posts(comm)
    # A joined rank's record has no digest (zeros): the others' digests are compared alone.
    sched.peers_joined = bool(record[2] & _JOINED)
    return record, words, inline


def _inline_flags(comm: Communicator, entry: scheduler.Entry, record: np.ndarray,
                  words: np.ndarray, inline: int) -> Optional[np.ndarray]:
    """The or-ed flags of an entry whose record every rank agreed on."""
    if entry.flags is None:
        return None
    words = words.copy()
    words[:inline] = record[_FLAGS_AT:_FLAGS_AT + inline]
    if words.size > inline:  # the ranks agree on len(flags), so this exchange matches
        rest = words[inline:]
        comm.allreduce(rest, "bor")
        words[inline:] = rest
    return unpack_flags(words, len(entry.flags))


def _in_step(comm: Communicator, sched: scheduler.Schedule,
             entry: scheduler.Entry) -> Optional[np.ndarray]:
    """An agreement made by the turn's holder, in step with the other ranks' holders."""
    what = f"{entry.description.get('kind') or 'collective'} {entry.description.get('name')!r}"
    with waiting(comm, what, "agreement"):
        record, words, inline = _record(comm, sched, entry)
    if record[0] != ~record[1]:
        _raise_disagreement(comm, entry.key, entry.description)
    if sched.peers_joined:
        _meet_joined(comm, entry.description)
    return _inline_flags(comm, entry, record, words, inline)


def _all_stuck(gathered: Sequence[Any]) -> bool:
    """Whether every active rank of a round's exchange (joined ranks gave None) is stuck."""
    return all(g[0] for g in gathered if g is not None)


def _round(comm: Communicator, sched: scheduler.Schedule,
           entries: List[scheduler.Entry]) -> List[scheduler.Verdict]:
    """One round over this rank's pending ``entries`` (see scheduler.py): when every rank's
    oldest entry is the same call, decide it; else exchange the lists and match by key."""
    head = entries[0]
    record, words, inline = _record(comm, sched, head)
    joined = sched.peers_joined
    if record[0] == ~record[1]:
        try:
            if joined:
                _meet_joined(comm, head.description)
        except Exception as error:
            return [("raise", head.key, error)]
        return [("run", head.key, _inline_flags(comm, head, record, words, inline))]
    summaries = [e.summary() for e in entries]
    stuck = sched.stuck(summaries, _MATCH_GRACE_SECONDS)
    gathered = comm.allgather_object((stuck, summaries, sched.unnamed))
    lists = [None if g is None else g[1] for g in gathered]
    failure = functools.partial(_failure, comm)
    verdicts = scheduler.match(lists, failure, single=joined, me=comm.rank)
    if not verdicts and _all_stuck(gathered):
        verdicts = scheduler.deadlock(lists, comm.rank, failure)
        if verdicts and verdicts[0][0] == "run":
            # Ranks whose automatic names had drifted apart run their oldest calls together;
            # from here they count on from the same number.
            sched.unnamed = max(g[2] for g in gathered if g is not None)
    by_key = {e.key: e for e in entries}
    decided: List[scheduler.Verdict] = []
    for verdict, key, value in verdicts:
        if verdict == "run":
            try:
                if joined:
                    _meet_joined(comm, value)
            except Exception as error:
                decided.append(("raise", key, error))
                continue
            flags = by_key[key].flags
            if flags is not None:  # every rank runs this exchange for this entry, in order
                words = pack_flags(flags)
                comm.allreduce(words, "bor")
                flags = unpack_flags(words, len(flags))
            value = flags
        decided.append((verdict, key, value))
    return decided


class JoinedRecord:
    """A joined rank's record in the next agreement on ``comm``, posted without waiting.

    Hold ``comm``'s turn while it is pending. The wait is not watched as a stall: the other
    ranks may compute for long between collectives.
    """

    def __init__(self, comm: Communicator):
        self.comm = comm
        self._record = np.zeros(_RECORD_WORDS, np.int64)
        self._record[2] = _JOINED
        scheduler.of(comm).exchanges += 1
        self._request = comm.start_allreduce(self._record, "bor")
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
        comm, record = self.comm, self._record
        discard_posts(comm)
        if not record[2] & _ACTIVE:
            return None
        words_total = -1
        if record[0] != ~record[1]:
            # The active ranks exchange their pending lists; at most the first key pending on
            # all of them runs, and this rank serves it; when none is and every active rank
            # is stuck, their oldest waited calls run together or raise (see _round).
            gathered = comm.allgather_object(None)
            lists = [None if g is None else g[1] for g in gathered]
            verdicts = scheduler.match(lists, lambda every: RuntimeError(), single=True)
            runs = (verdicts[0][0] == "run" if verdicts else
                    _all_stuck(gathered) and scheduler.deadlock_runs(lists))
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
    values = np.array([sched.unnamed, comm.rank if newly else -1], np.int64)
    comm.allreduce(values, "max")
    sched.unnamed = int(values[0])
    sched.peers_joined = False
    return int(values[1])


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

    def __init__(self, comm: Communicator, kind: str, name: Optional[str]):
        self.comm, self.kind, self._given = comm, kind, name
        self.name = self.key = ""
        self.error: Optional[Exception] = None
        self._schedule = scheduler.of(comm)
        self._held = False

    def __enter__(self) -> "Call":
        scheduler.flush(here=True)  # a deferred training step goes first (see scheduler.py)
        given = self._given
        if given is not None and not isinstance(given, str):
            self.error = TypeError(f"name={given!r} must be a string or None")
            given = repr(given)
        self.name, self.key = self._schedule.name(self.kind, given, self)
        self._held = self._schedule.holds()
        return self

    def __exit__(self, *exc: Any) -> None:
        sched = self._schedule
        if not self._held and sched.holds():
            sched.give()
        sched.forget(self.key, self)

    def checks(self) -> ContextManager[None]:
        """Run argument checks: a ValueError or TypeError is kept for :meth:`agree`, which
        raises it on every rank, instead of raising on this rank alone."""
        return _Checks(self)

    def agree(self, describe: Callable[[], Dict[str, Any]],
              flags: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """:func:`agree` with this call's kind, name and argument error."""
        with span(self.name, "NEGOTIATE"):
            if self.error is not None:
                agree(self.comm, lambda: {"kind": self.kind, "name": self.name}, flags,
                      self.error, self.key, True, self._given is None)
            return agree(self.comm, lambda: {"kind": self.kind, "name": self.name, **describe()},
                         flags, key=self.key, keep=True, automatic=self._given is None)

    def agree_gather(self, describe: Callable[[], Dict[str, Any]],
                     extra: Callable[[], int]) -> List[int]:
        """:meth:`agree`, then return every rank's ``extra()`` (e.g. its first dimension)."""
        self.agree(describe)
        if self.comm.size == 1:
            return [extra()]
        gathered = np.empty(self.comm.size, np.int64)
        with self.communicate():
            self.comm.allgatherv(np.array([extra()], np.int64), gathered, [1] * self.comm.size)
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
    ``comm``'s turn and names the call (``kind.noname.N`` per communicator when ``name`` is
    None; a name that is not a string is an argument error)."""
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
    scheduler.flush(here=True)  # a deferred training step goes first (see scheduler.py)
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


def _differing(values: Sequence[Any]) -> bool:
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
        if _differing(values):
            return f"{what}: ranks disagree on {field} ({_by_rank(ranks, values)})"
    counts = [len(d.get("tensors", ())) for d in every]
    if _differing(counts):
        missing = _missing_tensors(ranks, every)
        detail = f"; {missing}" if missing else ""
        return (f"{what}: ranks disagree on the number of tensors ({_by_rank(ranks, counts)})"
                f"{detail}")
    for i, tensor in enumerate(first.get("tensors", ())):
        for field in tensor:
            values = [d["tensors"][i][field] for d in every]
            if _differing(values):
                return (f"{what}: ranks disagree on {field} of tensor {i} "
                        f"{tensor.get('name')!r} ({_by_rank(ranks, values)})")
    values = [d.get("flags") for d in every]
    if _differing(values):
        return f"{what}: ranks disagree on the number of flags ({_by_rank(ranks, values)})"
    return f"{what}: ranks disagree ({_by_rank(ranks, every)})"

