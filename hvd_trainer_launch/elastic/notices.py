"""hvdrun's notice port in elastic mode: rank 0 asks it whether the hosts changed, and tells
it the newest commit rank 0 has written (protocol.notice_reply: both ends prove that
they hold the job's secret); :class:`Generation` keeps the port, the generation number and
the newest commit across the job's lives.

One thread serves every connection at once through a selector, so that a peer that sends
its bytes slowly, or none, holds up nobody else: each exchange has EXCHANGE_SECONDS in all,
whatever its peer trickles, and at most MAX_OPEN are open at a time (a new one beyond that
closes the oldest, which a proper exchange, done in a round trip, never is for long). The
listening backlog is the system's largest.
"""
import selectors
import socket
import threading
import time
from typing import Callable, Dict, NamedTuple, Optional, Sequence

from hvd_trainer_launch import protocol
from hvd_trainer_launch.elastic.discovery import Hosts
from hvd_trainer_launch.job.reports import interface_address

EXCHANGE_SECONDS = 5.0  # a whole exchange, from accept to reply
MAX_OPEN = 128  # connections served at once; a new one beyond closes the oldest


class _Exchange(NamedTuple):
    challenge: bytes
    received: bytearray
    deadline: float


class NoticeServer:
    """Serves the notice exchange on ``address`` (a new port) from a thread of its own until
    :meth:`close`: the reply tells ``told()``; ``heard(written)`` is called with the commit
    number each proved question reports."""

    def __init__(self, address: str, secret: bytes, told: Callable[[], protocol.Notice],
                 heard: Callable[[int], None]):
        self.secret, self.told, self.heard = secret, told, heard
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((address, 0))
        self.listener.listen(socket.SOMAXCONN)
        self.listener.setblocking(False)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._open: Dict[socket.socket, _Exchange] = {}  # oldest first
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="hvdrun-notices")
        self._thread.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def close(self) -> None:
        """Stop serving: the thread ends, every connection and the port close."""
        self._closed.set()
        self._wake_write.send(b"x")
        self._thread.join()
        self._wake_write.close()

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                for conn in [c for c, e in self._open.items() if e.deadline <= now]:
                    self._drop(conn)
                wait = min((e.deadline for e in self._open.values()), default=now + 60) - now
                for key, _ in self._selector.select(max(wait, 0.0)):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is not self._wake_read:
                        self._receive(key.fileobj)
        finally:
            for conn in list(self._open):
                self._drop(conn)
            self._selector.close()
            self.listener.close()
            self._wake_read.close()

    def _accept(self) -> None:
        """Take every connection waiting, each sent its challenge at once."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, or the peer gave up: the next one
                return
            if len(self._open) >= MAX_OPEN:
                self._drop(next(iter(self._open)))
            conn.setblocking(False)
            challenge = protocol.notice_challenge()
            try:
                if conn.send(challenge) != len(challenge):  # a fresh socket takes 16 bytes
                    raise ConnectionError("the challenge did not fit")
            except OSError:
                conn.close()
                continue
            self._open[conn] = _Exchange(challenge, bytearray(),
                                         time.monotonic() + EXCHANGE_SECONDS)
            self._selector.register(conn, selectors.EVENT_READ)

    def _receive(self, conn: socket.socket) -> None:
        """Read what ``conn`` sent; once its question is whole, reply if it proves the secret
        (telling the generation and hearing its commit), and close it either way."""
        exchange = self._open[conn]
        wanted = protocol.NOTICE_QUESTION_BYTES - len(exchange.received)
        try:
            data = conn.recv(wanted)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        exchange.received.extend(data)
        if len(exchange.received) < protocol.NOTICE_QUESTION_BYTES:
            return
        told = self.told()
        reply = protocol.notice_reply(self.secret, exchange.challenge,
                                      bytes(exchange.received), told.number, told.offer)
        if reply is not None:
            try:
                # At most NOTICE_OFFER_BYTES and 44 more, into an empty send buffer.
                conn.send(reply.data)
            except OSError:
                pass
            self.heard(reply.written)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._open.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


_LOCAL_NAMES = ("localhost", "127.0.0.1")


class Generation:
    """The notice port (:class:`NoticeServer`) across the job's lives: tells the hosts'
    generation number, which goes up when discovery reports a change (rank 0 asks at each
    commit), with hvdrun's offer to change the job in place when it makes one (``offer``,
    offers.py's JSON), and hears the newest commit rank 0 has written (``committed``, for the
    next life). It listens on the loopback while every rank runs here, else on the first
    --network-interface (on every interface without one)."""

    def __init__(self, secret: bytes, nics: Sequence[str] = ()):
        self.secret, self.nics = secret, list(nics)
        self.number = 0
        self.offer = b""
        self.committed = 0
        self.server: Optional[NoticeServer] = None
        self.bound: Optional[str] = None
        self._listen("127.0.0.1")

    @property
    def port(self) -> int:
        return self.server.port

    def _listen(self, address: str) -> None:
        """Serve on ``address`` (a new port) from now on; the old server closes."""
        server = NoticeServer(address, self.secret, self._told, self._heard)
        if self.server is not None:
            self.server.close()
        self.server, self.bound = server, address

    def changed(self, offer: bytes = b"") -> None:
        """The hosts changed: the next generation, with the offer to change the job in place
        (``offer``, offers.py's JSON) or none (the ranks leave for a restart)."""
        self.offer = offer
        self.number += 1

    def _told(self) -> protocol.Notice:
        return protocol.Notice(self.number, self.offer)

    def _heard(self, written: int) -> None:
        self.committed = max(self.committed, written)

    def address(self, layout: Hosts) -> str:
        """host:port for the ranks of ``layout``, listening where they can reach it and no
        wider: the loopback when they all run here."""
        local = set(_LOCAL_NAMES) | {socket.gethostname(), socket.getfqdn()}
        if all(host in local for host, _ in layout):
            bind = host = "127.0.0.1"
        elif self.nics:
            bind = host = interface_address(self.nics[0])
        else:
            bind, host = "", socket.getfqdn()
        if bind != self.bound:
            self._listen(bind)
        return f"{host}:{self.port}"

    def close(self) -> None:
        self.server.close()
