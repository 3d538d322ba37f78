"""A round of agreement over a rank's pending calls, and a joined rank's part in it.

**Rounds and turns.** Which call runs next, and on which thread, is the communicator's
schedule's (scheduler.py): a call enqueues its description, one waiting thread drives a
round of the exchange (records.py) over every call pending on the rank, and the calls the
round decides run one after another, each on its own thread, holding the communicator's
turn. When every rank's oldest pending call is the same, the round is the one small
exchange; otherwise the ranks exchange their pending lists and match calls by name
(matching.py), as Horovod's coordinator does.

**Joined ranks.** A rank that called :func:`hvd_trainer.collectives.joined.join` (it ran out
of data) takes part in every agreement without a call of its own (:class:`JoinedRecord`): its
record carries a *joined* state bit and no digest, so the others' digests are still compared
among themselves. When an agreement finds a joined rank, the ranks make one more exchange
(only then), in which the joined ranks learn the full description of the call, so they can
run its data phase with zeros; a call they cannot serve raises on every rank that made it,
and the joined ranks wait for the next. When every rank is joined, join ends.

Waits are watched by the stall inspector (stall.py).
"""
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..runtime import runtime
from . import jobs, matching, scheduler, stall
from ..backends import Communicator
from .stall import drain_posts
from .messages import failure_for, first_of, raise_argument_error, refusal_while_joined
from .records import (ACTIVE, INLINE_FLAG_WORDS, JOINED, Gathered, RoundShare, pack_flags,
                      records_of, unpack_flags)


# Ranks whose synchronous calls have matched nothing for this long, with nothing else to
# come, raise instead of waiting forever (see matching.deadlock).
_MATCH_GRACE_SECONDS = 0.5
def _raise_disagreement(comm: Communicator, key: str, description: Dict[str, Any]) -> None:
    """Inside a held turn, where ranks run in step: exchange full descriptions (in the form
    of a round's lists, which a joined rank reads) and raise the same error on every rank."""
    mine = matching.Summary(key, description, waited=True, automatic=False)
    gathered = comm.allgather_object(RoundShare(stuck=False, pending=[mine], counts=0))
    raise failure_for(comm, [None if g is None else first_of(g.pending).description
                             for g in gathered])


def _meet_joined(comm: Communicator, description: Dict[str, Any]) -> None:
    """An active rank's side of the exchange that tells joined ranks what to serve; raises
    this call's argument error, or why it cannot run while a rank is joined."""
    every = comm.allgather_object(description)
    raise_argument_error(comm, every)
    refusal = refusal_while_joined(description)
    if refusal is not None:
        joined = [runtime.world_rank(comm, r) for r, d in enumerate(every) if d is None]
        who = (f"rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} "
               f"{'have' if len(joined) > 1 else 'has'}")
        raise RuntimeError(f"{description.get('kind')} {description.get('name')!r} cannot run "
                           f"while {who} joined (hvd.join()): {refusal}")


class CallEntry(jobs.Entry):
    """A scheduler entry whose description is made only when needed (a call whose digest
    comes from a signature, see :func:`signed_digest`, and that every rank agrees on at
    once never needs it). ``carries``: the call would carry its data after an agreement
    reached at once (see records.py); ``direct`` says, once decided, whether it was."""

    __slots__ = ("describe", "carries", "direct", "what")

    def __init__(self, key: str, describe: Callable[[], Dict[str, Any]],
                 description: Optional[Dict[str, Any]], flags: Optional[np.ndarray],
                 digest: int, automatic: bool, carries: bool, what: Any):
        super().__init__(key, description, flags, digest, automatic)  # type: ignore[arg-type]
        self.describe, self.carries, self.what = describe, carries, what
        self.direct = False

    def described(self) -> Dict[str, Any]:
        if self.description is None:
            self.description = self.describe()
        return self.description

    def summary(self) -> matching.Summary:
        self.described()
        return super().summary()


def post_record(comm: Communicator, sched: scheduler.Schedule, digest: int,
                flags: Optional[np.ndarray], what: Any,
                inline: Optional[np.ndarray] = None) -> Gathered:
    """Exchange an active rank's record for the call ``what`` (its ``str()`` names it, see
    stall.poll), with a broadcast root's ``inline`` payload (see records.Records.post), and
    return the ranks' reduced one."""
    records = records_of(comm)
    records.post(digest, ACTIVE, flags, inline)
    number = sched.exchanges
    sched.exchanges = number + 1
    stall.poll(records.start(), sched, comm, what, "agreement", number)
    gathered = Gathered(records)
    sched.peers_joined = bool(gathered.state & JOINED)
    return gathered


def _outcome(comm: Communicator, entry: CallEntry, gathered: Gathered) -> Optional[np.ndarray]:
    """For an entry whose records agreed: mark it to carry its data where no rank has
    joined, and return the or-ed flags."""
    entry.direct = entry.carries and not gathered.state & JOINED
    return None if entry.flags is None else gathered.flags(comm, len(entry.flags))


def agree_in_step(comm: Communicator, sched: scheduler.Schedule,
                  entry: CallEntry) -> Optional[np.ndarray]:
    """An agreement made by the turn's holder, in step with the other ranks' holders."""
    gathered = post_record(comm, sched, entry.digest, entry.flags, entry.what)
    if not gathered.agreed:
        _raise_disagreement(comm, entry.key, entry.described())
    if sched.peers_joined:
        _meet_joined(comm, entry.described())
    return _outcome(comm, entry, gathered)


def _deadlocked(gathered: Sequence[Any], lists: Sequence[Any]) -> bool:
    """Whether the active ranks of a round's exchange (joined ranks gave None) can never
    match what they wait for (see matching.deadlocked)."""
    return matching.deadlocked([g is not None and g.stuck for g in gathered], lists)


def run_round(comm: Communicator, sched: scheduler.Schedule,
              entries: List[CallEntry]) -> List[matching.Verdict]:
    """One round over this rank's pending ``entries`` (see scheduler.py): when every rank's
    oldest entry is the same call, decide it; else exchange the lists and match by key."""
    head = entries[0]
    return decide(comm, sched, post_record(comm, sched, head.digest, head.flags, head.what),
                  entries)


def decide(comm: Communicator, sched: scheduler.Schedule, gathered: Gathered,
            entries: List[CallEntry]) -> List[matching.Verdict]:
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
    failure = functools.partial(failure_for, comm)
    verdicts = matching.match(lists, failure, single=joined, me=comm.rank)
    if not verdicts and _deadlocked(shared, lists):
        verdicts = matching.deadlock(lists, comm.rank, failure)
        if verdicts and first_of(verdicts).action == "run":
            # Ranks whose automatic names had drifted apart run their oldest calls together;
            # from here they count on from the same number.
            sched.align_counts(first_of(verdicts).key, [g.counts for g in shared if g is not None])
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
        self._records = records_of(comm)
        self._records.post(0, JOINED, None)
        scheduler.of(comm).exchanges += 1
        self._request = self._records.start()
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
        gathered = Gathered(self._records)
        if not gathered.state & ACTIVE:
            return None
        words_total = -1
        if not gathered.agreed:
            # The active ranks exchange their pending lists; at most the first key pending on
            # all of them runs, and this rank serves it; when none is and every active rank
            # is stuck, their oldest waited calls run together or raise (see run_round).
            gathered = comm.allgather_object(None)
            lists = [None if g is None else g.pending for g in gathered]
            verdicts = matching.match(lists, lambda every: RuntimeError(), single=True)
            runs = (first_of(verdicts).action == "run" if verdicts else
                    _deadlocked(gathered, lists) and matching.deadlock_runs(lists))
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
