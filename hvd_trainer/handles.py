"""Asynchronous collectives: run on the process's one communication thread, waited on later.

A collective started with :func:`submit` runs on a single background thread, in the order
of submission, so ranks that submit in the same order run the same sequence of collectives
(each with its own agreement) while the caller computes. The returned :class:`Handle` is
polled or waited on; waiting raises what the collective raised, on this rank as on the
others. Horovod's ``*_async`` functions, ``poll`` and ``synchronize`` are built on this.

Work can also be *deferred* (:func:`defer`): it takes its place in that order at once, but
the thread is not woken for it. Whatever this process starts next goes behind it: the next
:func:`start` hands it to the thread first, and a synchronous collective (``flush(here=True)``)
runs it first on the calling thread. If nothing comes first, :func:`run_deferred` runs it
where its result is needed. A training step whose gradients are all ready by the time it is
launched so costs no thread switches, yet is ordered as if it had been submitted.

A thread may also register a *closer* (:func:`on_own_collective`): a collective that the same
thread starts later (submitted, or synchronous) runs it first. The torch optimizer registers one when its
step begins, so that ``hvd.allreduce(loss)`` between backward and ``step()`` first closes
the step (gradients not computed by then are stale), instead of waiting behind a step that
waits for ``step()``.
"""
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

_thread: Optional[ThreadPoolExecutor] = None
_lock = threading.Lock()
_busy = 0  # work handed to the thread and not finished
_deferred: Optional[Tuple["Future[Any]", Callable[[], Any]]] = None
_closers: Dict[int, List[Callable[[], bool]]] = {}  # by thread ident


def _pool_locked() -> ThreadPoolExecutor:
    """The process's one communication thread, started on first use (under ``_lock``)."""
    global _thread
    if _thread is None:
        _thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvd_trainer-comm")
    return _thread


def _complete(future: "Future[Any]", work: Callable[[], Any]) -> None:
    try:
        result = work()
    except BaseException as e:  # the waiter raises it
        future.set_exception(e)
    else:
        future.set_result(result)


def _hand(future: "Future[Any]", work: Callable[[], Any]) -> None:
    """Give ``work`` to the thread (the caller holds ``_lock``)."""
    global _busy

    def run() -> None:
        global _busy
        try:
            _complete(future, work)
        finally:
            with _lock:
                _busy -= 1

    _busy += 1
    _pool_locked().submit(run)


def start(work: Callable[[], Any]) -> "Future[Any]":
    """Run ``work()`` on the communication thread, behind what was submitted or deferred
    before (after this thread's closers); its future holds the result."""
    _close()
    future: "Future[Any]" = Future()
    with _lock:
        _flush_locked()
        _hand(future, work)
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
            _hand(future, work)
        else:
            _deferred = (future, work)
    return future


def _flush_locked() -> None:
    global _deferred
    if _deferred is not None:
        _hand(*_deferred)
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
        _complete(*item)


def run_deferred(future: "Future[Any]") -> None:
    """Run the work of ``future`` here and now if it is still deferred; otherwise it is on
    the thread (or done), and this does nothing."""
    global _deferred
    with _lock:
        if _deferred is None or _deferred[0] is not future:
            return
        item, _deferred = _deferred, None
    _complete(*item)


class Handle:
    """A collective in progress on the communication thread."""

    def __init__(self, future: "Future[Any]"):
        self._future = future

    def poll(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks."""
        return self._future.done()

    def wait(self) -> Any:
        """Block until the collective has finished; return its result or raise its error."""
        return self._future.result()


def submit(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Handle:
    """Start ``collective(*args, **kwargs)`` on the communication thread; return its handle."""
    return Handle(start(lambda: collective(*args, **kwargs)))
