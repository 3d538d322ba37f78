"""``hvdrun``: start a command on N ranks through the MPI's own mpiexec, Horovod-style.

mpiexec runs ``python -m hvd_trainer_launch.rank.wrapper -- command ...`` on every rank; the
wrapper prefixes output lines with the rank, and reports its rank's start and a non-zero exit
to hvdrun's report port (protocol.py, job/reports.py), never through the output. This module
reads the command line and checks it; job/watch.py runs the job: it relays the output
(job/relay.py), ends the whole job promptly after a failure or a Ctrl-C/SIGTERM (killing what
mpiexec leaves behind: processes.py), and returns the failed rank's exit code. It takes
horovodrun's flags; job/flags.py says what each one does, or why it is refused. With
--min-np, --max-np or --host-discovery-script it runs elastically (elastic/driver.py).
"""
import argparse
import math
import os
import secrets
import shlex
import sys
from typing import Dict, List, Optional, Tuple

from hvd_trainer_launch import mpi
from hvd_trainer_launch.cli import config_file
from hvd_trainer_launch.elastic import driver as elastic
from hvd_trainer_launch.files import open_mpi_sessions
from hvd_trainer_launch.job import flags, reports, watch as job
from hvd_trainer_launch.job.relay import OutputRelay, say
from hvd_trainer_launch.rank import horovod_shim

def build_parser() -> argparse.ArgumentParser:
    """The command-line interface: every horovodrun 0.28.1 flag (job/flags.py) plus hvdrun's own."""
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


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``hvdrun`` console script; returns the exit code."""
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if args.check_build:
        from hvd_trainer_launch.cli.check_build import check_build
        return check_build(args.mpiexec)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
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
        else:
            for name, given in (("--ulfm", args.ulfm),
                                ("--elastic-allow-fresh-start", args.elastic_allow_fresh_start)):
                if given:
                    raise ValueError(f"{name} is an elastic-mode flag: give --min-np (and "
                                     f"-np) too, or drop it")
            # Without hosts every rank runs here, as horovodrun's default localhost:np; inside
            # a Slurm allocation mpiexec puts them on its nodes by itself.
            nodes = hosts or mpi.slurm_allocation(os.environ) or [("localhost", args.np)]
            placed = job.hosts_variable(launcher.flavour, nodes, args.np)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    except mpi.MPIError as error:
        say(f"error: {error}")
        return 2
    if elastic.requested(args):
        return elastic.run(args, launcher, mpi_args, command, hosts)
    return _run(parser, args, launcher, mpi_args, command, hosts, nodes, placed)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, launcher: mpi.Launcher,
         mpi_args: List[str], command: List[str], hosts: List[Tuple[str, int]],
         nodes: List[Tuple[str, int]], placed: Dict[str, str]) -> int:
    """hvdrun's plain mode: one MPI job of ``command`` on ``nodes`` (``placed``: the ranks'
    layout variables), with its report port; its exit code. Under an engine launch
    (job.engine_job) the MPI launcher carries neither the job's secret nor hvdrun's own
    environment, only the ranks' variables."""
    if all(mpi.this_machine(host) for host, _ in nodes):
        advice = mpi.shared_memory_advice(launcher.flavour, args.np)
        if advice:
            say(f"warning: {advice}")
        if not args.nics:
            placed.update({name: value for name, value in job.LOOPBACK_VARIABLES.items()
                           if name not in os.environ})
    relay = OutputRelay(args.np, args.no_prefix, args.output_filename, nodes)
    engine = job.engine_job(os.environ)
    # Signs the wrappers' reports; only the ranks get it (from their agents in an engine job).
    secret = engine.secret if engine else secrets.token_hex(32)
    try:
        server = reports.serve(secret.encode(), nodes, args.nics, relay.deliver)
    except (ValueError, OSError) as error:
        parser.error(f"cannot open hvdrun's report port: {error}")
    own = dict(flags.rank_variables(args, launcher.flavour), **placed,
               **job.report_variables(server, secret))
    env = dict(job.rank_environment(args, launcher.flavour), **own)
    program = [sys.executable, "-m", "hvd_trainer_launch.rank.wrapper", "--"] + command
    forwarded = job.engine_forwarded(engine, own) if engine else None
    mpiexec_command = mpi.build_command(launcher, args.np, hosts, mpi_args, program, env,
                                        forwarded)
    if args.verbose:
        say(f"running: {shlex.join(mpiexec_command)}")
    if launcher.flavour == mpi.OPENMPI:  # a killed launcher's sockets would stop this one
        open_mpi_sessions.sweep()
    try:
        return job.run_job(mpiexec_command, job.launcher_environment(env, forwarded), relay,
                           args.np, args.start_timeout,
                           ssh=job.ssh_launch(args, os.environ, engine is not None))
    finally:
        server.close()

if __name__ == "__main__":
    sys.exit(main())
