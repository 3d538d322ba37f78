"""One step of a reducer, the one owner of what happens in it: which gradients are marked ready
(with the values handed over for those outside buckets), which buckets are complete, what the
ranks agreed to reduce, and the results (a handle and the reduced array per bucket, the reduced
value per gradient outside buckets).

Marks come from the threads that produce gradients (backward's hooks) while the step's
program (reducer.py) waits for them on another. A mark of a bucket's member only counts the
bucket down; the mark that completes a bucket, or marks a gradient outside buckets, takes the
reducer's lock and wakes the program: one lock and one wake-up per bucket, not per gradient.
A bucket's members are marked from one thread at a time (a bucket holds one memory's
gradients, and each memory's gradients come from one backward thread).
"""
import threading
from concurrent.futures import Future
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..collectives.sparse import Exchange
from ..collectives.traffic import CommStats
from ..coordination import handles
from .buckets import Bucket


class Step:
    """One step's marks, readiness, agreed freshness and results (see the module docstring).

    ``buckets`` and ``bucket_of`` are the reducer's layout at the step's start (the bucket
    number of the gradient at each position, -1 outside buckets); ``lock`` is the reducer's.
    """

    def __init__(self, buckets: Sequence[Bucket], bucket_of: Sequence[int],
                 lock: threading.Lock):
        count = len(bucket_of)
        self.buckets = list(buckets)
        self._bucket_of = bucket_of
        self._marks = bytearray(count)
        self._left = [len(b.keys) for b in buckets]   # members not marked, counted lock-free
        self._complete = [False] * len(buckets)       # published under the lock
        self._outside = sum(1 for number in bucket_of if number < 0)  # not marked yet
        self._closed = False
        self._changed = threading.Condition(lock)
        self._fresh = np.zeros(count, bool)
        self._values: Dict[int, Any] = {}
        self._results: Dict[int, Any] = {}
        self._arrays: Dict[int, Any] = {}
        self._done: List["Future[Bucket]"] = [Future() for _ in buckets]
        self.handles = [handles.Handle(f) for f in self._done]
        self.stats = CommStats()  # the traffic and codec time of the step's collectives
        self.exchanges: Dict[int, Exchange] = {}  # how each row-sparse gradient travelled
        self.number = -1          # the reducer's count of its steps, from 0, set at launch
        self.program: Optional["Future[None]"] = None  # the reductions, once queued
        self.overlapped = False   # the program runs on the communication thread

    # -- marks (the producing threads) -------------------------------------------------------
    def marked(self, position: int) -> bool:
        """Whether the gradient at ``position`` has been marked ready in this step."""
        return bool(self._marks[position])

    @property
    def ready(self) -> np.ndarray:
        """Per position, whether the gradient was marked ready on this rank (a read-only
        view)."""
        view = np.frombuffer(self._marks, bool)
        view.flags.writeable = False
        return view

    def mark(self, position: int, value: Any = None) -> bool:
        """Mark the gradient at ``position`` ready, holding ``value`` when it is outside the
        buckets; True when the mark completed a bucket or the last gradient outside them (the
        program was woken)."""
        self._marks[position] = 1
        number = self._bucket_of[position]
        if number < 0:
            with self._changed:
                if value is not None:
                    self._values[position] = value
                self._outside -= 1
                if self._outside == 0:
                    self._changed.notify_all()
                    return True
                return False
        self._left[number] -= 1
        if self._left[number]:
            return False
        with self._changed:
            self._complete[number] = True
            self._changed.notify_all()
        return True

    def mark_all(self, ready: Iterable[Tuple[int, Any]]) -> None:
        """:meth:`mark` for each (position, value) pair, under the lock once (step time)."""
        with self._changed:
            for position, value in ready:
                self._marks[position] = 1
                number = self._bucket_of[position]
                if number < 0:
                    if value is not None:
                        self._values[position] = value
                    self._outside -= 1
                else:
                    self._left[number] -= 1
                    self._complete[number] = self._left[number] == 0
            self._changed.notify_all()

    def pending(self) -> bool:
        """Whether gradients are still to be marked."""
        return self._outside > 0 or not all(self._complete)

    def close(self) -> None:
        """No more gradients become ready in this step: what is not marked is stale here."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    # -- the program (the thread that reduces) ----------------------------------------------
    def wait_for_bucket(self, number: int) -> None:
        """Wait until bucket ``number`` is complete or the step closed."""
        with self._changed:
            while not self._closed and not self._complete[number]:
                self._changed.wait()

    def wait_for_all(self) -> None:
        """Wait until every gradient is marked or the step closed."""
        with self._changed:
            while not self._closed and self.pending():
                self._changed.wait()

    def agree(self, fresh: Any) -> None:
        """The ranks' agreed freshness per position (True: reduce it everywhere)."""
        self._fresh[:] = fresh

    def value(self, position: int) -> Any:
        """The value marked for the gradient at ``position`` outside buckets (None: none)."""
        return self._values.get(position)

    def reduced(self, number: int, array: Any) -> None:
        """Bucket ``number`` is reduced, in ``array``: its handle completes."""
        self._arrays[number] = array
        self._done[number].set_result(self.buckets[number])

    def failed(self, error: BaseException) -> None:
        """A reduction raised ``error``: every bucket handle not done yet raises it."""
        for done in self._done:
            if not done.done():
                done.set_exception(error)

    def result(self, key: int, value: Any) -> None:
        """The reduced value of gradient ``key`` (outside buckets)."""
        self._results[key] = value

    # -- what the adapter reads -------------------------------------------------------------
    def complete(self, number: int) -> bool:
        """Whether every member of bucket ``number`` was marked ready on this rank."""
        return self._complete[number]

    def fresh(self, position: int) -> bool:
        """Whether the gradient at ``position`` was reduced in this step."""
        return bool(self._fresh[position])

    @property
    def every_fresh(self) -> bool:
        """Whether every gradient was reduced in this step."""
        return bool(self._fresh.all())

    def array(self, number: int) -> Any:
        """The NumPy (or CuPy) array bucket ``number`` was reduced in, once it is."""
        return self._arrays[number]

    @property
    def results(self) -> Dict[int, Any]:
        """The reduced gradients outside buckets, by key (an array, or (ids, rows))."""
        return self._results

    def launched(self) -> List[Tuple[Bucket, handles.Handle]]:
        """Every bucket with its handle, in launch order (the same on every rank)."""
        return list(zip(self.buckets, self.handles))
