"""hvdrun's output relay: mpiexec's output shown whole line by line, and the wrappers' reports
recorded, from which the first failure of a job is chosen and named.

It reads the line format and reports of hvd_trainer_launch/protocol.py; job.run_job drives it.
"""
import os
import sys
import threading
import time
from typing import Any, BinaryIO, Dict, List, Optional, Sequence, Set, Tuple

from hvd_trainer_launch import protocol
from hvd_trainer_launch.files.outputs import Output

# How a rank that exited after the launcher signalled it is reported (a consequence, mostly).
ENDED = "was ended by the launcher, with code"
# A rank killed by a signal (kill -9, the OOM killer, a crash) that the launcher did not send
# is the first failure if it was seen this soon after the earliest exit: a survivor whose MPI
# aborts on the lost connection exits within milliseconds, sooner than the killed rank's
# wrapper may be scheduled to see its child end.
KILLED_WINDOW_SECONDS = 1.0


class Failure:
    """A rank's failure: its number, exit code, how it failed (ENDED: after the launcher
    signalled it) and when (by its host's clock, or by ours when it reported no time)."""

    def __init__(self, rank: int, code: int, how: str, at: Optional[float] = None,
                 killed: bool = False):
        self.rank, self.code, self.how, self.killed = rank, code, how, killed
        self.at = time.time() if at is None else at
        self.seen_at = time.monotonic()


def first_failure(failures: Sequence[Failure]) -> Failure:
    """The earliest of ``failures`` by the clocks of their hosts, or a rank killed by a signal
    within KILLED_WINDOW_SECONDS of it (see there)."""
    earliest = min(f.at for f in failures)
    killed = [f for f in failures if f.killed and f.at <= earliest + KILLED_WINDOW_SECONDS]
    return min(killed or failures, key=lambda failure: failure.at)


