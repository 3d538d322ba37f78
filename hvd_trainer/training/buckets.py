"""The records a reducer works with: each :class:`Gradient` as the ranks agree on it, the
flat :class:`Bucket` runs that dense gradients are reduced in, and one step's readiness,
launched buckets and results (:class:`ReducerStep`). See reducer.py for how they are used.
"""
import contextlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Type, Union

import numpy as np

from ..coordination import handles
from ..collectives.powersgd import PowerSGD
from ..compression import Compressor, GatherCompressor


AnyCompressor = Union[Type[Compressor], GatherCompressor, PowerSGD]


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


class Bucket:
    """A flat run of gradients of one dtype, reduced together.

    ``keys`` are its gradients in bucket order; gradient k is ``flat[bounds[k]:bounds[k+1]]``.
    The adapter sets ``open``: a callable returning the NumPy (or CuPy) view of the bucket's
    storage once every write into it has finished; ``host`` is that view, taken when it is
    launched. ``active`` makes the context that the bucket is opened and reduced in (a GPU
    bucket's stream, ordered after the writes; none by default).
    """

    def __init__(self, number: int, keys: List[int], bounds: List[int], dtype: np.dtype,
                 memory: str = "host"):
        self.number = number
        self.keys = keys
        self.bounds = bounds
        self.dtype = dtype
        self.memory = memory
        self.open: Optional[Callable[[], np.ndarray]] = None
        self.active: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        self.host: Optional[np.ndarray] = None


def check_settings(gradient_predivide_factor: float, num_groups: int) -> None:
    """Refuse a non-positive ``gradient_predivide_factor`` or a bad ``num_groups``."""
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must "
                         "be positive")
    if int(num_groups) != num_groups or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r} must be a non-negative integer")


def compression_key(compression: AnyCompressor) -> str:
    """The compressor and its settings as text that is the same on every rank."""
    if isinstance(compression, type):
        return compression.__name__
    settings = sorted((key, str(value)) for key, value in vars(compression).items())
    return f"{type(compression).__name__}{settings}"


class ReducerStep:
    """One step of a :class:`Reducer`: readiness, the launched buckets, the results."""

    def __init__(self, count: int, buckets: List[Bucket], bucket_of: Sequence[int],
                 lock: threading.Lock):
        self._marks = bytearray(count)           # cheap to set one by one; ready views it
        # What the program waits for: each bucket complete, then every gradient. A mark
        # wakes it only when it completes one of those, not once per gradient.
        self._bucket_of = bucket_of              # position -> bucket number, or -1
        self._unmarked_in = [len(b.keys) for b in buckets]
        self._unmarked = count
        self.ready = np.frombuffer(self._marks, bool)  # ready on this rank, by position
        self.fresh = np.zeros(count, bool)       # reduced this step (agreed), by position
        self.values: Dict[int, Any] = {}         # per-tensor gradients given, by position
        self.results: Dict[int, Any] = {}        # reduced per-tensor gradients, by key
        self.order: List[int] = []               # keys in the order they became ready
        self.closed = False                      # no more gradients become ready
        self.whole: Dict[int, bool] = {}         # bucket number -> reduced in one piece
        self.number = -1                         # the reducer's count of steps, from 0
        self._done: List["Future[Bucket]"] = [Future() for _ in buckets]
        self.handles = [handles.Handle(f) for f in self._done]
        self.buckets = buckets
        self.program: Optional["Future[None]"] = None
        self.overlapped = False                  # the program runs on the communication thread
        self.changed = threading.Condition(lock)  # the reducer's lock

    def launched(self) -> List[Tuple[Bucket, handles.Handle]]:
        """Every bucket with its handle, in launch order (the same on every rank)."""
        return list(zip(self.buckets, self.handles))
