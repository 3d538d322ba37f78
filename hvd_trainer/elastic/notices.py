"""hvdrun's notices: whether the hosts changed since this life of the job started.

Rank 0 asks hvdrun over TCP, proving that it holds the job's secret
(:func:`hvd_trainer_launch.protocol.ask_notice`); hvdrun answers with its current generation
number, signed. A number above the one this life started with means other hosts, and the
next ``commit()`` raises HostsUpdatedInterrupt on every rank (state.py).
"""
import concurrent.futures
import logging
import socket
import time
from typing import Optional

from hvd_trainer_launch import protocol
from hvd_trainer_launch.protocol import SECRET_VARIABLE

from .store import CommitStore


log = logging.getLogger("hvd_trainer")
# Seconds rank 0's whole question to hvdrun may take (connection, exchange).
NOTICE_TIMEOUT = 10.0
class HostNotices:
    """Asks hvdrun (on rank 0) whether the hosts changed since this life started.

    hvdrun answers a TCP connection with its current generation number, once the rank has
    proved that it holds the job's secret, and signs the answer with it
    (:func:`hvd_trainer_launch.protocol.ask_notice`); a number above the one this life started
    with means other hosts. No shared file system is needed, only a route from rank 0's host
    to the host that runs hvdrun.
    """

    def __init__(self, address: Optional[str], generation: int, store: "CommitStore"):
        self.address, self.generation, self.store = address, generation, store
        self.secret = protocol.job_secret()
        self.warned = False
        self._asker: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def ask(self) -> concurrent.futures.Future:
        """Start :meth:`changed` on a thread of its own (its answer: the future's result), so
        that the round trip to hvdrun overlaps the caller's work."""
        if self._asker is None:
            self._asker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="hvd_trainer-hosts")
        return self._asker.submit(self.changed)

    def changed(self) -> Optional[protocol.Notice]:
        """hvdrun's notice when it tells of other hosts than those of this life's generation
        (or of the last change in place), else None."""
        if not self.address:
            return None
        host, _, port = self.address.rpartition(":")
        try:
            if self.secret is None:
                raise ValueError(f"{SECRET_VARIABLE} is not set")
            deadline = time.monotonic() + NOTICE_TIMEOUT
            with socket.create_connection((host, int(port)), timeout=NOTICE_TIMEOUT) as conn:
                told = protocol.ask_notice(conn, self.secret, self.store.written, deadline)
                return told if told.number > self.generation else None
        except (OSError, ValueError) as error:
            if not self.warned:
                log.warning("cannot ask hvdrun at %s whether the hosts changed (%s); this "
                            "job will not grow or shrink until it can", self.address, error)
                self.warned = True
            return None
