"""The launcher–rank protocol: what hvdrun, the ranks' wrappers and the ranks tell each other.

Three channels, each with one job:

- **Environment variables** that hvdrun sets for every rank (the names below).
- **Output lines.** A rank's wrapper writes each line of the rank's output as
  ``[RANK]<stdout>:text`` (or ``<stderr>``), with one ``write()`` of at most
  :data:`PIECE_BYTES` bytes. MPICH's Hydra forwards a rank's pipe by reads of 64 KiB, the
  pipe's whole capacity, so a read holds only whole writes, and a whole line is never spliced
  with another rank's. A longer line goes as several pieces: every piece but the last is
  marked ``[RANK]<stdout>+`` and hvdrun joins them back, per rank and stream, into one line.
  Output is only ever shown: nothing a rank prints can end or fail the job.
- **Reports.** A wrapper tells hvdrun that its rank started (:class:`Started`) and how it
  ended (:class:`Exited`) over a TCP connection to hvdrun's report port
  (:data:`REPORTS_VARIABLE`), never through the output. Each report is bound to a fresh
  challenge of hvdrun's and signed with the job's secret (:data:`SECRET_VARIABLE`), and hvdrun's
  acknowledgement is signed too, so a report cannot be forged, replayed, or lost unnoticed.
- **Elastic mode.** hvdrun tells each life's ranks where their commits live, how many lives
  came before, and its notice port (the ``ELASTIC_*`` variables and :func:`job_folders`); a
  rank that leaves for new hosts exits with :data:`RESET_EXIT_CODE`; rank 0 asks the notice
  port whether the hosts changed (:func:`ask_notice`, :func:`answer_notice`), both ends
  proving that they hold the job's secret.

Standard library only: hvdrun, the wrappers (which must start fast) and the ranks import it
without the rest of hvd_trainer.
"""
import hashlib
import hmac
import json
import os
import re
import select
import socket
import time
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple, Union

# Set for every rank: it runs under hvdrun's wrapper, so on an uncaught exception it may simply
# exit non-zero (hvdrun then ends the job) instead of MPI_Abort, which kills its output relay.
WORKER_VARIABLE = "HVDRUN_WORKER"
# The nodes in rank order with the number of ranks on each, as JSON [[host, ranks], ...],
# from which each wrapper sets Horovod's per-rank variables.
HOSTS_VARIABLE = "HVDRUN_HOSTS"
# Set (to 1) by --prefix-output-with-timestamp: each line gets its time after the prefix.
TIMESTAMP_VARIABLE = "HVDRUN_TIMESTAMP"
# host:port of hvdrun's report port.
REPORTS_VARIABLE = "HVDRUN_REPORTS"
# The job's secret (hex text), which signs the reports (and elastic's commits and notices).
SECRET_VARIABLE = "HVD_JOB_SECRET"
# Set (to 1) by hvdrun --ulfm: the other ranks go on without a rank that a signal killed.
ULFM_VARIABLE = "HVD_ULFM"

# Elastic mode: what hvdrun sets for every rank of a life.
ELASTIC_DIR_VARIABLE = "HVD_ELASTIC_DIR"  # the job's commit folder on each host (job_folders)
ELASTIC_DISK_DIR_VARIABLE = "HVD_ELASTIC_DISK_DIR"  # on disk, for commits memory cannot hold
NOTIFY_VARIABLE = "HVD_ELASTIC_NOTIFY"  # host:port of hvdrun's notice port
RESTART_VARIABLE = "HVD_ELASTIC_RESTART"  # how many times the job was restarted before this life
GENERATION_VARIABLE = "HVD_ELASTIC_GENERATION"  # the hosts' generation this life started with
COMMITTED_VARIABLE = "HVD_ELASTIC_COMMITTED"  # the newest commit hvdrun heard was written
ALLOW_FRESH_START_VARIABLE = "HVD_ELASTIC_ALLOW_FRESH_START"  # "1": a restart may begin anew
MIN_NP_VARIABLE = "HVD_ELASTIC_MIN_NP"  # --min-np under --ulfm: fewer survivors end the life
# The exit code of a rank that leaves so that hvdrun restarts the job on new hosts
# (EX_TEMPFAIL: try again); hvdrun counts it as a reset, not as a failure of the host.
RESET_EXIT_CODE = 75

