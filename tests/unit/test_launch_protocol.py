"""The launcher–rank protocol (hvd_trainer_launch.protocol) and hvdrun's report port: reports
round-trip only between holders of the job's secret, a silent peer holds up nobody, and the
wrappers' side imports nothing of hvd_trainer's core; the protocol is standard library only, and
no launcher module imports one that imports it back."""
import ast
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from hvd_trainer_launch import protocol
from hvd_trainer_launch.job import reports
from hvd_trainer_launch.protocol import Exited, Started

SECRET = b"the job's secret"


@pytest.fixture
def port():
    """A report server on the loopback; yields it with the list of reports it received."""
    received = []
    server = reports.serve(SECRET, [("localhost", 2)], None, received.append)
    yield server, received
    server.close()


def test_a_report_arrives_whole_and_is_acknowledged(port):
    server, received = port
    assert server.address.startswith("127.0.0.1:")
    protocol.send_report(server.address, SECRET, Exited(3, 137, 12.5, killed=True))
    protocol.send_report(server.address, SECRET, Started(1, "node7"))
    # send_report returned after the receipt, which comes after the report was recorded
    assert received == [Exited(3, 137, 12.5, killed=True, ended=False), Started(1, "node7")]


def test_a_report_under_another_secret_is_refused_and_not_acknowledged(port):
    server, received = port
    with pytest.raises((ConnectionError, TimeoutError)):
        protocol.send_report(server.address, b"another job's secret", Exited(1, 7, 1.0))
    assert received == []


def test_a_report_signed_for_another_challenge_is_refused(port):
    # A report seen on the wire cannot be replayed: each connection gets a fresh challenge.
    server, received = port
    host, _, number = server.address.rpartition(":")
    payload = protocol.encode(Exited(1, 7, 1.0))
    with socket.create_connection((host, int(number))) as conn:
        conn.recv(16)
        conn.sendall(len(payload).to_bytes(4, "big") + payload
                     + protocol.mac(SECRET, b"report", b"\0" * 16, payload))
        assert conn.recv(64) == b""  # closed without a receipt
    assert received == []


def test_a_silent_connection_does_not_hold_up_a_report(port):
    server, received = port
    host, _, number = server.address.rpartition(":")
    with socket.create_connection((host, int(number))):  # connects and says nothing
        start = time.monotonic()
        protocol.send_report(server.address, SECRET, Started(0, "h"))
        assert time.monotonic() - start < protocol.REPORT_SECONDS
    assert received == [Started(0, "h")]


def test_a_flood_of_connections_takes_no_more_threads_than_the_cap_and_reports_still_arrive():
    received = []
    server = reports.ReportServer(SECRET, reports.Endpoint("127.0.0.1", "127.0.0.1"),
                                  received.append, at_once=2)
    host, _, number = server.address.rpartition(":")

    def serving():
        return sum(thread.name == "hvdrun-report" for thread in threading.enumerate())

    try:
        silent = [socket.create_connection((host, int(number))) for _ in range(6)]
        deadline = time.monotonic() + 5
        while serving() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time for more threads to start, were there no cap
        assert serving() == 2
        for conn in silent:  # the peers go away: their slots come free
            conn.close()
        protocol.send_report(server.address, SECRET, Started(0, "h"))
        assert received == [Started(0, "h")]
    finally:
        server.close()


@pytest.mark.parametrize("payload", [b"{}", b"[1]", b'{"kind": "exited", "rank": "1", "code": 7, "at": 1.0}',
                                     b'{"kind": "started", "rank": true, "host": "h"}', b"\xff"])
def test_what_is_not_a_report_is_refused(payload):
    with pytest.raises(ValueError):
        protocol.decode(payload)


def test_reports_round_trip_through_their_encoding():
    for report in (Started(2, "h2"), Exited(0, 143, 100.25, killed=True, ended=True), Exited(1, 3, 7)):
        assert protocol.decode(protocol.encode(report)) == report


