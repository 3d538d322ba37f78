"""``hvdrun``: start a command on N ranks through the MPI's own mpiexec, Horovod-style.

mpiexec runs ``python -m hvd_trainer_launch.worker -- command ...`` on every rank; the worker
prefixes output lines with the rank and reports a non-zero exit. hvdrun relays the output (with
or without prefixes, optionally into per-rank files), names the first rank that failed, ends
the whole job promptly after a failure or a Ctrl-C/SIGTERM, and exits with that rank's code.
"""
import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Dict, List, Optional, Tuple

from hvd_trainer_launch import mpi
from hvd_trainer_launch.worker import EXIT_MARKER

# After the first failure, how long the other ranks get to report before mpiexec is told to end
# the job (Hydra does not end it by itself when a rank exits non-zero).
FAILURE_GRACE_SECONDS = 3.0
# After asking mpiexec to end the job (failure or signal), how long before it is SIGKILLed.
KILL_GRACE_SECONDS = 5.0

_PREFIXED = re.compile(rb"\[(\d+)\]<(stdout|stderr)>:")
_MARKER = re.compile(re.escape(EXIT_MARKER).encode() + rb" rank=(\d+) code=(\d+)")
# MPICH prints "... application called MPI_Abort(MPI_COMM_WORLD, 1) - process 1" and then kills
# every wrapper at once, so this line may be the only news of the rank. (Open MPI lets the
# aborting rank exit, so its wrapper reports it.)
_MPICH_ABORT = re.compile(rb"application called MPI_Abort\(.*, (-?\d+)\) - process (\d+)")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface; every option maps to an mpiexec argument or an HVD_* variable."""
    parser = argparse.ArgumentParser(
        prog="hvdrun", allow_abbrev=False,
        description="Run COMMAND on N ranks with the MPI launcher that matches mpi4py's MPI library.",
        epilog="example: hvdrun -np 4 python train.py --epochs 10")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N", help="number of ranks")
    parser.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and slots, e.g. a:4,b:4")
    parser.add_argument("--hostfile", metavar="FILE", help="lines 'host slots=N' or 'host:N'")
    parser.add_argument("--mpi-args", default="", metavar="ARGS",
                        help="extra mpiexec arguments (one shell-quoted string), before the program")
    parser.add_argument("--mpiexec", metavar="PATH",
                        help="launcher to use (default: $HVD_MPIEXEC, else the one matching mpi4py's MPI)")
    parser.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="tensor fusion buffer size in MiB (sets HVD_FUSION_THRESHOLD in bytes)")
    parser.add_argument("--timeline-filename", metavar="FILE", help="write a Chrome trace (HVD_TIMELINE)")
    parser.add_argument("--stall-check-time-seconds", type=float, metavar="S",
                        help="warn when a collective waits this long (HVD_STALL_CHECK_TIME_SECONDS)")
    parser.add_argument("--stall-shutdown-time-seconds", type=float, metavar="S",
                        help="end the job when a collective waits this long (HVD_STALL_SHUTDOWN_TIME_SECONDS)")
    parser.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]<stream>:")
    parser.add_argument("--verbose", action="store_true",
                        help="debug logging on the ranks (HVD_LOG_LEVEL=debug); print the mpiexec command")
    parser.add_argument("--check-build", action="store_true",
                        help="print the MPI, mpiexec, NCCL, MXNet and numpy this installation would use")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def rank_environment(args: argparse.Namespace) -> Dict[str, str]:
    """The caller's whole environment plus the HVD_* variables that the options set."""
    env = dict(os.environ)
    # MPI_Finalize waits for every rank: a rank that calls sys.exit(3) would wait there for
    # ranks that wait for it, and never report its code. Without that wait it exits at once
    # and the job ends. MPICH reads the first variable, Open MPI (mpirun passes its OMPI_MCA_*
    # variables on) the second; each ignores the other's.
    env.setdefault("MPIR_CVAR_NO_COLLECTIVE_FINALIZE", "1")
    env.setdefault("OMPI_MCA_async_mpi_finalize", "1")
    if args.fusion_threshold_mb is not None:
        env["HVD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.timeline_filename:
        env["HVD_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.stall_check_time_seconds is not None:
        env["HVD_STALL_CHECK_TIME_SECONDS"] = f"{args.stall_check_time_seconds:g}"
    if args.stall_shutdown_time_seconds is not None:
        env["HVD_STALL_SHUTDOWN_TIME_SECONDS"] = f"{args.stall_shutdown_time_seconds:g}"
    if args.verbose:
        env["HVD_LOG_LEVEL"] = "debug"
    return env


class Failure:
    """The first rank that failed: its number, exit code and how it failed."""

    def __init__(self, rank: int, code: int, how: str):
        self.rank, self.code, self.how = rank, code, how
        self.seen_at = time.monotonic()


class OutputRelay:
    """Copies mpiexec's output to ours, strips or keeps rank prefixes, tees into per-rank files,
    hides the workers' exit markers and records the first failure they (or an MPI_Abort) report."""

    def __init__(self, np: int, no_prefix: bool, output_dir: Optional[str]):
        self.no_prefix = no_prefix
        self.failure: Optional[Failure] = None
        self.interrupted = False  # set when hvdrun itself ends the job: later exits are not failures
        self._lock = threading.Lock()
        self._files: Dict[Tuple[int, bytes], BinaryIO] = {}
        if output_dir:
            for rank in range(np):
                folder = os.path.join(output_dir, f"rank.{rank}")
                os.makedirs(folder, exist_ok=True)
                for stream in (b"stdout", b"stderr"):
                    self._files[rank, stream] = open(os.path.join(folder, stream.decode()), "wb")

    def relay(self, pipe: BinaryIO, out: BinaryIO) -> None:
        """Read ``pipe`` line by line until EOF, writing what the user should see to ``out``."""
        for line in iter(pipe.readline, b""):
            marker = _MARKER.match(line)
            if marker:
                self.record(int(marker[1]), int(marker[2]), "exited with code")
                continue
            prefixed = _PREFIXED.match(line)
            text = line[prefixed.end():] if prefixed else line
            self._check_abort(text)
            if prefixed:
                target = self._files.get((int(prefixed[1]), prefixed[2]))
                if target is not None:
                    target.write(text)
                    target.flush()
            if out is not None:
                try:
                    out.write(text if prefixed and self.no_prefix else line)
                    out.flush()
                except BrokenPipeError:  # our reader went away: keep draining so mpiexec never blocks
                    out = None

    def _check_abort(self, text: bytes) -> None:
        """Record an MPI_Abort that MPICH reports, since Hydra kills the worker before it can."""
        abort = _MPICH_ABORT.search(text)
        if abort:
            self.record(int(abort[2]), int(abort[1]), "called MPI_Abort with code")

    def record(self, rank: int, code: int, how: str) -> None:
        """Remember the first failure and announce it; later ones are consequences."""
        with self._lock:
            if self.failure is not None or self.interrupted:
                return
            self.failure = Failure(rank, code, how)
        _say(f"rank {rank} {how} {code} (first failure); ending the job")

    def close(self) -> None:
        """Close the per-rank files."""
        for target in self._files.values():
            target.close()


def _say(message: str) -> None:
    """Print one hvdrun message on stderr."""
    sys.stderr.write(f"hvdrun: {message}\n")
    sys.stderr.flush()


def run_job(command: List[str], env: Dict[str, str], relay: OutputRelay) -> int:
    """Run the mpiexec ``command`` to the end and return hvdrun's exit code.

    mpiexec gets its own session so that a terminal's Ctrl-C reaches only hvdrun, which forwards
    it; after a failure or a signal the job is ended, and SIGKILLed if it lingers.
    """
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    readers = [threading.Thread(target=relay.relay, args=(process.stdout, sys.stdout.buffer), daemon=True),
               threading.Thread(target=relay.relay, args=(process.stderr, sys.stderr.buffer), daemon=True)]
    for reader in readers:
        reader.start()
    received: List[int] = []
    handled = 0
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, _frame: received.append(signum))
    ending = False
    kill_at = None
    while process.poll() is None:
        now = time.monotonic()
        if len(received) > handled:
            handled = len(received)
            if handled == 1:
                relay.interrupted = True
                _say(f"received {signal.Signals(received[0]).name}; ending the job")
                process.send_signal(received[0])
                ending, kill_at = True, now + KILL_GRACE_SECONDS
            else:
                kill_at = now
        failure = relay.failure
        if failure is not None and not ending and now >= failure.seen_at + FAILURE_GRACE_SECONDS:
            process.terminate()
            ending, kill_at = True, now + KILL_GRACE_SECONDS
        if kill_at is not None and now >= kill_at:
            os.killpg(process.pid, signal.SIGKILL)
            kill_at = None
        time.sleep(0.05)
    for reader in readers:  # a process that outlived mpiexec may hold its pipes: do not wait forever
        reader.join(KILL_GRACE_SECONDS)
    if not any(reader.is_alive() for reader in readers):
        relay.close()
    if received:
        return 128 + received[0]
    if relay.failure is not None:
        return relay.failure.code or 1
    code = process.returncode if process.returncode >= 0 else 128 - process.returncode
    if code:
        _say(f"{command[0]} exited with code {code}; no rank reported its own exit (a rank that "
             "calls MPI_Abort is killed before it can)")
    return code


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``hvdrun`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        from hvd_trainer_launch.check_build import check_build
        return check_build(args.mpiexec)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.np is None:
        parser.error("-np N is required (the number of ranks to start)")
    if args.np < 1:
        parser.error(f"-np must be >= 1, got {args.np}")
    if not command:
        parser.error("missing command: give the program to run, e.g. hvdrun -np 2 python train.py")
    if args.hosts and args.hostfile:
        parser.error("give either -H or --hostfile, not both")
    if args.fusion_threshold_mb is not None and args.fusion_threshold_mb < 0:
        parser.error("--fusion-threshold-mb must be >= 0")
    try:
        hosts = (mpi.parse_hosts(args.hosts) if args.hosts else
                 mpi.read_hostfile(args.hostfile) if args.hostfile else [])
        mpi_args = shlex.split(args.mpi_args)
        launcher = mpi.find_launcher(args.mpiexec)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    except mpi.MPIError as error:
        _say(f"error: {error}")
        return 2
    env = rank_environment(args)
    program = [sys.executable, "-m", "hvd_trainer_launch.worker", "--"] + command
    mpiexec_command = mpi.build_command(launcher, args.np, hosts, mpi_args, program, env)
    if args.verbose:
        _say(f"running: {shlex.join(mpiexec_command)}")
    relay = OutputRelay(args.np, args.no_prefix, args.output_filename)
    return run_job(mpiexec_command, env, relay)


if __name__ == "__main__":
    sys.exit(main())
