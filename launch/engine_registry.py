"""The driver's registry of a Spark job (hvd_trainer.spark): a TCP port on the driver where the
barrier tasks say where they run and are told what to run, and where the ranks say that they
run the function.

Spark gives a running task no way to hear from the driver, and its own exchange between the
tasks (``BarrierTaskContext.allGather``) costs a second per call (docs/spark.md), so the tasks
dial the driver, as Horovod's do:

1. Each task registers its index, its host and the resources Spark assigned it.
2. Once all have, the driver starts hvdrun and answers each task (:class:`Assignment`): the
   proxy command of its host for the first task on each host, nothing for the others, or why
   the job could not start.
3. Each rank, once it has loaded the function, says so (:func:`report_running`): the job's
   start ends there.

Every exchange is bound to a fresh challenge of the driver's and signed with the job's secret
(HMAC-SHA256, protocol.mac), and so is the driver's answer: nobody without the secret can
register, forge an answer (a proxy command is what a task runs) or replay one. The port binds
to the driver's address that the executors reach; it takes one registration per task and one
report per rank, gives each connection :data:`protocol.REPORT_SECONDS` to prove itself, holds
at most a fixed number of connections at once, and closes when the job has started.
Standard library only: the ranks import it.
"""
import hmac
import json
import os
import socket
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Set

from hvd_trainer_launch import protocol

# host:port of the registry, for a job's ranks (set by their agent).
VARIABLE = "HVD_ENGINE_REGISTRY"
_NONCE_BYTES = 16
_MAC_BYTES = 32
_MOST = 1 << 20  # a message: a proxy command and some resources are a few KiB
# Connections held at once beyond the tasks' own: a stranger cannot crowd out a task.
_SPARE_CONNECTIONS = 16


class Registration(NamedTuple):
    """What a task tells the driver: its index in the job, its host, and the addresses of each
    resource Spark assigned it (``{"gpu": ["0"]}``)."""

    index: int
    host: str
    resources: Dict[str, List[str]]


class Assignment(NamedTuple):
    """The driver's answer to a task: the proxy ``line`` it runs (the first task on each host;
    None for the others) with ``env`` for its ranks, or the ``error`` that ended the job."""

    line: Optional[str] = None
    env: Dict[str, str] = {}
    error: Optional[str] = None


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def _read_frame(conn: socket.socket, deadline: Optional[float]) -> bytes:
    size = int.from_bytes(protocol.receive(conn, 4, deadline), "big")
    if size > _MOST:
        raise ValueError(f"a message of {size} bytes (at most {_MOST})")
    return protocol.receive(conn, size, deadline)


def _check(conn: socket.socket, deadline: Optional[float], expected: bytes) -> None:
    if not hmac.compare_digest(protocol.receive(conn, _MAC_BYTES, deadline), expected):
        raise ValueError("not signed with this job's secret")


def _registration(fields: dict, tasks: int) -> Registration:
    """The registration in ``fields``; ValueError unless its types and index are right."""
    found = Registration(fields["index"], fields["host"], fields["resources"])
    if type(found.index) is not int or not 0 <= found.index < tasks \
            or not isinstance(found.host, str) or not isinstance(found.resources, dict) \
            or not all(isinstance(name, str) and isinstance(addresses, list)
                       and all(isinstance(a, str) for a in addresses)
                       for name, addresses in found.resources.items()):
        raise ValueError("not a registration of this job")
    return found


