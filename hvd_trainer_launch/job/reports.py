"""hvdrun's report port: where the ranks' wrappers say that their rank started and how it ended.

The reports travel apart from the ranks' output (hvd_trainer_launch/protocol.py), so nothing a rank prints
is ever read as one. The port listens on the loopback when every rank runs on this machine,
else on the first --network-interface's address (on every interface without one), and serves
each connection on a thread of its own with a deadline for the whole exchange, so a slow or
silent peer holds up nobody. At most SERVED_AT_ONCE connections are served at a time; more
wait in the listen backlog rather than each taking a thread, so a flood of connections cannot
use up the process's threads. Only reports signed with the job's secret count.
"""
import fcntl
import socket
import struct
import threading
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import mpi, protocol


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``; ValueError when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as error:
            raise ValueError(f"--network-interface {name}: no IPv4 address ({error.strerror})") from None
    return socket.inet_ntoa(answer[20:24])


class Endpoint(NamedTuple):
    """Where a port of hvdrun's listens (``bind``; '' for every interface) and the host name
    by which the ranks reach it."""

    bind: str
    host: str


def endpoint(hosts: Sequence[Tuple[str, int]], nics: Sequence[str] = ()) -> Endpoint:
    """Where to listen for the ranks on ``hosts`` (host, slots): the loopback when they all
    run here, else the first of ``nics``, else every interface (reached by this host's name)."""
    if all(mpi.this_machine(host) for host, _ in hosts):
        return Endpoint("127.0.0.1", "127.0.0.1")
    if nics:
        address = interface_address(nics[0])
        return Endpoint(address, address)
    return Endpoint("", socket.getfqdn())


SERVED_AT_ONCE = 256


class ReportServer:
    """Listens at ``where`` and hands each report that checks out to ``deliver``, then
    acknowledges it: a wrapper's report is recorded before the wrapper exits. ``at_once``
    connections are served at a time (each ends within protocol.REPORT_SECONDS)."""

    def __init__(self, secret: bytes, where: Endpoint,
                 deliver: Callable[[protocol.Report], None], at_once: int = SERVED_AT_ONCE):
        self.secret, self.deliver = secret, deliver
        self._slots = threading.BoundedSemaphore(at_once)
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((where.bind, 0))
        self._server.listen(socket.SOMAXCONN)
        self.address = f"{where.host}:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="hvdrun-reports").start()

    def _accept(self) -> None:
        while True:
            self._slots.acquire()
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name="hvdrun-report").start()
            except RuntimeError:  # the system has no thread to spare: drop this one, go on
                conn.close()
                self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                received = protocol.receive_report(conn, self.secret)
                self.deliver(received.report)
                conn.sendall(received.receipt)
            except (OSError, ValueError):  # not a wrapper of this job, or it went away
                pass
            finally:
                self._slots.release()

    def close(self) -> None:
        """Stop listening; reports that arrive later are refused."""
        self._server.close()


def serve(secret: bytes, hosts: Sequence[Tuple[str, int]], nics: Optional[Sequence[str]],
          deliver: Callable[[protocol.Report], None]) -> ReportServer:
    """A report server for the ranks on ``hosts``, listening where they reach it (:func:`endpoint`)."""
    return ReportServer(secret, endpoint(hosts, nics or ()), deliver)
