"""A small collective's data read from the carrier (see coordination/records.py): the
gathered payloads reduced in rank order, identically on every rank, or concatenated."""
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..coordination import agreement, records
from . import fusion, plans
from ..backends import REDUCE_UFUNCS, widened
from .memory import HOST
from .arguments import BACKEND_OP, ReduceOp, prescaled

__all__ = ["carried_reduction", "concatenated"]


def carried_reduction(call: agreement.Call, describe: Callable[[], Dict[str, Any]],
                      tensors: Sequence[np.ndarray], plan: plans.Reduction, op: ReduceOp,
                      inplace: bool) -> Optional[List[np.ndarray]]:
    """Reduce ``tensors`` with their data in the carrier: every rank reduces the gathered
    payloads in rank order, so every rank gets the same bits; 16-bit floats are added in
    float32 and rounded after each addition, as the ring does (the ``wide`` ones, prescaled
    in their own precision first, are rounded once, as in the data phase). None if the
    payloads did not travel."""
    wire, pre = plan.wire, plan.pre
    if plan.lone:
        payload = tensors[0].ravel().view(np.uint8)  # a copy only if strided
    else:
        sources = tensors
        if pre != 1.0 and any(plan.wide):  # as the data phase prescales them (see prescaled)
            sources, pre = [prescaled(HOST, t, pre) for t in tensors], 1.0
        flat = np.empty(sum(t.size for t in sources), wire)
        fusion.pack(sources, flat, pre)
        payload = flat.view(np.uint8)
    carried = call.exchange(describe, payload, plan.signature)
    if carried is None or not carried.every():
        return None
    outputs = tensors if inplace else [np.empty(t.shape, t.dtype) for t in tensors]
    flat = outputs[0].reshape(-1) if plan.lone else np.empty(payload.size // wire.itemsize, wire)
    parts = carried.rows[:, :payload.size].view(wire)
    reduce, widen = _REDUCE[op], widened(wire)
    reduce(parts[0], parts[1], out=flat, dtype=widen)  # in rank order, as the ring adds
    for rank in range(2, len(parts)):
        reduce(flat, parts[rank], out=flat, dtype=widen)
    if not plan.lone or plan.post != 1.0:
        fusion.unpack(flat, outputs, plan.post)
    return outputs


_REDUCE = {op: REDUCE_UFUNCS[name] for op, name in BACKEND_OP.items()}


def concatenated(carried: records.Carried, tensor: np.ndarray, row: int) -> np.ndarray:
    """The ranks' carried rows of ``tensor``'s shape and dtype (``row`` elements each, which
    the ranks agreed on), concatenated."""
    out = np.empty((sum(carried.lengths) // (row * tensor.itemsize),) + tensor.shape[1:],
                   tensor.dtype)
    flat, offset = out.reshape(-1).view(np.uint8), 0
    for rank, length in enumerate(carried.lengths):
        flat[offset:offset + length] = carried.rows[rank, :length]
        offset += length
    return out
