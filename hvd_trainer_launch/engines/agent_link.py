"""A long-lived, signed link between an elastic engine job's driver and each of its agents
(hvd_trainer.spark.run_elastic's Spark tasks): the agent dials the driver once, says where it
runs, and then takes one proxy command per life of the job, sending each life's outcome back,
until the driver ends it. The link's drop is how the driver learns at once that the agent is
gone (its executor lost, its task killed): Spark itself says so only later.

Spark gives a running task no way to hear from the driver, so the task dials it and the
connection stays open for the job; each side proves the job's secret over the other's fresh
challenge before anything else, and every message after that is signed with the secret over
both challenges and its place in its direction (HMAC-SHA256, protocol.mac): nobody without
the secret can register, hand an agent a command, forge an outcome, or replay or reorder one.
A message is a JSON header and byte blobs (the ranks' pickled outcomes, which the driver
unpickles only once the signature checks out). Standard library only: a task imports nothing
more before it registers.
"""
import hmac
import json
import os
import socket
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines.calls import HostOutcome

_NONCE_BYTES = 16
_MAC_BYTES = 32
_MOST_HEADER = 1 << 20  # a header: a proxy command, some resources and messages
_MOST_BLOB = 1 << 31  # a rank's pickled outcome: its function's return value
# A link that carries nothing is probed after this many idle seconds, every interval after,
# and dropped after so many probes unanswered: a host that vanished from the network (no
# connection closed) is seen in under a minute, not TCP's two hours.
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 6}
# Connections that have not proved themselves yet, held at once: a stranger cannot crowd out
# the agents.
_MOST_UNPROVEN = 16


class Hello(NamedTuple):
    """What an agent says of itself when it dials: its ``slot`` (the engine's number for the
    place it fills), a ``token`` unique to this start of it, its ``host``, the ``executor``
    it runs in there (the engine's process that fails as one: agents in one are lost
    together) and the addresses of each resource its engine assigned it (``{"gpu": ["0"]}``)."""

    slot: int
    token: str
    host: str
    executor: str
    resources: Dict[str, List[str]]


class Message(NamedTuple):
    """One message on a link: its ``kind`` ("run", "outcome", "end"), its JSON ``fields``
    and its byte ``blobs``."""

    kind: str
    fields: dict
    blobs: Tuple[bytes, ...] = ()


class LinkEnd:
    """One end of a proven link: sends and receives signed messages in order."""

    def __init__(self, conn: socket.socket, secret: bytes, bound: bytes, sends: bytes,
                 receives: bytes):
        self.conn, self._secret, self._bound = conn, secret, bound
        self._labels = {"send": sends, "receive": receives}
        self._counts = {"send": 0, "receive": 0}
        self._sending = threading.Lock()

    def _mac(self, direction: str, header: bytes, blobs: Sequence[bytes]) -> bytes:
        count = self._counts[direction].to_bytes(8, "big")
        return protocol.mac(self._secret, self._labels[direction], self._bound, count, header,
                            *blobs)

    def send(self, message: Message) -> None:
        """Send ``message`` signed; OSError when the peer is gone."""
        header = json.dumps({"kind": message.kind, "fields": message.fields,
                             "blobs": len(message.blobs)}).encode()
        with self._sending:
            signature = self._mac("send", header, message.blobs)
            self._counts["send"] += 1
            parts = [len(header).to_bytes(4, "big"), header]
            for blob in message.blobs:
                parts += [len(blob).to_bytes(8, "big"), blob]
            self.conn.sendall(b"".join(parts) + signature)

    def receive(self, deadline: Optional[float] = None) -> Message:
        """The next message once its signature checks out; ConnectionError when the peer
        closed, ValueError for a message not signed with the job's secret."""
        size = int.from_bytes(protocol.receive(self.conn, 4, deadline), "big")
        if size > _MOST_HEADER:
            raise ValueError(f"a header of {size} bytes (at most {_MOST_HEADER})")
        header = protocol.receive(self.conn, size, deadline)
        fields = json.loads(header)
        count = fields["blobs"]
        if type(count) is not int or count < 0:
            raise ValueError("not a message of this job")
        blobs = []
        for _ in range(count):
            length = int.from_bytes(protocol.receive(self.conn, 8, deadline), "big")
            if length > _MOST_BLOB:
                raise ValueError(f"a blob of {length} bytes (at most {_MOST_BLOB})")
            blobs.append(protocol.receive(self.conn, length, deadline))
        expected = self._mac("receive", header, blobs)
        if not hmac.compare_digest(protocol.receive(self.conn, _MAC_BYTES, deadline), expected):
            raise ValueError("a message not signed with this job's secret")
        self._counts["receive"] += 1
        if not isinstance(fields.get("kind"), str) or not isinstance(fields.get("fields"), dict):
            raise ValueError("not a message of this job")
        return Message(fields["kind"], fields["fields"], tuple(blobs))