# MPI_Finalize waits for every rank, so a rank leaving with sys.exit(n) would wait there for
# ranks that wait for it, and never report its code. Without the wait it exits and the job
# ends. MPICH reads the first variable, Open MPI the second (at MPI_Init); each ignores the
# other's. hvdrun sets them for the ranks, and a rank started otherwise sets them itself.
NO_FINALIZE_WAIT_VARIABLES = {"MPIR_CVAR_NO_COLLECTIVE_FINALIZE": "1",
                              "OMPI_MCA_async_mpi_finalize": "1"}

# Engines (hvd_trainer.spark, hvd_trainer.ray): each agent hands the launcher proxy it runs
# the folder, private to that host, where the rank side finds the function and leaves its
# result, and the secret that signs both (hex text).
ENGINE_FOLDER_VARIABLE = "HVD_ENGINE_FOLDER"
ENGINE_SECRET_VARIABLE = "HVD_ENGINE_SECRET"
# ... and the agent's working directory, where its ranks work: the launcher starts them in
# "/", since its own working directory need not exist on the other hosts.
ENGINE_WORKDIR_VARIABLE = "HVD_ENGINE_WORKDIR"
# The labels of those files, which their signatures bind: the function, and rank N's result.
ENGINE_FUNCTION = "function"
ENGINE_RESULT = "result.{rank}"
# The folder beside them that holds hvd_trainer's horovod shim (engines.rank offers it).
ENGINE_SHIM_FOLDER = "horovod_shim"
# A Spark job's ranks: JSON, for each local rank on the host, its task's resources
# ({"gpu": ["0"]}), which the driver (engines.spark_run) hands the host's proxy and
# hvd_trainer.spark.task reads on the rank.
SPARK_RESOURCES_VARIABLE = "HVD_SPARK_TASK_RESOURCES"
# What MPICH's mpiexec -launcher manual prints: one line per host holding the proxy command
# that host must run, then the end marker, after which it waits for the proxies.
MANUAL_LAUNCH_PREFIX = "HYDRA_LAUNCH: "
MANUAL_LAUNCH_END = "HYDRA_LAUNCH_END"
# The mpiexec argument that selects the manual launcher.
MANUAL_LAUNCHER_ARGUMENTS = ("-launcher", "manual")
# Open MPI has none: its mpirun calls a launcher agent in place of ssh (engines.ssh), which
# hands each host's daemon command to the engine launch over a Unix socket
# (:func:`send_proxy_line`), signed with the launch's secret (hex text) in this variable.
ENGINE_LAUNCH_SECRET_VARIABLE = "HVD_ENGINE_LAUNCH_SECRET"

# An engine launch (engines.launch) runs hvdrun with the job's secret in the first variable
# (hex text), for hvdrun's reports: the agents give it to the ranks, so it never travels
# through the MPI launcher, whose control port anyone may reach. The second names (a JSON
# list) the caller's variables for the ranks: the launcher passes those and hvdrun's own, and
# the rest of a rank's environment is its agent's.
ENGINE_JOB_SECRET_VARIABLE = "HVD_ENGINE_JOB_SECRET"
ENGINE_RANK_VARIABLES_VARIABLE = "HVD_ENGINE_RANK_VARIABLES"

