"""Objects that live exactly as long as a host communicator: a process set's GPU communicator.

A process set's GPU communicator is made from its host communicator and used with it, so a
cache keyed weakly by the host communicator would keep its entries for ever if the value
held its key. :class:`Companions` hands the maker a weak proxy of the host communicator, and
when the host communicator goes (``remove_process_set``, ``shutdown``) the entry goes too
and the companion's ``free()`` runs. This module imports no CuPy, so it is tested anywhere.
"""
import threading
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class Companions(Generic[T]):
    """One companion per live host communicator, made on first use by ``make(proxy)``.

    The companion may keep the proxy it is given; it must not reach the host communicator
    otherwise, or the entry would keep its own key alive. It must have a ``free()`` method.
    """

    def __init__(self) -> None:
        self._held: "weakref.WeakKeyDictionary[Any, T]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, host: Any) -> Optional[T]:
        """The companion of ``host``, or None if none was made."""
        with self._lock:
            return self._held.get(host)

    def add(self, host: Any, make: Callable[[Any], T]) -> T:
        """Make ``host``'s companion from a weak proxy of ``host`` and keep it while ``host``
        lives; its ``free()`` runs when ``host`` is collected."""
        made = make(weakref.proxy(host))
        with self._lock:
            self._held[host] = made
        # Not at interpreter exit: the GPU runtime may already be gone by then.
        weakref.finalize(host, made.free).atexit = False  # type: ignore[attr-defined]
        return made

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
