"""``hvdrun``: start a command on N ranks through the MPI's own mpiexec, Horovod-style.

mpiexec runs ``python -m hvd_trainer_launch.worker -- command ...`` on every rank; the worker
prefixes output lines with the rank, and reports its rank's start and a non-zero exit to
hvdrun's report port (launch/protocol.py, launch/reports.py), never through the output. hvdrun
relays the output (with or without prefixes, optionally into per-rank files) and names the
first rank that failed (launch/relay.py), ends the whole job promptly after a failure or a
Ctrl-C/SIGTERM, and exits with that rank's code.
It takes horovodrun's flags; launch/flags.py says what each one does, or why it is refused.
With --min-np, --max-np or --host-discovery-script it runs elastically (launch/elastic.py).
"""
import argparse
import json
import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from hvd_trainer_launch import config_file, flags, horovod_shim, mpi, protocol, reports
from hvd_trainer_launch.relay import OutputRelay, say
from hvd_trainer_launch.worker import die_with_parent

# After the first failure, how long the other ranks get to report before mpiexec is told to end
# the job (Hydra does not end it by itself when a rank exits non-zero).
FAILURE_GRACE_SECONDS = 3.0
# After asking mpiexec to end the job (failure or signal), how long before it is SIGKILLed.
KILL_GRACE_SECONDS = 5.0

def build_parser() -> argparse.ArgumentParser:
    """The command-line interface: every horovodrun 0.28.1 flag (launch/flags.py) plus hvdrun's own."""
    # argparse's allow_abbrev stays on: horovodrun takes unambiguous prefixes of its flags.
    parser = argparse.ArgumentParser(
        prog="hvdrun",
        description="Run COMMAND on N ranks with the MPI launcher that matches mpi4py's MPI library. "
                    "Takes horovodrun's flags; docs/configuration.md's flag table says what each does.",
        epilog="example: hvdrun -np 4 python train.py --epochs 10")
    flags.add_to(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> argparse.Namespace:
    """Parse the command line; with --config-file, its settings fill in what the line leaves unset.

    As in horovodrun, a setting given on the command line wins over the config file's. A refused
    setting in the file is refused like its flag, naming the setting.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if not args.config_file:
        return args
    try:
        settings = config_file.arguments(args.config_file)
    except (OSError, config_file.ConfigError) as error:
        parser.exit(2, f"hvdrun: error: --config-file: {error}\n")
    # Which destinations the command line itself set: parse it again into a namespace where
    # every destination already holds a marker, so argparse fills in no defaults.
    unset = object()
    marked = parser.parse_args(argv, argparse.Namespace(**{dest: unset for dest in vars(args)}))
    given = {dest for dest, value in vars(marked).items() if value is not unset}
    from_file: List[str] = []
    for name, setting in settings:
        if flags.dest(setting[0]) in given:
            continue
        if any(setting[0] in entry.names for entry in flags.REFUSED):
            parser.exit(2, f"{flags.refusal(setting[0])} ({name} in {args.config_file})\n")
        from_file += setting
    return parser.parse_args(from_file + argv)


def rank_environment(args: argparse.Namespace, flavour: str) -> Dict[str, str]:
    """The caller's whole environment plus the variables that the flags set."""
    env = dict(os.environ)
    # MPI_Finalize waits for every rank: a rank that calls sys.exit(3) would wait there for
    # ranks that wait for it, and never report its code. Without that wait it exits at once
    # and the job ends. MPICH reads the first variable, Open MPI (mpirun passes its OMPI_MCA_*
    # variables on) the second; each ignores the other's.
    env.setdefault("MPIR_CVAR_NO_COLLECTIVE_FINALIZE", "1")
    env.setdefault("OMPI_MCA_async_mpi_finalize", "1")
    env.update(flags.rank_variables(args, flavour))
    return env


def hosts_variable(flavour: str, hosts: List[Tuple[str, int]], np: int) -> Dict[str, str]:
    """The variable from which each rank's wrapper sets Horovod's per-rank variables: the nodes
    the launcher makes of ``hosts`` with their ranks (ValueError when ``np`` exceeds the slots)."""
    return {protocol.HOSTS_VARIABLE: json.dumps(mpi.placement(flavour, hosts, np))}


def report_variables(server: reports.ReportServer, secret: str) -> Dict[str, str]:
    """The variables that tell each rank's wrapper where and how to report to ``server``."""
    return {protocol.REPORTS_VARIABLE: server.address, protocol.SECRET_VARIABLE: secret}


# What keeps the ranks' network transport on the loopback in a one-host job (unless the caller
# set it): MPICH's UCX ranks would otherwise listen on every interface.
LOOPBACK_VARIABLES = {"UCX_NET_DEVICES": "lo"}


def launched(leader: int) -> Dict[int, bytes]:
    """What mpiexec (``leader``) started on this host that may outlive it, with each process's
    start time: its session, and its children in sessions of their own (Hydra's ssh). Open
    MPI's ssh leaves mpiexec's process group but not its session. Empty where /proc is not."""
    found: Dict[int, bytes] = {}
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return found
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
            if leader in (int(fields[1]), int(fields[3])):  # its parent, its session
                found[pid] = fields[19]
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass
    return found


def kill_processes(processes: Dict[int, bytes]) -> None:
    """SIGKILL each of ``processes`` still running since its recorded start time. A stray ssh
    would hold the job's output open and keep its remote host busy."""
    for pid, start in processes.items():
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                if stat.read().rpartition(b")")[2].split()[19] == start:
                    os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):  # gone meanwhile
            pass