# An elastic engine job (engines.elastic): hvdrun runs with the first variable set ("1"), and
# prints on its stdout before each life (and, with its number, before a growth in place: the
# hosts added) :data:`ENGINE_LIFE_PREFIX` and the life as JSON (:func:`life_line`), so that the
# engine launch knows which agent takes each proxy line; it leaves the commit folders on the
# other hosts to the agents. Each agent keeps a folder of its own for the job's commits on its
# host, across lives, and hands it to its ranks in the second variable, which stands in for
# hvdrun's :data:`ELASTIC_DIR_VARIABLE` there.
ENGINE_LIVES_VARIABLE = "HVD_ENGINE_LIVES"
ENGINE_COMMITS_VARIABLE = "HVD_ENGINE_COMMITS"
ENGINE_LIFE_PREFIX = "HVD_ENGINE_LIFE: "
# hvdrun of an elastic engine job reads, in the file the third variable names (in the engine
# job's private folder, replaced whole), the agents that the engine lost: a JSON object a line
# (:func:`lost_line`), hvdrun's name of the host and the life it was lost in, so that it ends
# that life at once (under --ulfm the survivors go on), not waiting for ranks that cannot come.
ENGINE_LOST_VARIABLE = "HVD_ENGINE_LOST"
# An engine's agent names itself to the ranks its proxy starts (processes.identity): a rank's
# wrapper ends its rank when that agent is gone, even when the proxy outlives it (an elastic
# engine job under --ulfm, where Open MPI's runtime must not lose the host's daemon).
ENGINE_AGENT_VARIABLE = "HVD_ENGINE_AGENT"
# A rank of an elastic engine job appends the events it logs (hvd_trainer.ray.ray_logger), one
# JSON object a line, to the file this variable names, in its agent's folder
# (:data:`ENGINE_EVENTS`): the agent carries them back with the life's outcomes.
ENGINE_EVENTS_VARIABLE = "HVD_ENGINE_EVENTS"
ENGINE_EVENTS = "events.{rank}"


class EngineLife(NamedTuple):
    """One life of an elastic engine job as hvdrun announces it: its number (the restarts
    before it) and its hosts with their ranks, in rank order (the proxy lines come in that
    order under MPICH; Open MPI's name their host)."""

    number: int
    hosts: List[Tuple[str, int]]


def life_line(life: EngineLife) -> str:
    """The line hvdrun prints for ``life`` (without its newline)."""
    return ENGINE_LIFE_PREFIX + json.dumps({"number": life.number,
                                            "hosts": [list(entry) for entry in life.hosts]})


def parse_life_line(line: str) -> EngineLife:
    """The life in a :func:`life_line`; ValueError when it is not one."""
    try:
        fields = json.loads(line[len(ENGINE_LIFE_PREFIX):])
        return EngineLife(int(fields["number"]),
                          [(str(host), int(ranks)) for host, ranks in fields["hosts"]])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"not a life line ({error}): {line[:200]!r}") from None

class LostHost(NamedTuple):
    """An agent an elastic engine job lost: the ``life`` it was lost in, its host by
    hvdrun's name, the engine's ``cause``, and whether it was ``absent`` when the life began
    (lost in an earlier life, after hvdrun had read the hosts for this one)."""

    life: int
    host: str
    cause: str
    absent: bool = False


def lost_line(lost: LostHost) -> str:
    """The line (without its newline) that says ``lost`` in the engine's file."""
    return json.dumps(lost._asdict())


def parse_lost(text: str) -> List[LostHost]:
    """The lost hosts in the engine's file ``text``; lines that are not one are skipped."""
    found = []
    for line in text.splitlines():
        try:
            fields = json.loads(line)
            found.append(LostHost(int(fields["life"]), str(fields["host"]),
                                  str(fields.get("cause", "")), fields.get("absent") is True))
        except (ValueError, KeyError, TypeError):
            continue
    return found


# The wrapper's exit codes when it cannot start the command, as a shell's.
NOT_FOUND_EXIT_CODE = 127
CANNOT_EXECUTE_EXIT_CODE = 126

STREAMS = ("stdout", "stderr")  # by file descriptor - 1
# The most a wrapper writes at once: writes of up to PIPE_BUF bytes reach a pipe whole.
PIECE_BYTES = select.PIPE_BUF
# A line longer than this is passed on as lines of this length, rather than held back whole.
MAX_LINE = 1 << 16
LINE_PREFIX = re.compile(rb"\[(\d+)\]<(stdout|stderr)>([:+])")
_CONTINUED = b"+"


def line_prefix(rank: int, stream: str, *, continued: bool = False) -> bytes:
    """``[RANK]<STREAM>:`` (``+`` instead of ``:`` for a piece that the next one continues)."""
    return f"[{rank}]<{stream}>{'+' if continued else ':'}".encode()


