"""Asynchronous collectives: run on a communication thread, waited on later.

A collective started with :func:`submit` runs on a background thread, in the order of
submission, so ranks that submit in the same order run the same sequence of collectives
(each with its own agreement) while the caller computes. Its name, or its automatic name, is
taken at submission, in the caller's order, so a name still pending raises there. When a
collective waits for a match that has not come (other ranks submitted theirs in another
order, see scheduler.py), its thread *parks*: the next submitted work starts on another
thread, so calls submitted in different orders on different ranks still meet. The returned
:class:`Handle` is polled or waited on; waiting raises what the collective raised, on this
rank as on the others. Horovod's ``*_async`` functions, ``poll`` and ``synchronize`` are
built on this.

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
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import runtime, scheduler

_Work = Tuple["Future[Any]", Callable[[], Any], Optional[scheduler.Job]]

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
        while True:
            future, work, job = self.work
            scheduler.set_job(job, self._park)
            try:
                _complete(future, work)
            finally:
                scheduler.set_job(None, None)
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
    scheduler.await_job), so ranks that all wait for calls that cannot match raise instead
    of waiting forever."""

    def __init__(self, job: Optional[scheduler.Job]):
        super().__init__()
        self.job = job

    def result(self, timeout: Optional[float] = None) -> Any:
        with scheduler.await_job(self.job):
            return super().result(timeout)


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


def _job(name: Optional[str], process_set: Any) -> Optional[scheduler.Job]:
    """The key reservation of a collective submitted now (see scheduler.Job)."""
    if process_set is None:
        return None
    job = scheduler.Job()
    scheduler.of(runtime.communicator(process_set)).reserve_for(job, name)
    return job


def start(work: Callable[[], Any], name: Optional[str] = None,
          process_set: Any = None) -> "Future[Any]":
    """Run ``work()`` on the communication thread, behind what was submitted or deferred
    before (after this thread's closers); its future holds the result.

    With ``process_set``, ``work`` is a collective named ``name`` on it: its name (or its
    automatic one) is taken now, in this thread's program order, and a name still pending
    raises :class:`~hvd_trainer.scheduler.DuplicateNameError` here.
    """
    _close()
    job = _job(name, process_set)
    future: "Future[Any]" = _Submitted(job)
    with _lock:
        _flush_locked()
        _hand((future, work, job))
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
            _hand((future, work, None))
        else:
            _deferred = (future, work, None)
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
        _complete(*item[:2])


def run_deferred(future: "Future[Any]") -> None:
    """Run the work of ``future`` here and now if it is still deferred; otherwise it is on
    the thread (or done), and this does nothing."""
    global _deferred
    with _lock:
        if _deferred is None or _deferred[0] is not future:
            return
        item, _deferred = _deferred, None
    _complete(*item[:2])


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
    """Start ``collective(*args, **kwargs)`` on the communication thread; return its handle.
    Its ``name`` and ``process_set`` keywords, if given, are taken now (see :func:`start`)."""
    process_set = kwargs.get("process_set")
    if process_set is None:
        process_set = runtime.global_process_set
    return Handle(start(lambda: collective(*args, **kwargs), kwargs.get("name"), process_set))