def run_job(command: List[str], env: Dict[str, str], relay: OutputRelay,
            np: int = 0, start_timeout: Optional[float] = None,
            failure_grace: Optional[float] = FAILURE_GRACE_SECONDS) -> int:
    """Run the mpiexec ``command`` to the end and return hvdrun's exit code.

    mpiexec gets its own session so that a terminal's Ctrl-C reaches only hvdrun, which forwards
    it; after a failure or a signal the job is ended, and SIGKILLed if it lingers. mpiexec is
    SIGKILLed by the kernel when hvdrun dies (even by SIGKILL), and the ranks' wrappers end
    their ranks when mpiexec goes. With
    ``start_timeout``, a job whose ``np`` ranks have not all started by then is ended with code 1.
    ``failure_grace`` is how long the other ranks get to report after the first failure
    (None: a failure does not end the job, whose survivors go on: hvdrun --ulfm).
    """
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, preexec_fn=die_with_parent())
    readers = [threading.Thread(target=relay.relay, args=(process.stdout, sys.stdout.buffer), daemon=True),
               threading.Thread(target=relay.relay, args=(process.stderr, sys.stderr.buffer), daemon=True)]
    for reader in readers:
        reader.start()
    received: List[int] = []
    handled = 0
    # Forward signals while the job runs; the caller's handlers come back afterwards.
    previous = {signum: signal.signal(signum, lambda signum, _frame: received.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    ending = False
    kill_at = None
    left: Dict[int, bytes] = {}  # what mpiexec had started when it was told to end
    start_deadline = None if start_timeout is None else time.monotonic() + start_timeout
    while process.poll() is None:
        now = time.monotonic()
        if start_deadline is not None and now >= start_deadline:
            start_deadline = None
            missing = sorted(set(range(np)) - relay.started)
            if missing:
                relay.not_started(missing, start_timeout)
        if len(received) > handled:
            handled = len(received)
            if handled == 1:
                relay.interrupted = True
                say(f"received {signal.Signals(received[0]).name}; ending the job")
                left.update(launched(process.pid))  # mpiexec may orphan them as it ends
                process.send_signal(received[0])
                ending, kill_at = True, now + KILL_GRACE_SECONDS
            else:
                kill_at = now
        first = relay.first_report()
        # After a start timeout (the only failure chosen before this) nobody is left to report.
        if first is not None and not ending and (relay.failure is not None or (
                failure_grace is not None and now >= first + failure_grace)):
            relay.settle()
            relay.ending = True
            left.update(launched(process.pid))
            process.terminate()
            ending, kill_at = True, now + KILL_GRACE_SECONDS
        if kill_at is not None and now >= kill_at:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            kill_processes({**left, **launched(process.pid)})
            kill_at = None
        time.sleep(0.05)
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    kill_processes({**left, **launched(process.pid)})
    for reader in readers:  # a process that outlived mpiexec may hold its pipes: do not wait forever
        reader.join(KILL_GRACE_SECONDS)
    if not any(reader.is_alive() for reader in readers):
        relay.close()
    if received:
        return 128 + received[0]
    if relay.settle() is not None:
        return relay.failure.code or 1
    code = process.returncode if process.returncode >= 0 else 128 - process.returncode
    missing = sorted(set(range(np)) - relay.started)
    if code and missing:
        say(f"{command[0]} exited with code {code} before {relay.ranks(missing)} started; "
             "its messages above say why (e.g. ssh could not reach a host)")
    elif code:
        say(f"{command[0]} exited with code {code}; no rank reported its own exit (a rank that "
             "calls MPI_Abort is killed before it can)")
    elif np and len(missing) == np:
        say(f"{command[0]} exited with code 0 but no rank reported its start: it started "
             "none (is it an MPI launcher? see --mpiexec and HVD_MPIEXEC), or the ranks could "
             "not reach hvdrun's report port (their warnings above say so)")
        return 1
    return code


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``hvdrun`` console script; returns the exit code."""
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if args.check_build:
        from hvd_trainer_launch.check_build import check_build
        return check_build(args.mpiexec)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from hvd_trainer_launch import elastic
    if args.np is None and not elastic.requested(args):
        parser.error("-np N is required (the number of ranks to start)")
    if args.np is not None and args.np < 1:
        parser.error(f"-np must be >= 1, got {args.np}")
    if not command:
        parser.error("missing command: give the program to run, e.g. hvdrun -np 2 python train.py")
    if args.hosts and args.hostfile:
        parser.error("give either -H or --hostfile, not both")
    for name, flag in (("fusion_threshold_mb", "--fusion-threshold-mb"),
                       ("stall_check_time_seconds", "--stall-check-warning-time-seconds"),
                       ("stall_shutdown_time_seconds", "--stall-check-shutdown-time-seconds")):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            parser.error(f"{flag} must be >= 0")
    timeout_from = "--start-timeout (or HVD_START_TIMEOUT)"
    if args.start_timeout is None:  # as horovodrun, which reads HOROVOD_START_TIMEOUT
        for name in ("HVD_START_TIMEOUT", "HOROVOD_START_TIMEOUT"):
            if os.environ.get(name):
                timeout_from = f"{name}={os.environ[name]!r}"
                try:
                    args.start_timeout = float(os.environ[name])
                except ValueError:
                    parser.error(f"{timeout_from} is not a number of seconds")
                break
    if args.start_timeout is not None and math.isnan(args.start_timeout):
        parser.error(f"{timeout_from} is not a number of seconds (nan); give a number of "
                     "seconds > 0, or leave it unset for no limit")
    if args.start_timeout is not None and args.start_timeout <= 0:
        parser.error("--start-timeout (or HVD_START_TIMEOUT) must be > 0 seconds")
    if args.horovod:
        try:
            horovod_shim.check()
        except horovod_shim.RealHorovodError as error:
            say(f"error: {error}")
            return 2
    try:
        hosts = (mpi.parse_hosts(args.hosts) if args.hosts else
                 mpi.read_hostfile(args.hostfile) if args.hostfile else [])
        launcher = mpi.find_launcher(args.mpiexec)
        mpi_args = flags.launcher_arguments(args, launcher.flavour)
        if elastic.requested(args):
            elastic.check(args, launcher.flavour)
        elif args.ulfm:
            raise ValueError("--ulfm is an elastic-mode flag: give --min-np (and -np) too")
        else:
            # Without hosts every rank runs here, as horovodrun's default localhost:np; inside
            # a Slurm allocation mpiexec puts them on its nodes by itself.
            nodes = hosts or mpi.slurm_allocation(os.environ) or [("localhost", args.np)]
            placed = hosts_variable(launcher.flavour, nodes, args.np)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    except mpi.MPIError as error:
        say(f"error: {error}")
        return 2
    if elastic.requested(args):
        return elastic.run(args, launcher, mpi_args, command, hosts)
    one_host = all(mpi.this_machine(host) for host, _ in nodes)
    if one_host:
        advice = mpi.shared_memory_advice(launcher.flavour, args.np)
        if advice:
            say(f"warning: {advice}")
        if not args.nics:
            placed.update({name: value for name, value in LOOPBACK_VARIABLES.items()
                           if name not in os.environ})
    relay = OutputRelay(args.np, args.no_prefix, args.output_filename, nodes)
    secret = secrets.token_hex(32)  # signs the wrappers' reports; only the ranks get it
    try:
        server = reports.serve(secret.encode(), nodes, args.nics, relay.deliver)
    except (ValueError, OSError) as error:
        parser.error(f"cannot open hvdrun's report port: {error}")
    env = dict(rank_environment(args, launcher.flavour), **placed,
               **report_variables(server, secret))
    program = [sys.executable, "-m", "hvd_trainer_launch.worker", "--"] + command
    mpiexec_command = mpi.build_command(launcher, args.np, hosts, mpi_args, program, env)
    if args.verbose:
        say(f"running: {shlex.join(mpiexec_command)}")
    try:
        return run_job(mpiexec_command, env, relay, args.np, args.start_timeout)
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
