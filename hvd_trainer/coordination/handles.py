"""Handles of asynchronous collectives: started on a communication thread, waited on later.

:func:`submit` starts a collective through the scheduler
(:func:`hvd_trainer.coordination.work_order.start`), which runs it on a communication thread in the
order of submission and takes its name, or its automatic name, at submission, so a name still
pending raises there (see work_order.py for the order and parking, scheduler.py for matching). The
returned :class:`Handle` is polled or waited on; waiting raises what the collective raised, on this
rank as on the others. Horovod's ``*_async`` functions, ``poll`` and ``synchronize`` are built on
this.
"""
from concurrent.futures import Future
from typing import Any, Callable

from ..runtime import runtime
from . import work_order


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
    Its ``name`` and ``process_set`` keywords, if given, are taken now (see
    :func:`hvd_trainer.coordination.work_order.start`)."""
    process_set = kwargs.get("process_set")
    if process_set is None:
        process_set = runtime.global_process_set
    return Handle(work_order.start(lambda: collective(*args, **kwargs), kwargs.get("name"),
                                   process_set))
