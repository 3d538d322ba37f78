"""Tensor fusion: pack many small tensors into a few flat buckets, reduce each bucket once.

A bucket holds tensors of one dtype, in call order, up to the fusion threshold in bytes; a
tensor larger than the threshold gets a bucket of its own. Bucket storage persists in a
:class:`BufferPool` keyed by (dtype, bucket index), so a training loop that issues the same
grouped call every step allocates nothing after the first step.
"""
from typing import Any, Callable, Dict, Hashable, List, Sequence, Tuple

import numpy as np

from ..backends import split_evenly, widened


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence[Hashable], threshold: int, *,
                 fill: bool = False) -> List[List[int]]:
    """Group tensor indices into buckets: same dtype, call order, at most ``threshold`` bytes;
    with ``fill``, each bucket takes tensors until it holds at least ``threshold`` bytes
    (PyTorch DDP's rule), so that no small tensor is left in a bucket of its own between two
    large ones (a layer's bias then travels with its weight, in one collective)."""
    open_bucket: Dict[Hashable, Tuple[List[int], int]] = {}
    buckets: List[List[int]] = []
    for i, (n, dt) in enumerate(zip(nbytes, dtypes)):
        members, filled = open_bucket.get(dt, (None, 0))
        if members is None or (filled >= threshold if fill else filled + n > threshold):
            members, filled = [], 0
            buckets.append(members)
        members.append(i)
        open_bucket[dt] = (members, filled + n)
    return buckets


def split_runs(items: Sequence[Any], groups: int) -> List[Sequence[Any]]:
    """``items`` in ``groups`` consecutive non-empty runs of nearly equal length, the earlier
    ones longer by one (Horovod's ``num_groups``); one run for ``groups`` 0."""
    if not len(items):
        return []
    if groups <= 0:
        return [items]
    bounds = split_evenly(len(items), min(groups, len(items)))
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def plan_gradient_buckets(nbytes: Sequence[int], dtypes: Sequence[Hashable], threshold: int,
                          groups: int = 0) -> List[List[int]]:
    """Buckets for gradients in parameter order: the last parameters' first.

    Backward produces the last layers' gradients first, so the tensors are taken in reverse
    order, split by dtype and cut once a bucket holds ``threshold`` bytes (see
    :func:`plan_buckets` with ``fill``: a bucket may exceed it by its last tensor). With
    ``groups`` > 0 the reversed list is instead cut into that many runs of nearly equal
    tensor counts (Horovod's ``num_groups``), each split only by dtype. A ``dtypes`` entry
    may be any key that members of a bucket must share, e.g. (dtype, memory).
    """
    order = list(range(len(nbytes)))[::-1]
    runs = split_runs(order, groups)
    limit = sum(nbytes) + 1 if groups > 0 else threshold
    buckets = []
    for run in runs:
        plan = plan_buckets([nbytes[i] for i in run], [dtypes[i] for i in run], limit, fill=True)
        buckets.extend([run[k] for k in members] for members in plan)
    return buckets


class BufferPool:
    """Flat buffers that survive across calls; each grows to the largest size ever asked.

    ``empty`` allocates them: ``np.empty`` for host buffers, ``cupy.empty`` for device ones.
    """

    def __init__(self, empty: Callable[[int, np.dtype], Any] = np.empty):
        self._empty = empty
        self._buffers: Dict[Tuple[np.dtype, int], Any] = {}

    def get(self, dtype: np.dtype, slot: int, count: int) -> np.ndarray:
        """A flat view of ``count`` elements of the buffer for (``dtype``, ``slot``)."""
        held = self._buffers.get((dtype, slot))
        if held is None or held.size < count:
            held = self._empty(count, dtype)
            self._buffers[(dtype, slot)] = held
        return held[:count]


def _scale_into(src: np.ndarray, scale: float, dest: np.ndarray) -> None:
    # 16-bit floats scale in float32 so the factor itself is not rounded to 16 bits; float32
    # scales by the factor rounded to float32, as Horovod's CPU path does (its own tests expect
    # those bits).
    dtype = widened(src.dtype)
    np.multiply(src, scale, out=dest, casting="unsafe", dtype=dtype)


def pack(tensors: Sequence[np.ndarray], out: np.ndarray, scale: float = 1.0) -> None:
    """Copy ``tensors`` back to back into the flat ``out``, multiplied by ``scale``."""
    offset = 0
    for t in tensors:
        dest = out[offset:offset + t.size]
        if scale == 1.0:
            dest[...] = t.reshape(-1)
        else:
            _scale_into(t.reshape(-1), scale, dest)
        offset += t.size


def unpack(flat: np.ndarray, outputs: Sequence[np.ndarray], scale: float = 1.0) -> None:
    """Copy consecutive slices of ``flat`` into ``outputs`` (contiguous), multiplied by ``scale``."""
    offset = 0
    for o in outputs:
        src = flat[offset:offset + o.size]
        if scale == 1.0:
            o.reshape(-1)[...] = src
        else:
            _scale_into(src, scale, o.reshape(-1))
        offset += o.size


def fused(tensors: Sequence[Any], outputs: Sequence[Any], pool: Callable[[], BufferPool],
          threshold: int, reduce: Callable[..., None],
          prescale: float = 1.0, postscale: float = 1.0,
          pack: Callable[..., None] = pack, unpack: Callable[..., None] = unpack) -> None:
    """Run ``reduce(flat)`` (in place on a flat buffer) or ``reduce(flat, out)`` (from ``flat``
    into ``out``) over ``tensors``, bucket by bucket; ``pool()`` gives the buckets' buffers.

    Results land in ``outputs`` (C-contiguous, same shapes), which may be ``tensors`` themselves.
    ``pack`` and ``unpack`` are this module's for host arrays; GPU arrays bring their own.
    """
    if len(tensors) == 1:  # no plan, no pool: a gradient bucket's buffer, a single tensor
        _lone(tensors[0], outputs[0], reduce, prescale, postscale, pack, unpack)
        return
    plan = plan_buckets([t.nbytes for t in tensors], [t.dtype for t in tensors], threshold)
    buffers = pool()
    for slot, members in enumerate(plan):
        if len(members) == 1:
            _lone(tensors[members[0]], outputs[members[0]], reduce, prescale, postscale, pack,
                  unpack)
            continue
        ins = [tensors[i] for i in members]
        outs = [outputs[i] for i in members]
        buf = buffers.get(ins[0].dtype, slot, sum(t.size for t in ins))
        pack(ins, buf, prescale)
        reduce(buf)
        unpack(buf, outs, postscale)


def _lone(tensor: Any, output: Any, reduce: Callable[..., None], prescale: float,
          postscale: float, pack: Callable[..., None], unpack: Callable[..., None]) -> None:
    """Reduce one tensor in its output; no bucket copy needed (nor a view, for a flat one)."""
    flat = output if output.ndim == 1 else output.reshape(-1)
    if tensor is not output and prescale == 1.0:
        reduce(tensor.reshape(-1), flat)  # read from the input, written to the output
    else:
        if tensor is not output or prescale != 1.0:
            pack([tensor], flat, prescale)
        reduce(flat)
    if postscale != 1.0:
        unpack(flat, [output], postscale)
