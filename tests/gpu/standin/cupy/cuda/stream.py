"""Streams and events of the stand-in: device work runs only when the host needs it done.

Each stream is a queue of work. Nothing runs when it is enqueued: a stream's work runs, in
order, when the host waits for it (``Stream.synchronize``, ``Event.synchronize``, a copy to
host memory), each item after the work it waits for on other streams (``wait_event``, and
the legacy stream's implicit order). Two schedules, both a GPU's: the late one (default)
runs waited-for work as late as it may, just before the item that waits; the early one
(HVD_STANDIN_SCHEDULE=early) runs it as early as it may, before any of the waiting stream's
pending work. A host read without the waits a device needs sees stale memory on both; work
read before the wait for its producer's stream sees it on the late one; work on a stream
that does not wait for its input's producer at all sees it on the early one (where the host
waits through another stream). The legacy null stream (``Stream.null``) is ordered with
every blocking stream of its device, both ways, as CUDA orders it;
``Stream(non_blocking=True)`` is not.
"""
import collections
import itertools
import os
import threading
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .device import CUDARuntimeError, current_id

__all__ = ["Event", "ExternalStream", "Stream", "current_ptr", "enqueue", "get_current_stream",
           "synchronize_device"]

_INVALID_HANDLE = 400
_lock = threading.Lock()
_handles = itertools.count(0x7f0000001000, 0x10)
_streams: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()
_local = threading.local()
Position = Tuple["_Queue", int]


class _Queue:
    """One stream's work on one GPU: what was enqueued, how much of it has run."""

    def __init__(self, device: int, blocking: bool):
        self.device, self.blocking = device, blocking
        self.work: "collections.deque[Tuple[Callable[[], None], List[Position]]]" = \
            collections.deque()
        self.queued = self.done = 0
        self.running = threading.RLock()

    def push(self, fn: Callable[[], None], after: Iterable[Position] = ()) -> None:
        after = list(after)
        with _lock:
            if self is _null(self.device):
                after += [(q, q.queued) for q in _blocking[self.device] if q.queued]
            elif self.blocking:
                after.append((_null(self.device), _null(self.device).queued))
            self.work.append((fn, after))
            self.queued += 1

    def run_until(self, position: int) -> None:
        """Run this stream's work up to ``position`` (a count of enqueued items), each item
        after what it waits for; on the early schedule, everything that work waits for on
        other streams first, before this stream's own earlier work."""
        if self.done >= position:
            return
        with self.running:
            if os.environ.get("HVD_STANDIN_SCHEDULE") == "early":
                waited = [dep for _, after in itertools.islice(self.work, 0,
                                                               position - self.done)
                          for dep in after]
                for queue, at in waited:
                    queue.run_until(at)
            while self.done < position:
                fn, after = self.work[0]
                for queue, at in after:
                    queue.run_until(at)
                try:
                    fn()
                finally:
                    self.work.popleft()
                    self.done += 1


_nulls: Dict[int, _Queue] = {}
_blocking: Dict[int, "weakref.WeakSet[_Queue]"] = collections.defaultdict(weakref.WeakSet)


def _null(device: int) -> _Queue:
    queue = _nulls.get(device)
    if queue is None:
        queue = _nulls[device] = _Queue(device, blocking=True)
    return queue


class Stream:
    """A CUDA stream on the GPU current when it is made (``null=True``: the legacy default
    stream of whichever GPU is current)."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        if ptds:
            raise NotImplementedError("the stand-in has no per-thread default stream")
        self.device_id = -1 if null else current_id()
        self._queue: Optional[_Queue] = None
        self.ptr = 0
        if not null:
            self._queue = _Queue(self.device_id, blocking=not non_blocking)
            with _lock:
                self.ptr = next(_handles)
                _streams[self.ptr] = self
                if not non_blocking:
                    _blocking[self.device_id].add(self._queue)

    def queue(self) -> _Queue:
        """This stream's work queue (the null stream's: the current GPU's)."""
        return _null(current_id()) if self._queue is None else self._queue

    def synchronize(self) -> None:
        """Wait for (here: run) everything enqueued on this stream."""
        queue = self.queue()
        queue.run_until(queue.queued)

    def record(self, event: Optional["Event"] = None) -> "Event":
        """Record ``event`` (a new one if None) at this stream's current end."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: "Event") -> None:
        """Work enqueued on this stream from now on runs after ``event``'s recorded work."""
        if event.position is not None:
            self.queue().push(_nothing, [event.position])

    @property
    def done(self) -> bool:
        queue = self.queue()
        return queue.done == queue.queued

    def use(self) -> "Stream":
        """Make this the current stream of its GPU on this thread."""
        stack = _stack(self._device())
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def __enter__(self) -> "Stream":
        _stack(self._device()).append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack(self._device()).pop()

    def _device(self) -> int:
        return current_id() if self._queue is None else self.device_id

    def __repr__(self) -> str:
        return f"<Stream {self.ptr:#x} (device {self.device_id})>"


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    """A stream made elsewhere, by its handle: here, one of the stand-in's own streams."""

    def __init__(self, ptr: int, device_id: int = -1):
        if ptr == 0:
            super().__init__(null=True)
            return
        known = _streams.get(ptr)
        if known is None:
            raise CUDARuntimeError(_INVALID_HANDLE, f"cudaErrorInvalidResourceHandle: "
                                   f"{ptr:#x} is no stream of the stand-in")
        self.device_id, self._queue, self.ptr = known.device_id, known._queue, ptr


class Event:
    """A mark in a stream's work; waiting for it runs that stream up to the mark."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self.position: Optional[Position] = None

    def record(self, stream: Optional[Stream] = None) -> None:
        queue = (get_current_stream() if stream is None else stream).queue()
        self.position = (queue, queue.queued)

    def synchronize(self) -> None:
        if self.position is not None:
            queue, at = self.position
            queue.run_until(at)

    @property
    def done(self) -> bool:
        return self.position is None or self.position[0].done >= self.position[1]


def _nothing() -> None:
    return None


def _stack(device: int) -> List[Stream]:
    stacks = _local.__dict__.setdefault("streams", {})
    return stacks.setdefault(device, [])


def get_current_stream(device_id: Optional[int] = None) -> Stream:
    """This thread's current stream on ``device_id`` (default: the current GPU)."""
    stack = _stack(current_id() if device_id is None else device_id)
    return stack[-1] if stack else Stream.null


def synchronize_device(device: int) -> None:
    """Wait for (here: run) everything enqueued on every stream of ``device``."""
    with _lock:
        queues = [s._queue for s in _streams.values() if s.device_id == device]
    for queue in queues + [_null(device)]:
        queue.run_until(queue.queued)


def current_ptr(device: int) -> int:
    """The handle of this thread's current stream on ``device``."""
    return get_current_stream(device).ptr


def enqueue(fn: Callable[[], None], stream: Optional[Stream] = None) -> None:
    """Queue device work ``fn`` on ``stream`` (default: the current one), which must belong
    to the current GPU, as a kernel launch requires."""
    stream = get_current_stream() if stream is None else stream
    if stream._queue is not None and stream.device_id != current_id():
        raise CUDARuntimeError(_INVALID_HANDLE, f"cudaErrorInvalidResourceHandle: the stream "
                               f"belongs to GPU {stream.device_id}, GPU {current_id()} is current")
    stream.queue().push(fn)