class Registry:
    """The driver's side: listens on ``host`` (``bind``: the address to bind, default
    ``host``) for the registrations of ``tasks`` tasks and the reports of ``ranks`` ranks
    signed with ``secret``."""

    def __init__(self, host: str, secret: bytes, tasks: int, ranks: int,
                 bind: Optional[str] = None):
        self._secret, self._tasks, self._ranks = secret, tasks, ranks
        self._lock = threading.Lock()
        self._held: Dict[int, tuple] = {}  # index -> (connection, challenge, payload)
        self._registered: Dict[int, Registration] = {}
        self._running: Set[int] = set()
        self._closed = False
        self._all_registered, self._all_running = threading.Event(), threading.Event()
        self._slots = threading.BoundedSemaphore(tasks + _SPARE_CONNECTIONS)
        family, *_ = socket.getaddrinfo(bind or host, None, type=socket.SOCK_STREAM)[0]
        self._listener = socket.create_server((bind or host, 0), family=family)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="hvd-spark-registry").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the job has started, or ended
                return
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: a registration (held for its answer) or a rank's report."""
        held = False
        try:
            deadline = time.monotonic() + protocol.REPORT_SECONDS
            conn.settimeout(protocol.REPORT_SECONDS)
            challenge = os.urandom(_NONCE_BYTES)
            conn.sendall(challenge)
            payload = _read_frame(conn, deadline)
            fields = json.loads(payload)
            kind = fields.get("kind") if isinstance(fields, dict) else None
            _check(conn, deadline, protocol.mac(self._secret, str(kind).encode(), challenge,
                                                payload))
            if kind == "register":
                held = self._register(_registration(fields, self._tasks),
                                      (conn, challenge, payload))
            elif kind == "running" and type(fields.get("rank")) is int \
                    and 0 <= fields["rank"] < self._ranks:
                conn.sendall(protocol.mac(self._secret, b"noted", challenge, payload))
                with self._lock:
                    self._running.add(fields["rank"])
                    if len(self._running) == self._ranks:
                        self._all_running.set()
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not this job's, or gone: the task or rank sees its own failure
        finally:
            if not held:
                conn.close()
                self._slots.release()

    def _register(self, found: Registration, connection: tuple) -> bool:
        """Keep a task's first registration and its connection; False for a repeat."""
        with self._lock:
            if found.index in self._registered or self._closed:
                return False
            self._registered[found.index] = found
            self._held[found.index] = connection
            if len(self._registered) == self._tasks:
                self._all_registered.set()
        return True

    def wait_registered(self, timeout: float) -> bool:
        """Whether every task has registered, waiting up to ``timeout`` seconds."""
        return self._all_registered.wait(max(timeout, 0))

    def registered(self) -> Dict[int, Registration]:
        """The registrations so far, by task index."""
        with self._lock:
            return dict(self._registered)

    def answer(self, assignments: Dict[int, Assignment]) -> None:
        """Send each registered task its assignment (by index; a task left out gets an empty
        one) and let its connection go."""
        with self._lock:
            held, self._held = self._held, {}
        for index, (conn, challenge, payload) in held.items():
            answer = json.dumps(assignments.get(index, Assignment())._asdict()).encode()
            try:
                conn.sendall(_frame(answer)
                             + protocol.mac(self._secret, b"assign", challenge, payload, answer))
            except OSError:
                pass  # that task is gone: Spark fails the job
            finally:
                conn.close()
                self._slots.release()

    def wait_running(self, timeout: float) -> bool:
        """Whether every rank has said that it runs the function, waiting up to ``timeout``."""
        return self._all_running.wait(max(timeout, 0))

    def running(self) -> Set[int]:
        """The ranks that have said that they run the function."""
        with self._lock:
            return set(self._running)

    def close(self) -> None:
        """Stop listening; tasks still waiting for an answer are let go without one."""
        with self._lock:
            self._closed = True
        self._listener.close()
        self.answer({})


def _exchange(address: str, secret: bytes, fields: dict, timeout: float,
              answer_label: bytes, framed: bool) -> bytes:
    """Send ``fields`` to the registry at ``address`` over its challenge, signed; return its
    signed answer (a frame when ``framed``, else only its signature) within ``timeout``."""
    host, _, port = address.rpartition(":")
    payload = json.dumps(fields).encode()
    kind = fields["kind"].encode()
    with socket.create_connection((host, int(port)), timeout=protocol.REPORT_SECONDS) as conn:
        challenge = protocol.receive(conn, _NONCE_BYTES,
                                     time.monotonic() + protocol.REPORT_SECONDS)
        conn.sendall(_frame(payload) + protocol.mac(secret, kind, challenge, payload))
        deadline = time.monotonic() + timeout
        answer = _read_frame(conn, deadline) if framed else b""
        _check(conn, deadline, protocol.mac(secret, answer_label, challenge, payload,
                                            *([answer] if framed else [])))
    return answer


def register(address: str, secret: bytes, registration: Registration,
             timeout: float) -> Assignment:
    """A task's side: register with the driver's registry at ``address`` and wait up to
    ``timeout`` seconds for its assignment. OSError when the driver cannot be reached or does
    not answer in time; ValueError when the answer is not signed with ``secret``."""
    answer = _exchange(address, secret, {"kind": "register", **registration._asdict()},
                       timeout, b"assign", framed=True)
    fields = json.loads(answer)
    return Assignment(fields["line"], dict(fields["env"]), fields["error"])


def report_running(address: str, secret: bytes, rank: int) -> None:
    """A rank's side: tell the registry at ``address`` that ``rank`` runs the function, and
    wait for its signed receipt. OSError or ValueError as :func:`register`."""
    _exchange(address, secret, {"kind": "running", "rank": rank}, protocol.REPORT_SECONDS,
              b"noted", framed=False)
