"""What every collective checks and describes: Horovod's reduction ops, the argument checks,
and the descriptions and signatures that the ranks' agreement compares.

Each check runs inside a :meth:`~hvd_trainer.coordination.agreement.Call.checks` block, so a
failure on one rank raises on every rank (see ops.py).
"""
from __future__ import annotations  # the nested functions' annotations cost each call else

import enum
import warnings
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

from ..coordination import agreement
from ..runtime import runtime
from ..backends import widened
from .memory import HOST, Memory, memory_of
from ..runtime.runtime import ProcessSet, global_process_set


class ReduceOp(enum.IntEnum):
    """Reduction operators, named as in Horovod."""

    AVERAGE = 0
    SUM = 1
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN,
                                   ReduceOp.MAX, ReduceOp.PRODUCT)
BACKEND_OP = {ReduceOp.AVERAGE: "sum", ReduceOp.SUM: "sum", ReduceOp.MIN: "min",
               ReduceOp.MAX: "max", ReduceOp.PRODUCT: "prod"}


# -- argument checks (each runs inside a Call's checks(), so a failure is collective) --------
def check_rows(tensor: Any, arg: str, kind: str) -> None:
    if tensor.ndim == 0:
        raise ValueError(f"{arg} must have at least one dimension for {kind}; "
                         "reshape a scalar to shape (1,)")


def _check_op(op: Any) -> ReduceOp:
    if type(op) is ReduceOp:
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        valid = ", ".join(o.name.title() for o in ReduceOp)
        raise ValueError(f"op={op!r} is not a reduction operator; use one of {valid}") from None


def check_root(root_rank: Any, process_set: ProcessSet) -> int:
    """The position in the process set of ``root_rank``, a global rank (Horovod's rule)."""
    if not isinstance(root_rank, (int, np.integer)) or root_rank not in process_set.ranks:
        where = ("the world" if process_set is global_process_set
                 else f"process set {process_set.process_set_id}")
        raise ValueError(f"root_rank={root_rank!r} is not a rank of {where}; it must be one of "
                         f"its global ranks {process_set.ranks}")
    return process_set.ranks.index(int(root_rank))


def _check_scale(value: Any, arg: str) -> float:
    if type(value) is float:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{arg}={value!r} must be a number")
    return float(value)


def describe_tensor(t: Any, name: str, dim0: bool = True) -> dict:
    """What ranks must agree on about a tensor; host and GPU arrays describe alike except
    for where they live."""
    shape = t.shape if dim0 else t.shape[1:]
    return {"name": name, "dtype": t.dtype.str, "shape": tuple(shape),
            "memory": memory_of(t).where}


def tensor_signature(memory: Memory, tensors: Sequence[Any], dim0: bool = True) -> tuple:
    """What fixes the :func:`describe_tensor` of each of ``tensors`` (checked arrays of
    ``memory``) but for the names: a part of a call's signature (see agreement.Call.agree),
    which costs a fraction of the description."""
    if dim0:
        return memory is HOST, tuple([(t.dtype.str, t.shape) for t in tensors])
    return memory is HOST, tuple([(t.dtype.str, t.shape[1:]) for t in tensors])


def tensor_names(base: str, count: int) -> List[str]:
    """The names of a group's tensors: the base name alone, or ``base.i``."""
    return [base] if count == 1 else [f"{base}.{i}" for i in range(count)]


def scales(op: ReduceOp, comm, prescale: float, postscale: float) -> Tuple[float, float]:
    """Pre- and postscale factors, with Average's 1/size folded into the postscale."""
    if op == ReduceOp.AVERAGE:
        # float() first: NumPy 2 would divide an np.float32 factor in float32.
        postscale = float(postscale) / comm.size
    return float(prescale), float(postscale)