def _keep_alive(conn: socket.socket) -> None:
    """Probe ``conn`` when it is idle (_KEEPALIVE), where the system lets us."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _hello(fields: dict) -> Hello:
    """The Hello in ``fields``; ValueError unless its types are right."""
    found = Hello(fields["slot"], fields["token"], fields["host"], fields["executor"],
                  fields["resources"])
    if type(found.slot) is not int or found.slot < 0 or not isinstance(found.token, str) \
            or not isinstance(found.host, str) or not found.host \
            or not isinstance(found.executor, str) \
            or not isinstance(found.resources, dict) \
            or not all(isinstance(name, str) and isinstance(addresses, list)
                       and all(isinstance(a, str) for a in addresses)
                       for name, addresses in found.resources.items()):
        raise ValueError("not an agent of this job")
    return found


def outcome_message(life: int, outcome: HostOutcome) -> Message:
    """The message that carries a life's ``outcome`` of an agent's host to the driver."""
    ranks = sorted(outcome.outcomes)
    return Message("outcome", {"life": life, "host": outcome.host, "code": outcome.code,
                               "ranks": ranks, "messages": outcome.messages},
                   tuple(outcome.outcomes[rank] for rank in ranks))


def outcome_of(message: Message) -> HostOutcome:
    """The HostOutcome that :func:`outcome_message` sent; ValueError for anything else."""
    fields = message.fields
    ranks = fields.get("ranks")
    if message.kind != "outcome" or not isinstance(ranks, list) \
            or not all(type(rank) is int for rank in ranks) \
            or len(ranks) != len(message.blobs) or type(fields.get("code")) is not int:
        raise ValueError("not an outcome of this job")
    return HostOutcome(str(fields["host"]), fields["code"], dict(zip(ranks, message.blobs)),
                       str(fields.get("messages", "")))


class Link(NamedTuple):
    """A registered agent as the driver sees it."""

    hello: Hello
    side: LinkEnd


class Links:
    """The driver's side: listens on ``host`` (``bind``: the address to bind, default
    ``host``) for agents that prove ``secret``; keeps each one's link until it drops.
    ``changed`` is called (from a reader thread) whenever an agent joins or leaves, and
    ``received`` with each agent's messages (its token and the message)."""

    def __init__(self, host: str, secret: bytes, changed: Callable[[], None],
                 received: Callable[[str, Message], None], bind: Optional[str] = None):
        self._secret, self._changed, self._received = secret, changed, received
        self._lock = threading.Lock()
        self._links: Dict[str, Link] = {}
        self._lost: Dict[str, Hello] = {}
        self._closed = False
        self._unproven = threading.BoundedSemaphore(_MOST_UNPROVEN)
        family, *_ = socket.getaddrinfo(bind or host, None, type=socket.SOCK_STREAM)[0]
        self._listener = socket.create_server((bind or host, 0), family=family)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="hvd-agent-links").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the job is over
                return
            if not self._unproven.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _prove(self, conn: socket.socket) -> Link:
        """The agent on ``conn`` once it has proved the secret, and the driver has too."""
        deadline = time.monotonic() + protocol.REPORT_SECONDS
        conn.settimeout(protocol.REPORT_SECONDS)
        mine = os.urandom(_NONCE_BYTES)
        conn.sendall(mine)
        theirs = protocol.receive(conn, _NONCE_BYTES, deadline)
        size = int.from_bytes(protocol.receive(conn, 4, deadline), "big")
        if size > _MOST_HEADER:
            raise ValueError("a hello too long")
        payload = protocol.receive(conn, size, deadline)
        if not hmac.compare_digest(protocol.receive(conn, _MAC_BYTES, deadline),
                                   protocol.mac(self._secret, b"hello", mine, theirs, payload)):
            raise ValueError("not signed with this job's secret")
        hello = _hello(json.loads(payload))
        conn.sendall(protocol.mac(self._secret, b"welcome", theirs, mine, payload))
        conn.settimeout(None)
        _keep_alive(conn)
        bound = mine + theirs
        return Link(hello, LinkEnd(conn, self._secret, bound, b"to agent", b"to driver"))

    def _serve(self, conn: socket.socket) -> None:
        """One agent's connection: prove it, keep it, pass on its messages until it drops."""
        try:
            link = self._prove(conn)
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        finally:
            self._unproven.release()
        token = link.hello.token
        with self._lock:
            if self._closed or token in self._links or token in self._lost:
                conn.close()
                return
            # A slot holds one agent: a new start of it (the engine retried its task) ends
            # the link of the old one, whose end may not have reached us.
            older = [old for old in self._links.values() if old.hello.slot == link.hello.slot]
            self._links[token] = link
        for old in older:
            _shut(old.side.conn)
        self._changed()
        try:
            while True:
                self._received(token, link.side.receive())
        except (OSError, ValueError, KeyError, TypeError):
            pass  # gone, or not this job's: the agent is lost either way
        finally:
            conn.close()
            with self._lock:
                self._lost[token] = self._links.pop(token).hello
            if not self._closed:
                self._changed()

    def agents(self) -> List[Hello]:
        """The agents whose links are up, by slot."""
        with self._lock:
            return sorted((link.hello for link in self._links.values()),
                          key=lambda hello: (hello.slot, hello.token))

    def lost(self) -> List[Hello]:
        """The agents whose links dropped, in the order they did."""
        with self._lock:
            return list(self._lost.values())

    def send(self, token: str, message: Message) -> bool:
        """Send ``message`` to the agent ``token``; False when it is not linked (any more)."""
        with self._lock:
            link = self._links.get(token)
        if link is None:
            return False
        try:
            link.side.send(message)
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Stop listening and tell every linked agent to end; their links close."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        self._listener.close()
        for link in links:
            try:
                link.side.send(Message("end", {}))
            except OSError:
                pass
            _shut(link.side.conn)

    def drop(self, slot: int) -> None:
        """End the link of the agent in ``slot`` (its engine says it is lost)."""
        with self._lock:
            links = [link for link in self._links.values() if link.hello.slot == slot]
        for link in links:
            _shut(link.side.conn)