def test_a_line_goes_in_pieces_that_each_fit_one_pipe_write():
    for size in (0, 1, protocol.PIECE_BYTES - 20, protocol.PIECE_BYTES, 3 * protocol.PIECE_BYTES + 7):
        line = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        pieces = protocol.pieces(b"[12]<stderr>:", b"[12]<stderr>+", line)
        assert all(len(piece) <= protocol.PIECE_BYTES and piece.endswith(b"\n") for piece in pieces)
        assert all(piece.startswith(b"[12]<stderr>+") for piece in pieces[:-1])
        assert pieces[-1].startswith(b"[12]<stderr>:")
        assert b"".join(piece[13:-1] for piece in pieces) == line


def test_the_wrapper_and_the_protocol_import_nothing_of_the_core():
    # The wrappers start on every rank before the command: hvd_trainer's core (NumPy) would
    # cost each of them a second.
    code = ("import sys, hvd_trainer_launch.rank.wrapper, hvd_trainer_launch.protocol; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hvd_trainer', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_hvdrun_waits_for_a_report_in_flight():
    # The receipt comes after delivery: a wrapper exits only once hvdrun has recorded it.
    delivered = threading.Event()

    def slow(report):
        time.sleep(0.3)
        delivered.set()

    server = reports.serve(SECRET, [("127.0.0.1", 1)], None, slow)
    try:
        protocol.send_report(server.address, SECRET, Exited(0, 1, 1.0))
        assert delivered.is_set()
    finally:
        server.close()


LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "hvd_trainer_launch")


def _launcher_modules() -> list:
    """The launcher's modules, as dotted names under hvd_trainer_launch (``job.watch``)."""
    names = []
    for folder, _, files in os.walk(LAUNCH):
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                names.append(os.path.relpath(os.path.join(folder, f[:-3]), LAUNCH)
                             .replace(os.sep, "."))
    return sorted(names)


def _launcher_imports(name: str) -> set:
    """The modules of hvd_trainer_launch and hvd_trainer that hvd_trainer_launch's module
    ``name`` (``job.watch``) imports, in functions too."""
    with open(os.path.join(LAUNCH, *name.split(".")) + ".py") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in ("hvd_trainer", "hvd_trainer_launch")}


def _circles(graph: dict) -> list:
    """The pairs (a, b) of ``graph`` (node -> nodes it imports) where b reaches a back."""
    def reaches(start: str, goal: str) -> bool:
        stack, visited = [start], set()
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in visited:
                visited.add(node)
                stack.extend(graph.get(node, ()))
        return False

    return [(a, b) for a in graph for b in graph[a] if b != a and reaches(b, a)]


def test_no_launcher_module_imports_one_that_imports_it_back():
    names = _launcher_modules()
    graph = {name: {m[len("hvd_trainer_launch."):] for m in _launcher_imports(name)
                    if m[len("hvd_trainer_launch."):] in names}
             for name in names}
    assert "job.relay" in graph["job.watch"]  # the reader sees the subpackages' imports
    assert _circles(graph) == []


def test_no_launcher_folder_imports_one_that_imports_it_back():
    # The launcher's folders (cli, job, rank, elastic, engines, files; protocol on its own) by
    # concern: each imports the ones below it, none reaches back up.
    def folder(module: str) -> str:
        return module.split(".")[0]

    names = _launcher_modules()
    graph: dict = {}
    for name in names:
        graph.setdefault(folder(name), set()).update(
            folder(m[len("hvd_trainer_launch."):]) for m in _launcher_imports(name)
            if m[len("hvd_trainer_launch."):] in names)
    assert {"cli", "job", "rank", "elastic", "engines", "files"} <= set(graph)
    assert _circles(graph) == []


def test_the_protocol_is_standard_library_only():
    assert _launcher_imports("protocol") == set()