def requested_op(op: Any, average: Optional[bool], stacklevel: int = 4) -> Any:
    """Horovod's rule for the adapters' ``op=``/``average=``: ``op`` wins, ``average`` is its
    deprecated spelling (warned about at the caller ``stacklevel`` frames up), Average by
    default."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn("average= is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=stacklevel)
        return Average if average else Sum
    return Average if op is None else op


# How a scaled sum (Average, pre- or postscale) of 16-bit floats is rounded. ROUNDED_ONCE:
# summed and postscaled in float32, rounded once, what Horovod's MXNet and torch tests expect
# on 3 ranks (its float16 cases there: the MXNet suite's sums of non-integers, the torch
# suite's of integers, where both rules agree). ROUNDED_EACH: Horovod's own CPU arithmetic,
# rounded to the dtype after the prescale, after each addition and after the postscale
# (ScaleBuffer, its float16 MPI sum), what its TensorFlow tests expect: they compute
# (t * 3) / 3 and (t * 3) * factor in float16. On 2 ranks the two agree (a sum of two equal
# values is exact); docs/conformance.md has the arithmetic.
ROUNDED_ONCE, ROUNDED_EACH = "once", "each"


def half_in_float32(tensor: Any, op: ReduceOp, pre: float, post: float,
                    halves: str = ROUNDED_ONCE) -> bool:
    """Whether a half-precision ``tensor`` is reduced in float32: under ROUNDED_ONCE a scaled
    sum (Average, pre- or postscale) is summed and postscaled in float32 and rounded to half
    once (scaling a sum already rounded to half would round twice); a prescale is applied
    first, rounded to half (see :func:`prescaled`). Under ROUNDED_EACH never: the sum is
    rounded at each addition and scaled as Horovod's CPU path does."""
    return (halves == ROUNDED_ONCE and (pre, post) != (1.0, 1.0)
            and op in (ReduceOp.SUM, ReduceOp.AVERAGE) and widened(tensor.dtype) is not None)


def prescaled(memory: Memory, tensor: Any, factor: float) -> Any:
    """A flat copy of ``tensor`` times ``factor``, rounded to the tensor's own dtype: Horovod
    scales into a buffer of that dtype, so a half-precision tensor's prescaled values are
    half-precision numbers before they are summed (its tests expect those bits)."""
    flat = memory.xp.empty(tensor.size, tensor.dtype)
    memory.pack([memory.xp.ascontiguousarray(tensor)], flat, factor)
    return flat


def check_reduction(op: Any, prescale: Any, postscale: Any) -> ReduceOp:
    """Check an allreduce's or reducescatter's op and scale factors; return the op."""
    _check_scale(prescale, "prescale_factor")
    _check_scale(postscale, "postscale_factor")
    return _check_op(op)


def describe_reduction(name: str, tensors: Sequence[Any], op: ReduceOp, prescale: float,
                       postscale: float) -> Dict[str, Any]:
    """What ranks must agree on about an allreduce or reducescatter."""
    names = tensor_names(name, len(tensors))
    return {"op": op.name, "prescale_factor": float(prescale),
            "postscale_factor": float(postscale),
            "tensors": [describe_tensor(t, n) for t, n in zip(tensors, names)]}


def reduction_signature(memory: Memory, tensors: Sequence[Any], op: ReduceOp, prescale: float,
                        postscale: float) -> tuple:
    """What fixes :func:`describe_reduction` but for the names (see :func:`tensor_signature`)."""
    return op, float(prescale), float(postscale), tensor_signature(memory, tensors)


def refuse(error: Exception, kind: str, name: Optional[str],
           process_set: ProcessSet = global_process_set) -> NoReturn:
    """Raise a framework adapter's argument error on every rank of the process set.

    The other ranks are in the collective ``kind`` (named ``name``): they meet this rank in
    its agreement and raise the same error, so an adapter's checks are collective too.
    """
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, kind, name) as call:
        call.error = error
        call.agree(dict)  # raises ``error`` here and on the other ranks


def check_list(tensors: Any, memory: Memory, inplace: bool = False) -> List[Any]:
    if isinstance(tensors, memory.xp.ndarray):
        raise TypeError("tensors must be a list of arrays, got a single array; wrap it in a list")
    return [memory.check(t, f"tensors[{i}]", inplace) for i, t in enumerate(tensors)]