def pieces(prefix: bytes, continued: bytes, line: bytes) -> List[bytes]:
    """``line`` (without its newline) as the writes that carry it: ``prefix`` + the line +
    newline when that fits in :data:`PIECE_BYTES`, else pieces that do, every one but the
    last starting with ``continued`` instead of ``prefix``."""
    out = []
    room = PIECE_BYTES - 1 - max(len(prefix), len(continued))
    while len(line) > room:
        out.append(continued + line[:room] + b"\n")
        line = line[room:]
    out.append(prefix + line + b"\n")
    return out


def is_continued(mark: bytes) -> bool:
    """Whether the mark that :data:`LINE_PREFIX` matched (group 3) says the line goes on."""
    return mark == _CONTINUED


class Started(NamedTuple):
    """A rank's wrapper has started, on ``host``."""

    rank: int
    host: str


class Exited(NamedTuple):
    """A rank exited with ``code`` (128+N: killed by signal N) at ``at`` (its host's clock);
    ``killed``: by a signal; ``ended``: after the launcher signalled it (a consequence)."""

    rank: int
    code: int
    at: float
    killed: bool = False
    ended: bool = False


Report = Union[Started, Exited]
_KINDS = {"started": Started, "exited": Exited}
_NONCE_BYTES = 16
_MAC_BYTES = hashlib.sha256().digest_size
_MAX_REPORT = 4096
_MAX_PROXY_LINE = 1 << 16  # mpirun's daemon command: a few KiB
# The most a report's whole exchange may take, either side: a silent peer must not hold it up.
REPORT_SECONDS = 10.0


def encode(report: Report) -> bytes:
    """The report as the bytes that travel (JSON)."""
    kind = next(name for name, cls in _KINDS.items() if isinstance(report, cls))
    return json.dumps({"kind": kind, **report._asdict()}).encode()


def decode(data: bytes) -> Report:
    """The report that :func:`encode` made; ValueError for anything else."""
    try:
        fields = json.loads(data)
        cls = _KINDS[fields.pop("kind")]
        report = cls(**fields)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a report ({error})") from None
    types = {"rank": int, "code": int, "host": str, "at": (int, float), "killed": bool,
             "ended": bool}
    wrong = [name for name, value in report._asdict().items()
             if not isinstance(value, types[name]) or (type(value) is bool) != (types[name] is bool)]
    if wrong:
        raise ValueError(f"a report whose {', '.join(wrong)} have the wrong type")
    return report


def mac(secret: bytes, *parts: Any) -> bytes:
    """HMAC-SHA256 of ``parts`` (bytes or any buffer) under ``secret``; each part's length is
    bound in, so parts cannot be shifted from one into the next."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(memoryview(part).nbytes.to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def receive(conn: socket.socket, count: int, deadline: Optional[float]) -> bytes:
    """Exactly ``count`` bytes from ``conn``; with a ``deadline`` (time.monotonic()),
    socket.timeout after it, however the peer trickles its bytes; ConnectionError if it
    closes before."""
    data = b""
    while len(data) < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{len(data)} of {count} bytes came before the deadline")
            conn.settimeout(left)
        chunk = conn.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(data)} of "
                                  f"{count} bytes")
        data += chunk
    return data


def send_report(address: str, secret: bytes, report: Report) -> None:
    """Tell hvdrun at ``address`` (host:port) the ``report``, and wait for its signed receipt.
    OSError when hvdrun cannot be reached in time; ValueError when the answer is not hvdrun's."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=REPORT_SECONDS) as conn:
        _send_challenged(conn, secret, b"report", b"received", encode(report))


def _send_challenged(conn: socket.socket, secret: bytes, label: bytes, receipt: bytes,
                     payload: bytes) -> None:
    """Send ``payload`` signed (``label``) over the peer's challenge, then check its receipt
    (signed ``receipt``), all within REPORT_SECONDS; ValueError for a receipt not signed
    with ``secret``."""
    deadline = time.monotonic() + REPORT_SECONDS
    challenge = receive(conn, _NONCE_BYTES, deadline)
    conn.sendall(len(payload).to_bytes(4, "big") + payload
                 + mac(secret, label, challenge, payload))
    if not hmac.compare_digest(receive(conn, _MAC_BYTES, deadline),
                               mac(secret, receipt, challenge, payload)):
        raise ValueError("the receipt is not signed with this job's secret")


