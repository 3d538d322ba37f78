"""What a repeated collective's checked arguments fix, kept by what fixes them.

A script's collectives repeat: the same kind, op, scale factors, root, dtype and shape on the
same process set, call after call (a metric averaged each step, a flag broadcast, a GPU
gradient bucket's allreduce). What those fix (the checks that depend on them alone, the
signature and its digest's base, the scale factors, whether and how the data travels in the
carrier) is worked out once and kept here, keyed by the communicator and those arguments
(host arrays, or a device's); a later call with the same key
checks only what can change between calls (the array's type and, in place, its layout).
Every plan is forgotten at shutdown: a reset's new communicators, whose sizes may differ,
start afresh.
"""
import threading
import weakref
from typing import (Any, Callable, Dict, Generic, List, NamedTuple, Optional, Sequence,
                    TypeVar)

import numpy as np

from ..coordination import records
from ..runtime import runtime
from .arguments import ReduceOp, half_in_float32, reduction_signature, scales
from .memory import HOST, Memory

__all__ = ["Reduction", "Broadcast", "reductions", "broadcasts", "reduction_key",
           "reduction", "broadcast_key", "broadcast"]

Plan = TypeVar("Plan")
_KEPT = 1024  # plans kept per kind of call, beyond which they are all forgotten


class _Kept(NamedTuple):
    """A kept plan and its communicator, held weakly."""
    comm: Callable[[], Any]
    plan: Any


class _Last(NamedTuple):
    """A thread's last call of a kind that ran: its communicator (weakly), the arguments that
    fixed its plan, the plan, and the generation of plans it belongs to."""
    comm: Callable[[], Any]
    arguments: tuple
    plan: Any
    generation: int


_NONE = _Last(lambda: None, (), None, -1)


class _Local(threading.local):
    """Per thread: its last call of a kind that ran, if the calls since have not raised
    (``last``), and whether or not they have (``ran``); class defaults, read without a
    getattr default."""

    last = _NONE
    ran = _NONE


class Known(Generic[Plan]):
    """The plans of one kind of call made so far, by key. A key names its communicator by
    ``id``, and the plan holds it weakly: a kept plan keeps no communicator (nor the GPU
    communicator that goes with it) alive after its process set is removed.

    The steady-state fast path skips even the key: :meth:`again` gives the plan of the
    calling thread's last call that ran (:meth:`ran`) when its next call is on the same
    communicator with the same arguments (compared in place, cheaper than a key and its
    lookup)."""

    def __init__(self) -> None:
        self.plans: Dict[Any, _Kept] = {}
        self.local = _Local()
        self.generation = 0  # plans of an older generation were forgotten (see forget)

    def get(self, key: Optional[tuple], comm: Any) -> Optional[Plan]:
        """The plan kept under ``key`` for ``comm`` (None: none, or no key)."""
        held = None if key is None else self.plans.get(key)
        return None if held is None or held.comm() is not comm else held.plan

    def keep(self, key: Optional[tuple], comm: Any, plan: Plan) -> Plan:
        """Keep ``plan`` under ``key`` for ``comm`` (none kept without a key); returns it."""
        if key is not None:
            if len(self.plans) >= _KEPT:
                self.plans.clear()
            self.plans[key] = _Kept(weakref.ref(comm), plan)
        return plan

    def again(self, comm: Any, arguments: tuple) -> Optional[Plan]:
        """The plan of this thread's last call that ran, if it was on ``comm`` with equal
        ``arguments`` (which the caller makes as it made them then); else None."""
        last = self.local.last
        if last.comm() is comm and last.arguments == arguments \
                and last.generation == self.generation:
            return last.plan
        return None

    def ran(self, comm: Any, arguments: tuple, plan: Plan) -> None:
        """A call on ``comm`` with ``arguments`` (plain values of the arguments its plan's key
        was made from) agreed and ran by ``plan``: this thread's next identical one may skip
        its checks (see :meth:`again`)."""
        local = self.local
        ran = local.ran
        if ran.plan is not plan or ran.comm() is not comm or ran.generation != self.generation:
            ran = local.ran = _Last(weakref.ref(comm), arguments, plan, self.generation)
        local.last = ran  # the same plan on the same communicator: the same arguments

    def forget_last(self) -> None:
        """This thread's next call takes the full path, its checks included (until a call
        has run by it)."""
        self.local.last = _NONE

    def forget(self) -> None:
        """Forget every plan, and every thread's last call."""
        self.plans.clear()
        self.generation += 1


