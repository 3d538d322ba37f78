"""Per-rank wrapper that hvdrun starts through mpiexec: ``python -m hvd_trainer_launch.worker -- cmd ...``.

The wrapper runs the user's command as a child that inherits the environment and every file
descriptor (MPICH's PMI hands the rank an fd), and exits with the child's exit code. A non-zero
exit is also reported on stderr as a marker line that hvdrun parses (and hides) to name the
first rank that failed: it carries the time of the exit, and whether the launcher had told the
rank to end (a consequence of another rank's failure, not a cause). A start marker on stderr
tells hvdrun that the rank has started (for ``--start-timeout``) and on which host.

The child's output goes through pipes to a separate relay process, in its own session, that
prefixes each line with the rank. It is separate because on MPI_Abort the launcher SIGKILLs the
wrapper at once: a relay inside the wrapper would lose the traceback that explains the abort,
while a relay that the launcher does not know about can still copy it out.
"""
import ctypes
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional

EXIT_MARKER = "#hvdrun-exit"
START_MARKER = "#hvdrun-start"
# Set (to 1) by hvdrun --prefix-output-with-timestamp: each line gets its time after the prefix.
TIMESTAMP_VARIABLE = "HVDRUN_TIMESTAMP"
# Set for the child: it runs under this wrapper, so on an uncaught exception it may simply exit
# non-zero (hvdrun then ends the job) instead of MPI_Abort, which kills the relay mid-traceback.
WORKER_VARIABLE = "HVDRUN_WORKER"
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_PR_SET_PDEATHSIG = 1
# Once the child has exited (or the wrapper has died), how long the relay may keep copying output
# from processes the child left behind before it gives up.
_DRAIN_SECONDS = 2.0
# A line longer than this is passed on in pieces rather than held back whole.
_MAX_LINE = 1 << 16


def launcher_rank(environ: Mapping[str, str]) -> Optional[int]:
    """The rank the MPI launcher gave this process (Hydra, Open MPI, PMIx or Slurm), or None."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def exit_marker(rank: int, code: int, told: bool = False) -> bytes:
    """The marker line telling hvdrun that ``rank`` exited with ``code`` now (this host's
    clock), ``told`` when the launcher had signalled it to end."""
    told_text = " told" if told else ""
    return f"{EXIT_MARKER} rank={rank} code={code} at={time.time():.6f}{told_text}\n".encode()


def start_marker(rank: int) -> bytes:
    """The marker line telling hvdrun that ``rank`` has started, and on which host."""
    return f"{START_MARKER} rank={rank} host={socket.gethostname()}\n".encode()


def _timestamp() -> bytes:
    """The local time with milliseconds, as output lines are stamped with it."""
    now = time.time()
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} ".encode()


def die_with_parent(signum: int = signal.SIGKILL):
    """Return a preexec_fn that makes the kernel send ``signum`` to the child when its parent
    (this process) dies.

    Without it a rank could outlive a wrapper that mpiexec killed, and a job could outlive an
    hvdrun killed with SIGKILL. No-op where prctl is missing.
    """
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    parent = os.getpid()

    def preexec():
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signum)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
    return preexec


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (pipes may take it in parts)."""
    while data:
        data = data[os.write(fd, data):]


def _relay(sources: Dict[int, int], rank: int, wrapper: int, stamp: bool) -> None:
    """Copy each source fd to its target fd line by line, prefixed with the rank (and with the
    time when ``stamp``), until all close.

    ``sources`` maps the child's stdout/stderr pipes to our stdout/stderr. Stops early when the
    wrapper has been gone for _DRAIN_SECONDS (the child's own children may hold the pipes open).
    """
    prefixes = {source: f"[{rank}]<{'stdout' if target == 1 else 'stderr'}>:".encode()
                for source, target in sources.items()}
    pending = {source: b"" for source in sources}
    selector = selectors.DefaultSelector()
    for source in sources:
        selector.register(source, selectors.EVENT_READ)
    deadline = None
    while selector.get_map():
        for key, _ in selector.select(timeout=0.2):
            source = key.fd
            data = os.read(source, 1 << 16)
            if not data:
                selector.unregister(source)
                data = b"\n" if pending[source] else b""
            lines = (pending[source] + data).split(b"\n")
            pending[source] = lines.pop()
            if len(pending[source]) > _MAX_LINE:
                lines.append(pending[source])
                pending[source] = b""
            if lines:
                prefix = prefixes[source] + (_timestamp() if stamp else b"")
                _write_all(sources[source], b"".join(prefix + line + b"\n" for line in lines))
        if deadline is None and os.getppid() != wrapper:
            deadline = time.monotonic() + _DRAIN_SECONDS
        if deadline is not None and time.monotonic() > deadline:
            return


def _start_relay(child: subprocess.Popen, rank: int, stamp: bool) -> int:
    """Fork the relay process for the child's output pipes; return its pid."""
    wrapper = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()  # out of the wrapper's process group, so a kill aimed at the rank spares it
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            _relay({child.stdout.fileno(): 1, child.stderr.fileno(): 2}, rank, wrapper, stamp)
        finally:
            os._exit(0)
    child.stdout.close()
    child.stderr.close()
    return pid


def _wait_relay(pid: int) -> None:
    """Let the relay finish copying the child's output; kill it after _DRAIN_SECONDS."""
    deadline = time.monotonic() + _DRAIN_SECONDS
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command after ``--`` on this rank; return its exit code (128+N if killed by signal N)."""
    command = sys.argv[1:] if argv is None else list(argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m hvd_trainer_launch.worker -- command [args ...]", file=sys.stderr)
        return 2
    rank = launcher_rank(os.environ)
    if rank is None:
        print(f"hvd_trainer_launch.worker: none of {', '.join(RANK_VARIABLES)} is set; "
              "start it through hvdrun or mpiexec", file=sys.stderr)
        return 2
    _write_all(2, start_marker(rank))
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # so Python ranks' prints arrive live and survive a crash
    env[WORKER_VARIABLE] = "1"
    sys.stdout.flush()
    try:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 close_fds=False, preexec_fn=die_with_parent())
    except OSError as error:
        code = 127 if isinstance(error, FileNotFoundError) else 126
        message = f"[{rank}]<stderr>:hvdrun: cannot run {command[0]!r}: {error.strerror}\n"
        _write_all(2, message.encode() + exit_marker(rank, code))
        return code
    told: List[int] = []

    def forward(received: int, _frame) -> None:
        told.append(received)
        child.send_signal(received)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    relay = _start_relay(child, rank, os.environ.get(TIMESTAMP_VARIABLE) == "1")
    returncode = child.wait()
    code = returncode if returncode >= 0 else 128 - returncode
    marker = exit_marker(rank, code, bool(told))  # stamped with the exit's time, not the drain's
    _wait_relay(relay)
    if code:
        _write_all(2, marker)
    return code


if __name__ == "__main__":
    sys.exit(main())
