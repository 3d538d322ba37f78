"""A round's decisions, from every rank's pending calls: which run, in which order, which raise.

What a rank contributes to a round is its list of :class:`Summary` records (None for a joined
rank); every rank decides from the same lists, so the decisions are the same everywhere.

- **Fast path.** When every rank's oldest pending entry is the same call, one small exchange
  decides it (see agreement.py); otherwise the ranks exchange their pending lists and
  :func:`match` pairs them by key (Horovod's coordinator matches by name): the keys pending on
  every rank run in the order of the lowest active rank's list; a key whose descriptions
  differ raises a mismatch on every rank; keys not yet pending everywhere wait for a later
  round.
- **No wait forever.** When every active rank waits for a call (its own thread's, an
  asynchronous one whose handle a thread waits for, or a graph's op beside a rank that
  waits outside a graph, see :func:`deadlocked`) and rounds match nothing for a moment, the
  ranks settle it by :func:`deadlock`, joined ranks or not.
"""
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from . import automatic_names


class Verdict(NamedTuple):
    """A round's decision on one entry: ``action`` "run" (``value``: the agreed description
    or flags), "raise" (``value``: the exception) or "wait" (the entry stays pending: a
    barrier, see :func:`_verdict_on_mismatch`)."""

    action: str
    key: str
    value: Any


class Summary(NamedTuple):
    """What the other ranks see of a pending entry when the ranks' heads differ."""

    key: str
    description: Dict[str, Any]
    waited: bool  # a thread waits for it, as of now
    automatic: bool  # its key is an automatic name
    in_graph: bool = False  # a graph's op waits for it, as of now (see deadlocked)


Failure = Callable[[List[Optional[Dict[str, Any]]]], BaseException]


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
    """Each rank's oldest call that a thread waits for, else its oldest that a graph's op
    waits for (None: a joined rank, or none)."""
    return [None if lst is None else
            next((s for s in lst if s.waited), next((s for s in lst if s.in_graph), None))
            for lst in lists]


def deadlocked(stuck: Sequence[bool], lists: Sequence[Optional[Sequence[Summary]]]) -> bool:
    """Whether the active ranks (``stuck`` by rank, ``lists`` None for a joined rank) can
    never match what they wait for: every one is stuck, and one waits outside a graph.

    A graph's op counts as a wait only beside such a rank: that rank starts nothing more
    (its thread waits in its program's order), so the others' graph ops can never meet it.
    Where every rank waits in graph ops, TensorFlow may still start ops of the graphs that
    match (in its own order on each rank, after computing their inputs): those ranks wait
    on, as in Horovod, and the stall inspector names what they wait for.
    """
    active = [(s, lst) for s, lst in zip(stuck, lists) if lst is not None]
    return all(s for s, _ in active) and any(e.waited for _, lst in active for e in lst)


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
