"""hvdrun's flags: every horovodrun 0.28.1 flag, accepted with its effect or refused with a reason.

FLAGS lists the accepted flags (Horovod's spelling first, then hvdrun's older aliases) with
their argparse options and the effect docs/configuration.md's table shows; REFUSED lists the others with
the one-line reason hvdrun prints. rank_variables and launcher_arguments turn parsed flags
into HVD_* (and library) variables for the ranks and into mpiexec arguments per MPI dialect.
"""
import argparse
import os
import shlex
import sys
from typing import Any, Dict, List, NamedTuple, Tuple

from hvd_trainer_launch.mpi import HYDRA, OPENMPI
from hvd_trainer_launch.protocol import TIMESTAMP_VARIABLE
from hvd_trainer_launch.rank import horovod_shim

# Horovod's --log-level choices and the hvd_trainer logger level each becomes (hvd_trainer
# logs nothing finer than debug).
LOG_LEVELS = {"TRACE": "debug", "DEBUG": "debug", "INFO": "info", "WARNING": "warning",
              "ERROR": "error", "FATAL": "critical"}


class Flag(NamedTuple):
    """An accepted flag: its spellings, its argparse options and its effect, as the docs say it."""

    names: Tuple[str, ...]
    options: Dict[str, Any]
    effect: str


class Refused(NamedTuple):
    """A horovodrun flag hvdrun refuses: its spellings, how many values follow it, and why."""

    names: Tuple[str, ...]
    nargs: int
    reason: str


class _Version(argparse.Action):
    """Print hvd_trainer's version and exit, like ``horovodrun --version`` prints Horovod's.

    hvd_trainer_launch is installed only as part of the hvd_trainer distribution, so its
    version is always there to read.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata
        sys.stdout.write(f"hvdrun (hvd_trainer) {metadata.version('hvd_trainer')}\n")
        parser.exit(0)


class _Interfaces(argparse.Action):
    """Collect network interfaces from repeated flags, each one name or a comma-separated list."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        chosen = list(current) if isinstance(current, list) else []
        for name in values.split(","):
            if not name.strip():
                parser.error(f"{option_string} {values!r}: empty interface name")
            if name.strip() not in chosen:
                chosen.append(name.strip())
        setattr(namespace, self.dest, chosen)