class OutputRelay:
    """Copies mpiexec's output to ours, strips or keeps rank prefixes, joins the pieces of
    long lines, tees into per-rank files, and records what the wrappers report.

    Output is only shown, never read for reports (those come to deliver()): no output of a
    rank can end or fail the job. Each line arrives whole with its rank's prefix, or as
    pieces whose prefix says that the line goes on (hvd_trainer_launch/protocol.py); pieces are joined
    per rank and stream, so a line stays whole and prefixed however mpiexec interleaves the
    ranks. (A rank that calls MPI_Abort is named by nobody: mpiexec's exit code tells it.) A
    per-rank file that cannot be written warns once and stops; the relay goes on. ``hosts``
    is the job's (host, slots) list: with more than one host, messages name each rank's host
    (the one it reported starting on, else its slot's).
    """

    def __init__(self, np: int, no_prefix: bool, output_dir: Optional[str],
                 hosts: Sequence[Tuple[str, int]] = ()):
        self.no_prefix = no_prefix
        self.failure: Optional[Failure] = None  # the first failure, once settle() chose it
        self.reported: List[Failure] = []
        self.started: Set[int] = set()  # ranks whose wrapper has reported its start
        self.exited: Set[int] = set()  # ranks whose wrapper has reported its exit (0 too)
        self.hosts: Dict[int, str] = {}  # the host each started rank reported
        # When mpiexec's manual launcher (an engine's job) ended each block of proxy lines:
        # the life's first, then each spawn's (a growth in place).
        self.launch_blocks: List[float] = []
        self._slots = [host for host, slots in hosts for _ in range(slots)]
        self._name_hosts = len({host for host, _ in hosts}) > 1
        self.interrupted = False  # set when hvdrun itself ends the job: later exits are not failures
        self.ending = False  # set when hvdrun ends the job after a failure: later exits follow it
        self._lock = threading.Lock()
        self._gone: Set[int] = set()  # the outputs whose reader went away, by id()
        self._files: Dict[Tuple[int, bytes], Any] = {}
        self._output_dir = output_dir
        self._open_files(range(np))

    def _open_files(self, ranks: Sequence[int]) -> None:
        """Open the per-rank files of ``ranks`` under the output folder, if one was given."""
        for rank in ranks if self._output_dir else ():
            folder = os.path.join(self._output_dir, f"rank.{rank}")
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            except OSError as error:
                say(f"warning: cannot create {folder!r} ({error}); rank {rank}'s output "
                     "is not written to files")
                continue
            for stream in (b"stdout", b"stderr"):
                self._files[rank, stream] = Output(
                    os.path.join(folder, stream.decode()), what=f"rank {rank}'s {stream.decode()} copy",
                    warn=lambda message: say(f"warning: {message}"))

    def add_ranks(self, hosts: Sequence[Tuple[str, int]]) -> None:
        """Ranks that joined the running job (grown in place) on ``hosts`` (host, ranks),
        numbered after the others."""
        first = len(self._slots)
        self._slots += [host for host, slots in hosts for _ in range(slots)]
        self._name_hosts = len(set(self._slots)) > 1
        self._open_files(range(first, len(self._slots)))

    def relay(self, pipe: BinaryIO, out: BinaryIO) -> None:
        """Read ``pipe`` line by line until EOF, writing what the user should see to ``out``."""
        pending: Dict[Tuple[int, bytes], bytes] = {}  # the pieces so far of a line that goes on
        for line in iter(pipe.readline, b""):
            prefixed = protocol.LINE_PREFIX.match(line)
            if prefixed is None:  # mpiexec's own message
                if line.strip() == protocol.MANUAL_LAUNCH_END.encode():
                    self.launch_blocks.append(time.monotonic())
                self._show(out, line)
                continue
            continued = protocol.is_continued(prefixed[3])
            if not (continued or pending or self._files):  # the common case: shown as it came
                self._show(out, line[prefixed.end():] if self.no_prefix else line)
                continue
            source = (int(prefixed[1]), prefixed[2])
            text = pending.pop(source, b"") + line[prefixed.end():]
            # A wrapper sends at most MAX_LINE bytes (and a time stamp) in pieces: a longer
            # run of them is shown rather than held.
            if continued and len(text) <= 2 * protocol.MAX_LINE:
                pending[source] = text[:-1] if text.endswith(b"\n") else text
                continue
            self._line(out, source, text if text.endswith(b"\n") else text + b"\n")
        for source, text in pending.items():  # a wrapper killed amid a long line
            self._line(out, source, text + b"\n")

    def _line(self, out: Optional[BinaryIO], source: Tuple[int, bytes], text: bytes) -> None:
        """Show one whole line of rank ``source[0]``'s stream ``source[1]`` and tee it."""
        target = self._files.get(source)
        if target is not None:
            target.write(text)
            target.flush()
        prefix = protocol.line_prefix(source[0], source[1].decode())
        self._show(out, text if self.no_prefix else prefix + text)

    def _show(self, out: Optional[BinaryIO], data: bytes) -> None:
        """Write ``data`` to ``out``; a reader that went away stops the showing, not the
        draining (mpiexec must never block on its output)."""
        if out is None or id(out) in self._gone:
            return
        try:
            with _WRITING:
                out.write(data)
                out.flush()
        except BrokenPipeError:
            self._gone.add(id(out))

    def deliver(self, report: protocol.Report) -> None:
        """Record what a rank's wrapper reported (from the report port)."""
        if isinstance(report, protocol.Started):
            with self._lock:
                self.started.add(report.rank)
                self.hosts[report.rank] = report.host
        else:
            with self._lock:
                self.exited.add(report.rank)
            if report.code:
                self.record(report.rank, report.code,
                            ENDED if report.ended else "exited with code", report.at,
                            report.killed)

    def unexited(self, seconds: float) -> List[int]:
        """The started ranks whose exit is still unreported after waiting up to ``seconds``
        for them (a wrapper whose proxy is lost ends its rank, then reports)."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                missing = sorted(self.started - self.exited)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)

    def record(self, rank: int, code: int, how: str, at: Optional[float] = None,
               killed: bool = False) -> None:
        """Note a rank's failure (it exited at ``at``, ``killed`` by a signal) until settle()
        chooses the first; none after that."""
        with self._lock:
            if self.failure is not None or self.interrupted:
                return
            self.reported.append(Failure(rank, code, how, at, killed))

    def first_report(self) -> Optional[float]:
        """When (time.monotonic()) the first failure was reported; None before any."""
        with self._lock:
            return self.reported[0].seen_at if self.reported else None

    def settle(self) -> Optional[Failure]:
        """Choose, once, the failure that came first among those reported, announce it and
        return it (None without any).

        Not the first report to arrive: one from another host travels further, and a rank
        that the launcher ended (after another rank's failure) is a consequence. So the
        earliest exit of a rank not ended by the launcher wins, by the clocks of their hosts,
        except that a rank killed by a signal within KILLED_WINDOW_SECONDS of it wins over
        exits (see there).
        """
        with self._lock:
            if self.failure is not None or not self.reported:
                return self.failure
            self.failure = first_failure([f for f in self.reported if f.how != ENDED]
                                         or self.reported)
        self.announce(self.failure)
        return self.failure

    def announce(self, failure: Failure) -> None:
        """Say which rank failed first."""
        say(f"rank {failure.rank}{self.where([failure.rank])} {failure.how} {failure.code} "
             "(first failure); ending the job")

    def hosts_of(self, ranks: Sequence[int]) -> List[str]:
        """The hosts of ``ranks`` (the one each reported, else its slot's), each once, in order."""
        hosts: List[str] = []
        for rank in ranks:
            host = self.hosts.get(rank) or (self._slots[rank] if rank < len(self._slots) else None)
            if host and host not in hosts:
                hosts.append(host)
        return hosts

    def where(self, ranks: Sequence[int]) -> str:
        """' on HOST[, HOST...]' for ``ranks`` of a job on several hosts; '' otherwise."""
        hosts = self.hosts_of(ranks)
        return f" on {', '.join(hosts)}" if hosts and self._name_hosts else ""

    def ranks(self, ranks: Sequence[int]) -> str:
        """'rank 3 on h2' or 'ranks 0, 1 on h1, h2'."""
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                + self.where(ranks))

    def not_started(self, missing: List[int], seconds: float) -> None:
        """Record that the ``missing`` ranks did not start within ``seconds``: a failure with code 1."""
        with self._lock:
            if self.failure is not None or self.reported or self.interrupted:
                return
            self.failure = Failure(missing[0], 1, "did not start")
            self.reported.append(self.failure)
        say(f"{self.ranks(missing)} {START_TIMEOUT_TEXT} {seconds:g} s; ending the job")

    def close(self) -> None:
        """Close the per-rank files."""
        for target in self._files.values():
            target.close()


# What hvdrun says of ranks that did not start in time (the engines look for it).
START_TIMEOUT_TEXT = "did not start within --start-timeout"
# hvdrun's messages and the ranks' lines reach our stdout and stderr from several threads; one
# write at a time, or a pipe that takes a long line in parts would get a message in between.
_WRITING = threading.Lock()


def say(message: str) -> None:
    """Print one hvdrun message on stderr."""
    with _WRITING:
        sys.stderr.write(f"hvdrun: {message}\n")
        sys.stderr.flush()