class Reduction(NamedTuple):
    """What a reduction's checked arguments fix, but for the data: its signature, the scale
    factors (Average's 1/size folded in), which tensors are summed in float32 (``wide``),
    the dtype their data travels in, in the carrier (None: its own data phase), and whether
    that is the one tensor's own bytes (``lone``)."""

    signature: records.Signature
    pre: float
    post: float
    wide: List[bool]
    wire: Optional[np.dtype]
    lone: bool


class Broadcast(NamedTuple):
    """What a host broadcast's checked arguments fix, but for the data: the root's position in
    the process set, the signature with its digest's base, whether the data fits in the
    carrier, and whether it may ride in the root's agreement record (at most
    ``records.INLINE_ROOM`` bytes, at any rank count)."""

    root: int
    signature: records.Signature
    fits: bool
    inline: bool


reductions: "Known[Reduction]" = Known()
broadcasts: "Known[Broadcast]" = Known()


def reduction_key(comm: Any, memory: Memory, kind: str, tensors: Sequence[Any], op: Any,
                  pre: Any, post: Any, inplace: bool, halves: str) -> Optional[tuple]:
    """The key under which the :class:`Reduction` of an allreduce of one array, or of a
    grouped allreduce of arrays, all of ``memory`` (host memory, or a device's), is kept; or
    None (another kind of call, arrays of another type, or arguments whose checks the key
    cannot stand for: an op not given as a ReduceOp, factors not given as floats)."""
    if type(op) is not ReduceOp or type(pre) is not float or type(post) is not float \
            or (memory is not HOST and memory.where == "host"):
        return None
    array = memory.xp.ndarray
    if kind == "allreduce":
        tensor = tensors[0]
        if type(tensor) is not array:
            return None
        arrays: tuple = (tensor.dtype, tensor.shape)
    elif kind == "grouped_allreduce" and type(tensors) is list:
        if any(type(t) is not array for t in tensors):
            return None
        arrays = tuple([(t.dtype, t.shape) for t in tensors])
    else:
        return None
    return id(comm), memory, kind, inplace, op, pre, post, halves, arrays


def reduction(comm: Any, memory: Memory, kind: str, tensors: Sequence[Any], op: ReduceOp,
              prescale_factor: float, postscale_factor: float, halves: str) -> Reduction:
    """The :class:`Reduction` of checked arguments."""
    signature = records.Signature(kind, reduction_signature(memory, tensors, op,
                                                           prescale_factor, postscale_factor))
    pre, post = scales(op, comm, prescale_factor, postscale_factor)
    wide = [half_in_float32(t, op, pre, post, halves) for t in tensors]
    wire = _carried_dtype(memory, tensors, wide, records.room(comm))
    lone = (wire is not None and len(tensors) == 1 and not wide[0]
            and tensors[0].dtype == wire and pre == 1.0)
    return Reduction(signature, pre, post, wide, wire, lone)


def _carried_dtype(memory: Memory, tensors: Sequence[Any], wide: Sequence[bool],
                   room: int) -> Optional[np.dtype]:
    """The dtype in which ``tensors`` can travel in the carrier (see agreement.py), or None:
    host arrays of one dtype on the wire (float32 for the ``wide`` halves) that fit in
    ``room`` bytes, under HVD_ALLREDUCE_ALGO=auto. Decided from what the ranks agree on, so
    every rank decides alike when they agree."""
    if memory is not HOST or not room or runtime.setting("ALLREDUCE_ALGO") != "auto":
        return None
    wire, size = None, 0
    for t, w in zip(tensors, wide):
        dtype = _FLOAT32 if w else t.dtype
        if wire is not None and dtype != wire:
            return None
        wire, size = dtype, size + t.size
    return wire if wire is not None and size * wire.itemsize <= room else None


_FLOAT32 = np.dtype(np.float32)


def broadcast_key(comm: Any, tensor: Any, root_rank: Any, inplace: bool) -> Optional[tuple]:
    """The key of a host array's broadcast under which its :class:`Broadcast` is kept, or
    None (not a NumPy array, or a root not given as an int)."""
    if type(tensor) is not np.ndarray or type(root_rank) is not int:
        return None
    return id(comm), root_rank, tensor.dtype, tensor.shape, inplace


def broadcast(comm: Any, memory: Memory, tensor: Any, root_rank: int, root: int) -> Broadcast:
    """The :class:`Broadcast` of checked arguments (``root``: the root's position)."""
    return Broadcast(root, records.Signature("broadcast", (
        root_rank, memory is HOST, tensor.dtype.str, tensor.shape)),
        memory is HOST and tensor.nbytes <= records.room(comm),
        memory is HOST and tensor.nbytes <= records.INLINE_ROOM)


def _forget(comm: Any) -> bool:
    """At shutdown: forget every plan (on every communicator)."""
    reductions.forget()
    broadcasts.forget()
    return False


runtime.at_leave(_forget)
