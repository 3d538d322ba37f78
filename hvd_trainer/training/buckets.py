"""What a reducer lays out: each :class:`Gradient` as the ranks agree on it, and the flat
:class:`Bucket` runs that dense gradients are reduced in (:func:`lay_out`). See reducer.py for
how they are used and step.py for one step's state.
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..collectives import fusion


@dataclass(frozen=True)
class Gradient:
    """One gradient as the ranks must agree on it.

    ``key`` identifies it among the adapter's gradients (its name is ``prefix + grad.key``,
    and its residual is kept under ``key``); ``sparse`` marks a row-sparse gradient, whose
    value is a pair (ids, rows); ``memory`` is "host" or "gpu" (they travel different ways).
    """

    key: int
    shape: Tuple[int, ...]
    dtype: str
    sparse: bool = False
    memory: str = "host"

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def bucketed(self) -> bool:
        """Whether it travels in a bucket: dense, at least one dimension and one element.
        (A row-sparse gradient travels by rows; a 0-d one, which some frameworks cannot view
        in a flat run, and an empty one travel by themselves.)"""
        return not self.sparse and len(self.shape) > 0 and self.size > 0


class Bucket:
    """A flat run of gradients of one dtype and memory, reduced together.

    ``keys`` are its gradients in bucket order; gradient k is ``flat[bounds[k]:bounds[k+1]]``.
    The adapter sets ``open``: a callable returning the NumPy (or CuPy) view of the bucket's
    storage once every write into it has finished. ``active`` makes the context that the
    bucket is opened and reduced in (a GPU bucket's stream, ordered after the writes; none by
    default).
    """

    def __init__(self, number: int, keys: List[int], bounds: List[int], dtype: np.dtype,
                 memory: str = "host"):
        self.number = number
        self.keys = keys
        self.bounds = bounds
        self.dtype = dtype
        self.memory = memory
        self.open: Optional[Callable[[], Any]] = None
        self.active: Callable[[], ContextManager[Any]] = contextlib.nullcontext


class Layout(NamedTuple):
    """Buckets laid out for a list of gradients: the buckets, and the bucket number of the
    gradient at each position of the list (-1: outside every bucket)."""

    buckets: List[Bucket]
    bucket_of: List[int]


def lay_out(gradients: Sequence[Gradient], threshold: int, num_groups: int) -> Layout:
    """Buckets for ``gradients`` (see :attr:`Gradient.bucketed`): in reverse order (backward
    produces the last layers' gradients first), one dtype and one memory per bucket, at most
    ``threshold`` bytes each, or ``num_groups`` buckets when it is positive."""
    position = {g.key: k for k, g in enumerate(gradients)}
    bucketed = [g for g in gradients if g.bucketed]
    plan = fusion.plan_gradient_buckets(
        [g.size * np.dtype(g.dtype).itemsize for g in bucketed],
        [(np.dtype(g.dtype), g.memory) for g in bucketed], threshold, num_groups)
    buckets: List[Bucket] = []
    bucket_of = [-1] * len(gradients)
    for number, members in enumerate(plan):
        bounds = [0]
        for k in members:
            bucket_of[position[bucketed[k].key]] = number
            bounds.append(bounds[-1] + bucketed[k].size)
        first = bucketed[members[0]]
        buckets.append(Bucket(number, [bucketed[k].key for k in members], bounds,
                              np.dtype(first.dtype), first.memory))
    return Layout(buckets, bucket_of)


def check_settings(gradient_predivide_factor: float, num_groups: int) -> None:
    """Refuse a non-positive ``gradient_predivide_factor`` or a bad ``num_groups``."""
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must "
                         "be positive")
    if int(num_groups) != num_groups or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r} must be a non-negative integer")