def _receive_challenged(conn: socket.socket, secret: bytes, label: bytes, most: int,
                        what: str) -> Tuple[bytes, bytes]:
    """The other side of :func:`_send_challenged` up to the receipt: (challenge, payload)
    once the payload's signature (``label``) over a fresh challenge checks out; ValueError
    (naming ``what`` came) or OSError otherwise."""
    deadline = time.monotonic() + REPORT_SECONDS
    challenge = os.urandom(_NONCE_BYTES)
    conn.settimeout(REPORT_SECONDS)
    conn.sendall(challenge)
    size = int.from_bytes(receive(conn, 4, deadline), "big")
    if size > most:
        raise ValueError(f"{what} of {size} bytes (at most {most})")
    payload = receive(conn, size, deadline)
    if not hmac.compare_digest(receive(conn, _MAC_BYTES, deadline),
                               mac(secret, label, challenge, payload)):
        raise ValueError(f"{what} not signed with this job's secret")
    return challenge, payload


class Received(NamedTuple):
    """A report that :func:`receive_report` checked, and the receipt that acknowledges it."""

    report: Report
    receipt: bytes


def receive_report(conn: socket.socket, secret: bytes) -> Received:
    """hvdrun's side of :func:`send_report` up to the receipt: the report, once its signature
    over a fresh challenge checks out; ValueError or OSError otherwise. Send the receipt once
    the report has been recorded: the wrapper waits for it before it exits."""
    challenge, payload = _receive_challenged(conn, secret, b"report", _MAX_REPORT, "a report")
    return Received(decode(payload), mac(secret, b"received", challenge, payload))


class ProxyLine(NamedTuple):
    """What the launcher agent hands the engine launch: the host mpirun named, and the
    command line (shell-quoted) that starts mpirun's daemon there."""

    host: str
    line: str


def send_proxy_line(conn: socket.socket, secret: bytes, host: str, line: str) -> None:
    """The launcher agent's side: send ``host``'s ``line`` over ``conn``, bound to the
    launch's challenge, and wait for its signed receipt; ValueError when the receipt is not
    the launch's, OSError when the launch is gone or silent past :data:`REPORT_SECONDS`."""
    _send_challenged(conn, secret, b"proxy line", b"taken",
                     json.dumps({"host": host, "line": line}).encode())


def receive_proxy_line(conn: socket.socket, secret: bytes) -> ProxyLine:
    """The engine launch's side of :func:`send_proxy_line`: the host and line, once their
    signature over a fresh challenge checks out, the receipt sent; ValueError or OSError
    otherwise."""
    challenge, payload = _receive_challenged(conn, secret, b"proxy line", _MAX_PROXY_LINE,
                                             "a proxy line")
    try:
        fields = json.loads(payload)
        found = ProxyLine(str(fields["host"]), str(fields["line"]))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"not a proxy line ({error})") from None
    conn.sendall(mac(secret, b"taken", challenge, payload))
    return found


