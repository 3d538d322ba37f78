"""Asynchronous collectives: run on the process's one communication thread, waited on later.

A collective started with :func:`submit` runs on a single background thread, in the order
of submission, so ranks that submit in the same order run the same sequence of collectives
(each with its own agreement) while the caller computes. The returned :class:`Handle` is
polled or waited on; waiting raises what the collective raised, on this rank as on the
others. Horovod's ``*_async`` functions, ``poll`` and ``synchronize`` are built on this.
"""
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

_thread: Optional[ThreadPoolExecutor] = None
_lock = threading.Lock()


def communication_thread() -> ThreadPoolExecutor:
    """The process's one communication thread, started on first use."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvd_trainer-comm")
        return _thread


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
    return Handle(communication_thread().submit(collective, *args, **kwargs))
