"""A function call on N ranks, the part that every way of making one shares (hvd_trainer.run
through hvdrun, hvd_trainer.spark and hvd_trainer.ray through their agents, HorovodRunner on
the driver): the pickled function that goes out, the :class:`Outcome` that each rank sends
back, and the gathering of the outcomes into the results in rank order or one error naming
the rank, its host and its traceback (:class:`EngineError`; :class:`EngineTimeout` for a
start that did not finish in time).

Pickling is cloudpickle's, as Horovod's, so functions of ``__main__``, lambdas and closures
travel by value; the bytes travel in signed files (files.signed) and through the engines,
and nothing is unpickled before its signature checks out.
"""
import pickle
import traceback
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

# The longest traceback that an EngineError's message quotes whole; a longer one is cut in
# the middle there, and kept whole in its rank_traceback.
MESSAGE_TRACEBACK_CHARS = 64 * 1024


class EngineError(RuntimeError):
    """A call on N ranks failed: a rank raised or died, an agent was lost, or it never
    started. ``rank_traceback`` is the whole traceback of the rank that raised ('' otherwise):
    the message quotes at most MESSAGE_TRACEBACK_CHARS of it."""

    def __init__(self, message: str, rank_traceback: str = ""):
        super().__init__(message)
        self.rank_traceback = rank_traceback


class EngineTimeout(EngineError, TimeoutError):
    """A call on N ranks could not start in time (too few resources, agents or ranks that
    never came)."""


class Outcome(NamedTuple):
    """What a rank sends back: the function's ``value``, or the exception it ``raised`` (None
    where it does not survive pickling) with its traceback ``text``, or that it ``left`` the
    job's world in place (an elastic job went on without it: it has no result)."""

    value: Any = None
    raised: Optional[BaseException] = None
    text: str = ""
    left: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.text)


class LostAgent(NamedTuple):
    """An agent that its engine lost while the job ran: its host, and what the engine said
    of it (an actor's death, an executor's loss: killed, out of memory, exit code)."""

    host: str
    cause: str = ""
    absent: bool = False  # gone before the life it was handed began


class HostOutcome(NamedTuple):
    """What an agent carries back from its host: the host, its launcher proxy's exit code,
    each rank's pickled :class:`Outcome` (signed on the way: the driver unpickles it), and the
    end of the proxy's own messages."""

    host: str
    code: int
    outcomes: Dict[int, bytes]
    messages: str = ""
    events: Sequence[str] = ()  # what its ranks logged (ray_logger), a JSON object each


def payload(func: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Optional[Dict[str, Any]] = None) -> bytes:
    """(func, args, kwargs) pickled by value, for the ranks."""
    import cloudpickle
    return cloudpickle.dumps((func, tuple(args or ()), dict(kwargs or {})))


def returned(value: Any) -> bytes:
    """The pickled outcome of a rank whose function returned ``value``."""
    import cloudpickle
    return cloudpickle.dumps(Outcome(value=value))


def left_job() -> bytes:
    """The pickled outcome of a rank that an elastic job left out in place."""
    import cloudpickle
    return cloudpickle.dumps(Outcome(left=True))


def raised(error: BaseException) -> bytes:
    """The pickled outcome of a rank whose function raised ``error``; the text alone where
    the exception does not survive pickling (some cannot be rebuilt). A subclass of SystemExit
    (hvd_trainer's own, from sys.exit in a job) travels as the SystemExit that the function's
    sys.exit call means; the text leaves out the frames that say ``__tracebackhide__ = True``
    (the convention of pytest's: that sys.exit's)."""
    import cloudpickle
    if isinstance(error, SystemExit) and type(error) is not SystemExit:
        plain = SystemExit(error.code)
        plain.__cause__, plain.__context__ = error.__cause__, error.__context__
        error = plain.with_traceback(error.__traceback__)
    shown = traceback.TracebackException(type(error), error, error.__traceback__)
    hidden = [bool(frame.f_locals.get("__tracebackhide__"))
              for frame, _ in traceback.walk_tb(error.__traceback__)]
    shown.stack = traceback.StackSummary.from_list(
        [entry for entry, hide in zip(shown.stack, hidden) if not hide])
    text = "".join(shown.format())
    try:
        data = cloudpickle.dumps(Outcome(raised=error, text=text))
        pickle.loads(data)
        return data
    except Exception:
        return cloudpickle.dumps(Outcome(text=text))


def _load(data: bytes, name: str, rank: int) -> Outcome:
    try:
        return pickle.loads(data)
    except Exception as error:  # e.g. a class this process cannot import
        raise EngineError(f"the result of {name} on rank {rank} cannot be unpickled here: "
                          f"{error}") from error


def gather(outcomes: Dict[int, bytes], size: int, name: str, hosts: Dict[int, str],
           code: int, messages: Sequence[str], lost: Sequence[LostAgent] = (),
           proxies: Sequence[HostOutcome] = ()) -> List[Any]:
    """The ranks' results in rank order from their pickled ``outcomes`` (those that left the
    world in place have none); EngineError naming
    the rank (and host, where ``hosts`` knows it) that raised, the ranks without a result, or
    the agents ``lost`` and why, with hvdrun's ``messages`` and exit ``code``, and what each
    host's proxy that failed (``proxies``) said."""
    loaded = {rank: _load(outcomes[rank], name, rank) for rank in range(size) if rank in outcomes}
    failed = [rank for rank, outcome in loaded.items() if outcome.failed]
    missing = [rank for rank in range(size) if rank not in loaded]
    said = f"\nhvdrun: {'; '.join(messages)}" if messages else ""
    said += "".join(f"\nthe launcher proxy on {end.host} exited with code {end.code}"
                    + (f": {end.messages.strip()}" if end.messages.strip() else "")
                    for end in proxies if end.code)
    if failed:
        first, others = failed[0], failed[1:]
        also = f" (also on rank{'s' if len(others) > 1 else ''} " \
               f"{', '.join(map(str, others))})" if others else ""
        where = f" on host {hosts[first]}" if first in hosts else ""
        text = loaded[first].text
        raise EngineError(f"{name} raised on rank {first}{where}{also}:\n{_quoted(text)}{said}",
                          text) from loaded[first].raised
    if lost:
        raise EngineError(f"{name}: the agent{'s' if len(lost) > 1 else ''} on "
                          f"{', '.join(agent.host for agent in lost)} "
                          f"{'were' if len(lost) > 1 else 'was'} lost (its executor or actor "
                          "died) and the job was ended"
                          + "".join(f"\n{agent.host}: {agent.cause}" for agent in lost
                                    if agent.cause) + said)
    if missing or code:
        where = sorted({hosts[r] for r in missing if r in hosts})
        text = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
                f"{' on ' + ', '.join(where) if where else ''} ended without a result; "
                if missing else "")
        raise EngineError(f"{name}: {text}hvdrun exited with code {code}"
                          + (said or " (the ranks' output above says why)"))
    return [loaded[rank].value for rank in range(size) if not loaded[rank].left]


def _quoted(text: str) -> str:
    """``text`` whole up to MESSAGE_TRACEBACK_CHARS, else its start and end with a note of
    what was cut (the end holds the exception itself)."""
    if len(text) <= MESSAGE_TRACEBACK_CHARS:
        return text
    head, tail = MESSAGE_TRACEBACK_CHARS // 4, MESSAGE_TRACEBACK_CHARS * 3 // 4
    return (f"{text[:head]}\n[... {len(text) - head - tail} characters cut here; the whole "
            f"traceback is the EngineError's rank_traceback ...]\n{text[-tail:]}")
