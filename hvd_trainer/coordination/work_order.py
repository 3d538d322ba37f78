"""The rank's order of work: when a collective is made, and on which thread.

It is one per process, since a rank's program order spans its process sets (and, where MPI
serialises calls, its communicators share one user). Every way of making a collective goes
through it: a synchronous call (:func:`flush` with ``here``, from agreement.py and joined.py),
an asynchronous one (:func:`start`, under handles.py's ``submit`` and the adapters'
``*_async``) and a training step's program (:func:`defer`, :func:`start` and
:func:`run_deferred`, from reducer.py). The call then goes to its communicator's schedule
(scheduler.py).

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
  at a hook registers one (training/reducer.py), so that a collective the script starts between backward
  and the step's close first closes the step, instead of waiting behind a step that waits
  for the script.

Invariants (unit tests drive them without MPI):

- **Handed work runs in the order of handing.** Work handed to the communication thread
  starts in that order; a later one starts before an earlier one ends only when the earlier
  one has parked (it waits for a match).
- **Deferred work goes first.** At most one work is deferred at a time; it runs before any
  work the process starts after it (on the thread, or here for a synchronous call), and
  exactly once.
- **Closers run on their own thread only,** before that thread's next collective, until one
  returns True or is forgotten; other threads' collectives never run them.
"""
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional

from . import automatic_names
from ..runtime import runtime
from .jobs import Job, await_job, set_job
from .scheduler import of


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
_closers: Dict[threading.Thread, List[Callable[[], bool]]] = {}  # by thread
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


def _job(name: Optional[str], process_set: Any, in_graph: bool) -> Optional[Job]:
    """The key reservation of a collective submitted now (see Job); a graph's op does not
    hold its name after it ran."""
    if process_set is None:
        return None
    job = Job(hold=not in_graph, in_graph=in_graph)
    of(runtime.communicator(process_set)).reserve_for(job, name)
    return job


def start(work: Callable[[], Any], name: Optional[str] = None,
          process_set: Any = None, in_graph: bool = False) -> "Future[Any]":
    """Run ``work()`` on the communication thread, behind what was submitted or deferred
    before (after this thread's closers); its future holds the result.

    With ``process_set``, ``work`` is a collective named ``name`` on it: its name (or its
    automatic one) is taken now, in this thread's program order, and a name still pending
    raises :class:`DuplicateNameError` here. With ``in_graph`` it is an op of a graph that
    TensorFlow runs beside the graph's others, in any order: a thread waiting for the future
    makes it count as waited for only where another rank waits outside a graph (see
    :func:`~hvd_trainer.coordination.matching.deadlocked`).
    """
    _close()
    job = _job(name, process_set, in_graph)
    future: "Future[Any]" = _Submitted(job)
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
    with _lock:  # by thread, not by its id: a new thread may get the id of one that ended
        _closers.setdefault(threading.current_thread(), []).append(closer)


def forget_closer(closer: Callable[[], bool]) -> None:
    """Remove ``closer``, whichever thread registered it, if it is still there."""
    with _lock:
        for thread, theirs in list(_closers.items()):
            if closer in theirs:
                theirs.remove(closer)
            if not theirs:
                del _closers[thread]


def _close() -> None:
    """Run this thread's closers (see :func:`on_own_collective`)."""
    if not _closers:
        return
    me = threading.current_thread()
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


def idle() -> bool:
    """Whether :func:`flush` with ``here`` would do nothing: no work is deferred and no
    thread has a closer (the steady-state fast path of agreement.py checks it instead)."""
    return _deferred is None and not _closers


def run_deferred(future: "Future[Any]") -> None:
    """Run the work of ``future`` here and now if it is still deferred; otherwise it is on
    the thread (or done), and this does nothing."""
    global _deferred
    with _lock:
        if _deferred is None or _deferred.future is not future:
            return
        item, _deferred = _deferred, None
    _complete(item.future, item.run)