class _Refuse(argparse.Action):
    """Stop at a refused flag with the one line that says why and what to use instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, refusal(option_string) + "\n")


ALREADY = "already so: "
FLAGS: List[Flag] = [
    Flag(("-v", "--version"), dict(action=_Version, nargs=0),
         "prints hvd_trainer's version and exits"),
    Flag(("-np", "--num-proc"), dict(dest="np", type=int, metavar="N"),
         "number of ranks (`mpiexec -n N`); required, except in elastic mode (default: every "
         "usable slot up to `--max-np`)"),
    Flag(("-cb", "--check-build"), dict(action="store_true"),
         "prints the MPI library and launcher it would use, the frameworks (MXNet, PyTorch, "
         "TensorFlow, Keras) and optional pieces (CuPy/NCCL, Spark, Ray, Slurm, sshd) it finds, "
         "and the command that adds each missing one; exits"),
    Flag(("--disable-cache",), dict(action="store_true"),
         ALREADY + "hvdrun caches no check results; every run finds its launcher afresh"),
    Flag(("--start-timeout",), dict(type=float, metavar="S"),
         "ends the job (exit 1) if some rank has not started within S seconds (default: "
         "`$HVD_START_TIMEOUT`, then `$HOROVOD_START_TIMEOUT`, else no limit)"),
    Flag(("--network-interfaces",), dict(action=_Interfaces, dest="nics", metavar="NIC,..."),
         "`NCCL_SOCKET_IFNAME` and `UCX_NET_DEVICES` (UCX, e.g. MPICH's, otherwise spreads MPI's "
         "data over every link); Open MPI: `--mca btl_tcp_if_include`; Hydra: `-iface` when one NIC"),
    Flag(("--network-interface",), dict(action=_Interfaces, dest="nics", metavar="NIC"),
         "same as `--network-interfaces`; may be repeated"),
    Flag(("--output-filename",), dict(metavar="DIR"),
         "also writes `DIR/rank.N/stdout` and `DIR/rank.N/stderr`"),
    Flag(("--verbose",), dict(action="store_true"),
         "`HVD_LOG_LEVEL=debug` (unless `--log-level`); also prints the mpiexec command line"),
    Flag(("--config-file",), dict(metavar="FILE"),
         "reads Horovod's YAML config; each key acts as its flag; flags on the command line win"),
    Flag(("-p", "--ssh-port"), dict(type=int, metavar="PORT"),
         "ssh `-p PORT` to remote hosts: Hydra `HYDRA_LAUNCHER_EXTRA_ARGS` (Intel MPI "
         "`I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS`); Open MPI `--mca plm_rsh_args`"),
    Flag(("-i", "--ssh-identity-file"), dict(metavar="FILE"),
         "ssh `-i FILE` to remote hosts, passed as for `--ssh-port`"),
    Flag(("--fusion-threshold-mb",), dict(type=float, metavar="MB"),
         "`HVD_FUSION_THRESHOLD` = MB MiB in bytes"),
    Flag(("--hierarchical-allreduce",), dict(action="store_true", dest="hierarchical_allreduce",
                                             default=None),
         "`HVD_HIERARCHICAL_ALLREDUCE=1`: the world's allreduce reduces within each host "
         "(MPI's shared-memory `MPI_Gather`, summed by NumPy), allreduces among one rank per "
         "host, then broadcasts within the host; flat on one host or one rank per host and in process sets "
         "([Performance](performance.md#hierarchical-allreduce))"),
    Flag(("--no-hierarchical-allreduce",), dict(action="store_false", dest="hierarchical_allreduce",
                                                default=None),
         "`HVD_HIERARCHICAL_ALLREDUCE=0` (the default): a flat allreduce (ring or the MPI "
         "library's), e.g. over a config file's `hierarchical_allreduce: true`"),
    Flag(("--hierarchical-allgather",), dict(action="store_true", dest="hierarchical_allgather",
                                             default=None),
         "`HVD_HIERARCHICAL_ALLGATHER=1`: the world's allgather gathers within each host "
         "(`MPI_Gatherv`), allgathers among one rank per host, then broadcasts within the host; "
         "flat where the allreduce is"),
    Flag(("--no-hierarchical-allgather",), dict(action="store_false", dest="hierarchical_allgather",
                                                default=None),
         "`HVD_HIERARCHICAL_ALLGATHER=0` (the default): the MPI library's `MPI_Allgatherv`"),
    Flag(("--autotune",), dict(action="store_true", dest="autotune", default=None),
         "`HVD_AUTOTUNE=1`: the first steps try gradient bucket thresholds (1, 4, 16, 64 MiB) "
         "and overlap on and off; every rank keeps rank 0's fastest"),
    Flag(("--no-autotune",), dict(action="store_false", dest="autotune", default=None),
         "`HVD_AUTOTUNE=0` (the default), e.g. over a config file's `enabled: true`"),
    Flag(("--autotune-log-file",), dict(metavar="FILE"),
         "`HVD_AUTOTUNE_LOG` = FILE as an absolute path (CSV from rank 0: one row per sample, "
         "then the choice)"),
    Flag(("--autotune-warmup-samples",), dict(type=int, metavar="N"),
         "`HVD_AUTOTUNE_WARMUP_SAMPLES` = N samples of the configured setting, not counted "
         "(default 3)"),
    Flag(("--autotune-steps-per-sample",), dict(type=int, metavar="N"),
         "`HVD_AUTOTUNE_STEPS_PER_SAMPLE` = N steps per sample, at least 2 (default 10)"),
    Flag(("--timeline-filename",), dict(metavar="FILE"),
         "`HVD_TIMELINE` = FILE as an absolute path (Chrome trace from rank 0)"),
    Flag(("--no-timeline-mark-cycles",), dict(action="store_false", dest="timeline_mark_cycles",
                                              default=None),
         ALREADY + "hvd_trainer has no cycles to mark"),
    Flag(("--no-stall-check",), dict(action="store_const", const=True, dest="no_stall_check"),
         "`HVD_STALL_CHECK_TIME_SECONDS=0` and `HVD_STALL_SHUTDOWN_TIME_SECONDS=0` (wins over the "
         "two time flags, as in Horovod)"),
    Flag(("--stall-check",), dict(action="store_const", const=False, dest="no_stall_check"),
         "keeps the stall check on (the default), e.g. over a config file's `enabled: false`"),
    Flag(("--stall-check-warning-time-seconds", "--stall-check-time-seconds"),
         dict(type=float, dest="stall_check_time_seconds", metavar="S"),
         "`HVD_STALL_CHECK_TIME_SECONDS` = S (default 60)"),
    Flag(("--stall-check-shutdown-time-seconds", "--stall-shutdown-time-seconds"),
         dict(type=float, dest="stall_shutdown_time_seconds", metavar="S"),
         "`HVD_STALL_SHUTDOWN_TIME_SECONDS` = S (default 0: never)"),
    Flag(("--mpi-threads-disable",), dict(action="store_const", const=True,
                                          dest="mpi_threads_disable"),
         "`MPI4PY_RC_THREAD_LEVEL=single`: MPI starts without thread support, so "
         "`mpi_threads_supported()` is False and the trainer does not overlap"),
    Flag(("--no-mpi-threads-disable",), dict(action="store_const", const=False,
                                             dest="mpi_threads_disable"),
         "keeps MPI thread support on (the default), e.g. over a config file"),
    Flag(("--mpi-args",), dict(default="", metavar="ARGS"),
         "extra mpiexec arguments (one shell-quoted string), before the program"),
    Flag(("--tcp",), dict(action="store_true", dest="tcp"),
         "`NCCL_IB_DISABLE=1`, `UCX_TLS=tcp,self,sm`, `FI_PROVIDER=tcp`: NCCL, UCX and "
         "libfabric talk TCP (shared memory within a host)"),
    Flag(("--binding-args",), dict(default="", metavar="ARGS"),
         "process binding arguments for mpiexec (one shell-quoted string), e.g. "
         "`\"-bind-to core\"`; none by default"),
    Flag(("--log-level",), dict(type=str.upper, choices=list(LOG_LEVELS), metavar="LEVEL"),
         "`HVD_LOG_LEVEL`; Horovod's levels in any case: TRACE and DEBUG give debug, FATAL gives "
         "critical"),
    Flag(("--log-without-timestamp", "--log-hide-timestamp"),
         dict(action="store_false", dest="log_with_timestamp", default=None),
         ALREADY + "hvd_trainer's log lines carry no timestamp"),
    Flag(("-prefix-timestamp", "--prefix-output-with-timestamp"), dict(action="store_true"),
         "each output line gets the time it was written after its rank prefix: "
         "`[0]<stdout>:2026-01-31 12:00:00.123 text`"),
    Flag(("-H", "--hosts"), dict(metavar="HOST:SLOTS,..."), "hosts and slots, e.g. `a:4,b:4`"),
    Flag(("-hostfile", "--hostfile"), dict(metavar="FILE"),
         "hosts from FILE, one `host slots=N` (Open MPI's `max_slots=M` may follow: accepted, "
         "not used) or `host:N` a line"),
    Flag(("--mpi",), dict(action="store_true"), ALREADY + "hvdrun always runs on MPI"),
    Flag(("--min-np", "--min-num-proc"), dict(type=int, dest="min_np", metavar="N"),
         "elastic mode: the fewest ranks to train on; with fewer slots the job waits up to "
         "`--elastic-timeout`"),
    Flag(("--max-np", "--max-num-proc"), dict(type=int, dest="max_np", metavar="N"),
         "elastic mode: the most ranks to train on (default: all discovered slots)"),
    Flag(("--host-discovery-script",), dict(metavar="SCRIPT"),
         "elastic mode: SCRIPT prints the usable hosts, one `host:slots` (or `host`) a line; "
         "hvdrun runs it every second and restarts the job on a change at the next commit"),
    Flag(("--slots-per-host",), dict(type=int, metavar="N"),
         "elastic mode: slots of a discovered host whose line gives none (default 1)"),
    Flag(("--elastic-timeout",), dict(type=float, metavar="S"),
         "elastic mode: ends the job (exit 1) after S seconds with fewer than `--min-np` "
         "usable slots (default 600)"),
    Flag(("--reset-limit",), dict(type=int, metavar="N"),
         "elastic mode: ends the job after N restarts (default: no limit)"),
    Flag(("--blacklist-cooldown-range",), dict(type=float, nargs=2, metavar=("MIN", "MAX")),
         "elastic mode: a host whose ranks failed in two lives in a row stays out for a random "
         "MIN..MAX seconds (default: for the rest of the job)"),
    Flag(("--elastic-allow-fresh-start",), dict(action="store_true"),
         "hvdrun's own, elastic mode: a restart that finds no commit, though an earlier life "
         "wrote one (its folders were removed or lost), trains again from the initial state "
         "with an error line, instead of ending the job (also `HVD_ELASTIC_ALLOW_FRESH_START=1`)"),
    Flag(("--ulfm",), dict(action="store_true"),
         "hvdrun's own, elastic mode, Open MPI 5: when a rank's process dies, the other ranks "
         "shrink the job to themselves and go on in their processes (MPI's ULFM extensions) "
         "instead of a restart of every rank; fewer than `--min-np` survivors restart as usual"),
    Flag(("--horovod",), dict(action="store_true"),
         "hvdrun's own: runs a script written for Horovod with no edit: in the ranks (and the "
         "processes they start) `import horovod.torch`, `horovod.tensorflow`, "
         "`horovod.tensorflow.keras`, `horovod.keras`, `horovod.mxnet` and `horovod.run` are "
         "hvd_trainer's; refused when a real Horovod is importable"),
    Flag(("--mpiexec",), dict(metavar="PATH"),
         "hvdrun's own: the launcher (default `$HVD_MPIEXEC`, else the one of mpi4py's MPI)"),
    Flag(("--no-prefix",), dict(action="store_true"),
         "hvdrun's own: prints output lines without the rank prefix"),
]

BAYES = ("hvd_trainer's autotuner searches a fixed grid (4 bucket thresholds, overlap on and "
         "off), not by Bayesian optimisation; drop it")
LOG_TIMESTAMP = ("hvd_trainer's log lines carry no timestamp; use --prefix-output-with-timestamp "
                 "to stamp every output line")
REFUSED: List[Refused] = [
    Refused(("--gloo",), 0, "hvd_trainer runs on MPI only; drop --gloo (hvdrun starts the "
                            "ranks through mpiexec)"),
    Refused(("--gloo-timeout-seconds",), 1, "hvd_trainer runs no Gloo operations; use "
                                            "--stall-check-shutdown-time-seconds to end a stuck job"),
    Refused(("--jsrun",), 0, "hvdrun launches through mpiexec, not LSF's jsrun; run `jsrun ... "
                             "python train.py` yourself (hvd_trainer joins any MPI launch)"),
    Refused(("--cycle-time-ms",), 1, "hvd_trainer has no background cycle: a collective starts "
                                     "when it is called; tune batching with --fusion-threshold-mb"),
    Refused(("--cache-capacity",), 1, "hvd_trainer keeps no response cache to size: each "
                                      "collective, and each trainer step as a whole, is agreed "
                                      "in one small exchange; drop it"),
    Refused(("--autotune-bayes-opt-max-samples",), 1, BAYES),
    Refused(("--autotune-gaussian-process-noise",), 1, BAYES),
    Refused(("--timeline-mark-cycles",), 0, "hvd_trainer has no background cycles to mark; "
                                            "the timeline shows each tensor's phases"),
    Refused(("--num-nccl-streams",), 1, "hvd_trainer runs each NCCL communicator on one CUDA "
                                        "stream of its own; the number is fixed"),
    Refused(("--thread-affinity",), 1, "hvd_trainer has no background thread to pin; bind the "
                                       "ranks with --binding-args (e.g. \"-bind-to core\")"),
    Refused(("--log-with-timestamp",), 0, LOG_TIMESTAMP),
    Refused(("--no-log-hide-timestamp",), 0, LOG_TIMESTAMP),
]


def refusal(name: str) -> str:
    """The one line hvdrun prints for the refused flag ``name``."""
    reason = next(entry.reason for entry in REFUSED if name in entry.names)
    return f"hvdrun: error: {name} is not supported: {reason}"


def dest(name: str) -> str:
    """The attribute that the flag ``name`` sets on the parsed arguments (argparse's rule)."""
    for flag in FLAGS:
        if name in flag.names:
            if "dest" in flag.options:
                return flag.options["dest"]
            names = flag.names
            break
    else:
        names = next(entry.names for entry in REFUSED if name in entry.names)
    long_name = next((option for option in names if option.startswith("--")), names[0])
    return long_name.lstrip("-").replace("-", "_")


def add_to(parser: argparse.ArgumentParser) -> None:
    """Add every accepted and every refused flag to ``parser``."""
    for flag in FLAGS:
        parser.add_argument(*flag.names, help=flag.effect.replace("%", "%%"), **flag.options)
    for entry in REFUSED:
        parser.add_argument(*entry.names, action=_Refuse, nargs=entry.nargs, help=argparse.SUPPRESS)


def rank_variables(args: argparse.Namespace, flavour: str) -> Dict[str, str]:
    """The variables the flags set for the ranks (and, under Hydra, for mpiexec itself)."""
    env: Dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env["HVD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.timeline_filename:
        env["HVD_TIMELINE"] = os.path.abspath(args.timeline_filename)
    for flag in ("hierarchical_allreduce", "hierarchical_allgather"):
        if getattr(args, flag) is not None:
            env[f"HVD_{flag.upper()}"] = "1" if getattr(args, flag) else "0"
    if args.autotune is not None:
        env["HVD_AUTOTUNE"] = "1" if args.autotune else "0"
    if args.autotune_log_file:
        env["HVD_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    if args.autotune_warmup_samples is not None:
        env["HVD_AUTOTUNE_WARMUP_SAMPLES"] = str(args.autotune_warmup_samples)
    if args.autotune_steps_per_sample is not None:
        env["HVD_AUTOTUNE_STEPS_PER_SAMPLE"] = str(args.autotune_steps_per_sample)
    if args.no_stall_check:
        env["HVD_STALL_CHECK_TIME_SECONDS"] = env["HVD_STALL_SHUTDOWN_TIME_SECONDS"] = "0"
    else:
        if args.stall_check_time_seconds is not None:
            env["HVD_STALL_CHECK_TIME_SECONDS"] = f"{args.stall_check_time_seconds:g}"
        if args.stall_shutdown_time_seconds is not None:
            env["HVD_STALL_SHUTDOWN_TIME_SECONDS"] = f"{args.stall_shutdown_time_seconds:g}"
    if args.log_level:
        env["HVD_LOG_LEVEL"] = LOG_LEVELS[args.log_level]
    elif args.verbose:
        env["HVD_LOG_LEVEL"] = "debug"
    if args.nics:
        env["NCCL_SOCKET_IFNAME"] = env["UCX_NET_DEVICES"] = ",".join(args.nics)
    if args.tcp:
        env.update(NCCL_IB_DISABLE="1", UCX_TLS="tcp,self,sm", FI_PROVIDER="tcp")
    if args.mpi_threads_disable:
        env["MPI4PY_RC_THREAD_LEVEL"] = "single"
    if args.prefix_output_with_timestamp:
        env[TIMESTAMP_VARIABLE] = "1"
    if args.horovod:
        env[horovod_shim.VARIABLE] = "1"
    ssh = _ssh_options(args)
    if ssh and flavour == HYDRA:
        env["HYDRA_LAUNCHER_EXTRA_ARGS"] = env["I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS"] = ssh
    return env


def launcher_arguments(args: argparse.Namespace, flavour: str) -> List[str]:
    """mpiexec arguments from the flags, in the ``flavour``'s dialect, before the program.

    Raises ValueError when --binding-args or --mpi-args is not a valid shell-quoted string.
    """
    arguments = _split("--binding-args", args.binding_args)
    if flavour == OPENMPI:
        ssh = _ssh_options(args)
        if ssh:
            arguments += ["--mca", "plm_rsh_args", ssh]
        if args.nics:
            arguments += ["--mca", "btl_tcp_if_include", ",".join(args.nics)]
        if getattr(args, "ulfm", False):
            arguments += ["--with-ft", "ulfm"]
    elif args.nics and len(args.nics) == 1:
        arguments += ["-iface", args.nics[0]]
    return arguments + _split("--mpi-args", args.mpi_args)


def _ssh_options(args: argparse.Namespace) -> str:
    """The ssh options that -p and -i ask for, as one string ('' when neither is given)."""
    options: List[str] = []
    if args.ssh_port is not None:
        options += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        options += ["-i", args.ssh_identity_file]
    return shlex.join(options)


def _split(flag: str, text: str) -> List[str]:
    """Split a shell-quoted flag value; the error names the flag."""
    try:
        return shlex.split(text)
    except ValueError as error:
        raise ValueError(f"{flag} {text!r}: {error}") from None
