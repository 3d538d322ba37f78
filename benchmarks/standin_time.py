"""How much of a call's CPU time is spent inside the CPU stand-in for CuPy and NCCL.

On a GPU machine CuPy's host work (a launch, an event, a stream switch) is compiled code and
the CUDA driver's; on the stand-in it is Python, several times slower. To judge hvd_trainer's
own host time apart from it, :func:`outside` times the stand-in's outermost calls: every
function, method and property of the stand-in's modules is wrapped by a timer that reads
this thread's CPU clock when the thread enters the stand-in and when it leaves it (calls the
stand-in makes to itself are not timed again). The wrappers' own cost outside the timed
window is measured on a wrapped empty function and taken off per entry.
"""
import functools
import sys
import threading
import time
import types
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

_clock = time.thread_time
_local = threading.local()


class Split(NamedTuple):
    """µs of this thread's CPU time per call: the whole call under the timers, the part
    inside the stand-in, the stand-in calls entered from outside per call, and the part
    outside the stand-in (the whole less the inside, less the timers' cost per entry)."""

    whole: float
    inside: float
    entries: float
    outside: float


class _Window:
    """CPU seconds spent in the stand-in's outermost calls so far, and how many there were."""

    def __init__(self) -> None:
        self.seconds, self.entries = 0.0, 0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, timed when called from outside the stand-in."""
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if getattr(_local, "inside", False):
                return fn(*args, **kwargs)
            _local.inside = True
            tic = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += _clock() - tic
                self.entries += 1
                _local.inside = False
        return run


def _wrapped(value: Any, window: _Window, made: Dict[Any, Any]) -> Any:
    """``value`` (a class attribute) with its functions timed, or None where there is none."""
    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        if fn not in made:
            made[fn] = window.timed(fn)
        return made[fn]
    if isinstance(value, types.FunctionType):
        return timed(value)
    if isinstance(value, property):
        return property(value.fget and timed(value.fget), value.fset and timed(value.fset))
    if isinstance(value, (staticmethod, classmethod)):
        return type(value)(timed(value.__func__))
    return None


def _instrument(window: _Window, packages: Tuple[str, ...]) -> List[Tuple[Any, str, Any]]:
    """Wrap the stand-in's functions where its modules bind them, and its classes' methods
    and properties in place; returns what to put back."""
    modules = [m for name, m in list(sys.modules.items())
               if m is not None and name.partition(".")[0] in packages]
    names = {m.__name__ for m in modules}
    made: Dict[Any, Any] = {}
    undo = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__module__ in names:
                undo.append((module, name, value))
                setattr(module, name, _wrapped(value, window, made))
            elif isinstance(value, type) and value.__module__ == module.__name__:
                for attr, member in list(vars(value).items()):
                    new = _wrapped(member, window, made)
                    if new is not None:
                        undo.append((value, attr, member))
                        setattr(value, attr, new)
    return undo


def _per_call(fn: Callable[[], object], calls: int) -> float:
    tic = _clock()
    for _ in range(calls):
        fn()
    return (_clock() - tic) / calls * 1e6


def outside(fn: Callable[[], object], calls: int, settle: Callable[[], None],
            packages: Tuple[str, ...] = ("cupy", "cupyx")) -> Split:
    """Time ``calls`` calls of ``fn`` with the stand-in's calls timed; ``settle()`` (run
    after the timing, untimed) waits for the device work they queued."""
    window = _Window()
    empty = window.timed(lambda: None)
    bare = _per_call(lambda: None, calls)
    wrapped = _per_call(empty, calls)
    cost = wrapped - window.seconds / window.entries * 1e6 - bare  # per entry, outside
    undo = _instrument(window, packages)
    try:
        window.seconds, window.entries = 0.0, 0
        whole = _per_call(fn, calls)
        inside, entries = window.seconds / calls * 1e6, window.entries / calls
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
    settle()
    return Split(whole, inside, entries, whole - inside - cost * entries)