def _shut(conn: socket.socket) -> None:
    """Shut ``conn`` both ways: its reader sees the end and lets the link go."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def dial(address: str, secret: bytes, hello: Hello) -> LinkEnd:
    """An agent's side: link up with the driver at ``address`` as ``hello``; OSError when it
    cannot be reached or does not answer in time, ValueError when its answer is not signed
    with ``secret``."""
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=protocol.REPORT_SECONDS)
    try:
        deadline = time.monotonic() + protocol.REPORT_SECONDS
        theirs = protocol.receive(conn, _NONCE_BYTES, deadline)
        mine = os.urandom(_NONCE_BYTES)
        payload = json.dumps(hello._asdict()).encode()
        conn.sendall(mine + len(payload).to_bytes(4, "big") + payload
                     + protocol.mac(secret, b"hello", theirs, mine, payload))
        if not hmac.compare_digest(protocol.receive(conn, _MAC_BYTES, deadline),
                                   protocol.mac(secret, b"welcome", mine, theirs, payload)):
            raise ValueError("the driver's answer is not signed with this job's secret")
        conn.settimeout(None)
        _keep_alive(conn)
    except BaseException:
        conn.close()
        raise
    return LinkEnd(conn, secret, theirs + mine, b"to driver", b"to agent")


def serve(side: LinkEnd, run: Callable[[Message], HostOutcome]) -> None:
    """An agent's loop over its link: for each "run" message, ``run`` it (the life's proxy
    command) and send its outcome back; return on "end" or when the driver is gone."""
    try:
        while True:
            try:
                message = side.receive()
            except (OSError, ValueError):
                return
            if message.kind != "run":
                return
            side.send(outcome_message(int(message.fields["life"]), run(message)))
    finally:
        side.conn.close()