def job_secret(environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The job's secret from :data:`SECRET_VARIABLE`, or None outside hvdrun."""
    value = (os.environ if environ is None else environ).get(SECRET_VARIABLE)
    return value.encode() if value else None


def engine_job_secret(secret: bytes) -> str:
    """The job's secret (:data:`SECRET_VARIABLE`'s hex text) of an engine job whose agents
    hold ``secret``: derived from it, so that the key of the reports is not the key of the
    function and results that ``secret`` signs."""
    return mac(secret, b"hvd_trainer engine reports").hex()


MEMORY_ROOT = "/dev/shm"  # a tmpfs on Linux: its files live in memory


def memory_root() -> Optional[str]:
    """:data:`MEMORY_ROOT` when this user may make folders there, else None (no such
    folder, as on macOS, or a read-only one)."""
    usable = os.path.isdir(MEMORY_ROOT) and os.access(MEMORY_ROOT, os.W_OK | os.X_OK)
    return MEMORY_ROOT if usable else None


def job_folders(folder: str, on_disk: Optional[str] = None) -> Tuple[str, ...]:
    """The folders that may hold the elastic commits of a job whose folder
    (:data:`ELASTIC_DIR_VARIABLE`) is ``folder``: ``folder`` itself and, when it is in memory
    (under :data:`MEMORY_ROOT`), ``on_disk`` (:data:`ELASTIC_DISK_DIR_VARIABLE`) for commits
    that do not fit in memory. hvdrun names the two at random, each on its own, so that the
    name in memory, which every user can list, does not give away the one on disk."""
    if os.path.dirname(os.path.abspath(folder)) != MEMORY_ROOT or not on_disk:
        return (folder,)
    return folder, on_disk


def notice_challenge() -> bytes:
    """hvdrun's first message of a notice exchange: a fresh random challenge."""
    return os.urandom(_NONCE_BYTES)


# What a rank sends back: its own challenge, the newest commit it has written, the MAC.
NOTICE_QUESTION_BYTES = _NONCE_BYTES + 8 + _MAC_BYTES
NOTICE_OFFER_BYTES = 1 << 15  # the most an offer in hvdrun's answer may take


class NoticeReply(NamedTuple):
    """hvdrun's answer to a proved question (:func:`notice_reply`)."""

    data: bytes  # what to send back
    written: int  # the newest commit that rank 0 had written when it asked


class Notice(NamedTuple):
    """What hvdrun told rank 0: the hosts' generation ``number`` and, when it offers to change
    the job in place, the offer's JSON (offers.py; else empty)."""

    number: int
    offer: bytes


def notice_reply(secret: bytes, challenge: bytes, question: bytes,
                 number: int, offer: bytes = b"") -> Optional[NoticeReply]:
    """hvdrun's side of the notice exchange, without the socket: given the ``challenge`` it
    sent and the rank's ``question`` (NOTICE_QUESTION_BYTES), the reply that tells ``number``
    (the hosts' generation) and ``offer``, bound to both challenges so that it cannot be
    replayed or forged; None when the question does not prove that its sender holds
    ``secret``."""
    theirs = question[:_NONCE_BYTES]
    written = question[_NONCE_BYTES:_NONCE_BYTES + 8]
    if not hmac.compare_digest(question[_NONCE_BYTES + 8:],
                               mac(secret, b"ask", challenge, theirs, written)):
        return None
    told = number.to_bytes(8, "big") + len(offer).to_bytes(4, "big") + offer
    return NoticeReply(told + mac(secret, b"tell", challenge, theirs, told),
                       int.from_bytes(written, "big"))


def answer_notice(conn: socket.socket, secret: bytes, number: int,
                  deadline: Optional[float] = None, offer: bytes = b"") -> Optional[int]:
    """:func:`notice_reply` over a blocking ``conn``, the whole exchange by ``deadline``:
    the newest commit the rank reported, or None when it did not prove that it holds
    ``secret`` (then it is told nothing)."""
    mine = notice_challenge()
    conn.sendall(mine)
    reply = notice_reply(secret, mine, receive(conn, NOTICE_QUESTION_BYTES, deadline), number,
                         offer)
    if reply is None:
        return None
    conn.sendall(reply.data)
    return reply.written


def ask_notice(conn: socket.socket, secret: bytes, written: int = 0,
               deadline: Optional[float] = None) -> Notice:
    """A rank's side of :func:`notice_reply`, telling hvdrun the newest commit this rank has
    ``written`` (so that a restart that finds none knows that commits were lost), the whole
    exchange by ``deadline`` (time.monotonic()): what hvdrun told; ValueError when the reply
    does not prove that it comes from the holder of ``secret``."""
    theirs = receive(conn, _NONCE_BYTES, deadline)
    mine = os.urandom(_NONCE_BYTES)
    reported = written.to_bytes(8, "big")
    conn.sendall(mine + reported + mac(secret, b"ask", theirs, mine, reported))
    told = receive(conn, 12, deadline)
    length = int.from_bytes(told[8:], "big")
    if length > NOTICE_OFFER_BYTES:
        raise ValueError(f"the reply is not signed with this job's secret (it claims an "
                         f"offer of {length} bytes, over {NOTICE_OFFER_BYTES})")
    told += receive(conn, length, deadline)
    if not hmac.compare_digest(receive(conn, _MAC_BYTES, deadline),
                               mac(secret, b"tell", theirs, mine, told)):
        raise ValueError("the reply is not signed with this job's secret")
    return Notice(int.from_bytes(told[:8], "big"), told[12:])
