"""The machinery of the torch adapter's collectives: handles, how a collective is started on
the core's communication thread, and argument checks whose errors every rank raises.

Every collective runs on the core's communication thread (see
``hvd_trainer/coordination/work_order.py``) in the order of the calls, as Horovod's background
thread runs them: an ``*_async`` function returns a handle at once, :func:`poll` says whether it
has finished and :func:`synchronize` waits for it and returns its result (or raises its error).
A synchronous function is its ``*_async`` form followed by :func:`synchronize`, so both kinds
may be mixed freely.

Errors are collective. The adapter's own argument checks run at the call; one that fails goes
through the core's agreement (:func:`hvd_trainer.collectives.arguments.refuse`), so the rank
that made the bad call raises at once and every other rank raises the same error from
:func:`synchronize`. Errors reaching the caller through :func:`synchronize` are
``HorovodInternalError`` (see errors.py).
"""
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import torch

from ..collectives import arguments
from ..collectives.arguments import Average, Sum
from ..coordination import work_order
from ..coordination.handles import Handle
from ..runtime.runtime import ProcessSet
from . import bridge
from .errors import as_horovod_error

# Horovod's value of op=Adasum: allreduce and grouped_allreduce combine by adaptive summation
# (see hvd_trainer/collectives/adasum.py).
Adasum = 2
T = TypeVar("T")


def poll(handle: Handle) -> bool:
    """Whether the asynchronous collective behind ``handle`` has finished; never blocks."""
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for the asynchronous collective behind ``handle``; return its result.

    Its error, if it failed, is raised here as a ``HorovodInternalError`` that is also the
    core's ``ValueError``, ``TypeError`` or ``MismatchError``.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be a handle returned by an *_async function, got "
                        f"{type(handle).__name__}")
    try:
        return handle.wait()
    except (ValueError, TypeError, RuntimeError) as error:
        translated = as_horovod_error(error)
        if translated is error:
            raise
        raise translated.with_traceback(error.__traceback__) from None


class CallableHandle(Handle):
    """:func:`sparse_allreduce_async`'s handle: Horovod's is a function that returns the
    result, so this one may also be called."""

    def __call__(self) -> Any:
        return synchronize(self)


def start(collective: Callable[..., Any], *args: Any,
           finish: Callable[[Any], Any] = bridge.adopt, handle: type = Handle,
           on: Optional[torch.Tensor] = None, gpu_core: bool = True,
           name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Run ``finish(collective(*args))`` on the communication thread; return its handle.

    ``name`` and ``process_set`` are the collective's: its name (or automatic name) is taken
    now, in the caller's order, and one that is still pending raises ``ValueError`` here.

    When ``on`` is a CUDA tensor, the work runs in order with PyTorch's current stream on its
    device, taken now (``bridge.ordered``; ``gpu_core=False`` for work that never reaches
    CuPy).
    """
    ordered = None if on is None else bridge.ordered(on, gpu_core)
    if ordered is None:
        return handle(work_order.start(lambda: finish(collective(*args)), name, process_set))

    def run() -> Any:
        with ordered():
            return finish(collective(*args))

    return handle(work_order.start(run, name, process_set))


def checked(kind: str, name: Optional[str], process_set: ProcessSet, check: Callable[[], T]) -> T:
    """Run an argument ``check``; its error is raised on every rank of the process set.

    The refusal takes the collective's place on the communication thread, so it meets the
    other ranks' call of the same collective, in order.
    """
    try:
        return check()
    except (TypeError, ValueError) as error:
        synchronize(start(arguments.refuse, error, kind, name, process_set, name=name,
                           process_set=process_set))
        raise AssertionError("unreachable: arguments.refuse raises") from error


def tensor_list(tensors: Sequence[torch.Tensor], inplace: bool = False) -> List[torch.Tensor]:
    """``tensors`` checked as a grouped collective's: a list (not one tensor) of tensors the
    core can take, all on one device."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors must be a list of tensors, got a single tensor; wrap it in a "
                        "list")
    checked_tensors = [bridge.check_tensor(t, f"tensors[{i}]", inplace)
                       for i, t in enumerate(tensors)]
    for i, t in enumerate(checked_tensors[1:], 1):
        if t.device != checked_tensors[0].device:
            raise ValueError(f"tensors[{i}] is on {t.device} but tensors[0] on "
                             f"{checked_tensors[0].device}; a group's tensors must share one "
                             "device (move them, or make one call per device)")
    return checked_tensors


def is_adasum(op: Any) -> bool:
    """Whether ``op`` is Horovod's op=Adasum."""
    return isinstance(op, int) and not isinstance(op, bool) and op == Adasum


def no_adasum(op: Any, kind: str) -> Any:
    """``op``, unless it is Adasum, which collective ``kind`` does not take (ValueError)."""
    if is_adasum(op):
        raise ValueError(f"{kind} does not take op=Adasum (nor does Horovod's); use op=Average "
                         "or op=Sum")
    return op


def not_differentiable(kind: str, op: Any) -> None:
    """Refuse the gradient of collective ``kind`` with an ``op`` other than Average or Sum."""
    if op not in (Average, Sum):
        what = "Adasum" if is_adasum(op) else arguments.ReduceOp(op).name.title()
        raise RuntimeError(f"{kind} with op={what} has no gradient here; only Average and Sum "
                           "are differentiable")
