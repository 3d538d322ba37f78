"""One MPI job of hvdrun, start to end: the ranks' environment, then mpiexec run under watch.

The output goes through the relay (hvd_trainer_launch/job/relay.py), the reports through the report port;
after the first failure or a signal the job is ended, and whatever mpiexec started on this
host that outlives it is killed (hvd_trainer_launch/processes.py). hvdrun's plain mode runs one such job,
its elastic mode one per life (hvd_trainer_launch/elastic/driver.py).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.job import flags, reports, unreached
from hvd_trainer_launch.job.relay import OutputRelay, say
from hvd_trainer_launch.processes import die_with_parent, kill_processes, launched

# After the first failure, how long the other ranks get to report before mpiexec is told to end
# the job (Hydra does not end it by itself when a rank exits non-zero).
FAILURE_GRACE_SECONDS = 3.0
# After asking mpiexec to end the job (failure or signal), how long before it is SIGKILLed;
# at once when some ranks never started and every started one has exited (_Watch.check).
KILL_GRACE_SECONDS = 5.0
# When mpiexec exits 0 before every started rank reported its exit (Open MPI's mpirun does
# when it loses a host's daemon), how long the ranks' wrappers get to report: they end their
# rank when their proxy goes (SIGTERM, then SIGKILL 2 s later) and report then.
EXIT_REPORT_GRACE_SECONDS = 5.0

def rank_environment(args: argparse.Namespace, flavour: str) -> Dict[str, str]:
    """The caller's whole environment plus the variables that the flags set."""
    env = dict(os.environ)
    for name, value in protocol.NO_FINALIZE_WAIT_VARIABLES.items():  # mpirun passes OMPI_MCA_* on
        env.setdefault(name, value)
    env.update(flags.rank_variables(args, flavour))
    return env


class EngineJob(NamedTuple):
    """What an engine launch (engines.launch) tells hvdrun: the job's secret (hex text), which
    the agents give the ranks, and the names of its variables for the ranks."""

    secret: str
    variables: Tuple[str, ...]


def engine_job(environ: Dict[str, str]) -> Optional[EngineJob]:
    """The engine launch's request, taken out of ``environ`` (hvdrun's own, so that it
    reaches no rank); None outside an engine launch."""
    secret = environ.pop(protocol.ENGINE_JOB_SECRET_VARIABLE, None)
    names = environ.pop(protocol.ENGINE_RANK_VARIABLES_VARIABLE, "[]")
    return EngineJob(secret, tuple(json.loads(names))) if secret else None


# What of hvdrun's environment the MPI launcher itself needs in an engine job, besides the
# variables for the ranks: where its programs and libraries are, and the MPIs' own settings
# (and, under Open MPI, what its launcher agent engines.ssh needs: Python's path, the shell
# that mpirun writes the daemon's command for, the engine launch's key).
_LAUNCHER_NEEDS = ("PATH", "LD_LIBRARY_PATH", "TMPDIR", "HOME", "LANG", "SHELL", "PYTHONPATH",
                   protocol.ENGINE_LAUNCH_SECRET_VARIABLE)
_LAUNCHER_SETTINGS = ("HYDRA_", "MPIEXEC_", "MPIR_CVAR_", "MPICH_", "I_MPI_", "OMPI_", "OPAL_",
                      "PMIX_", "PRTE_")
_LAST_VARIABLE = "HVD_LAUNCHER_END"


def launcher_environment(env: Dict[str, str], forwarded: Optional[List[str]]) -> Dict[str, str]:
    """The MPI launcher's own environment: ``env`` whole in a plain job; in an engine job only
    the variables ``forwarded`` to the ranks and those it needs itself, since MPICH's mpiexec
    sends its whole environment to whoever connects to its control port as a proxy (the
    proxies, not mpiexec, keep only the forwarded ones for the ranks)."""
    if forwarded is None:
        return env
    kept = {name: value for name, value in env.items()
            if name in forwarded or name in _LAUNCHER_NEEDS or name.startswith(_LAUNCHER_SETTINGS)}
    # MPICH 5.0.2's proxies never find the last variable of mpiexec's environment among those
    # that -genvlist names (measured: the ranks lacked it); one that no rank needs goes last.
    kept.pop(_LAST_VARIABLE, None)
    kept[_LAST_VARIABLE] = "1"
    return kept


def engine_forwarded(engine: EngineJob, own: Dict[str, str]) -> List[str]:
    """The variables the MPI launcher passes to an engine job's ranks: the caller's, the MPI
    finalize ones, and ``own`` (those hvdrun set), never the job's secret, which the agents
    give the ranks."""
    names = {*engine.variables, *protocol.NO_FINALIZE_WAIT_VARIABLES, *own}
    return sorted(names - {protocol.SECRET_VARIABLE})


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


class SshLaunch(NamedTuple):
    """A job whose launcher reaches the remote hosts by ssh (not an engine's agents): the
    port -p gave, if any."""

    port: Optional[int] = None


def ssh_launch(args: argparse.Namespace, environ: Dict[str, str],
               engine: bool) -> Optional[SshLaunch]:
    """How this job's launcher reaches remote hosts: by ssh (with -p's port), or None for an
    ``engine``'s job (its agents start the ranks) and inside a Slurm allocation (srun does)."""
    if engine or "SLURM_JOB_ID" in environ:
        return None
    return SshLaunch(args.ssh_port)


def run_job(command: List[str], env: Dict[str, str], relay: OutputRelay,
            np: int = 0, start_timeout: Optional[float] = None,
            failure_grace: Optional[float] = FAILURE_GRACE_SECONDS,
            ssh: Optional[SshLaunch] = None) -> int:
    """Run the mpiexec ``command`` to the end and return hvdrun's exit code.

    mpiexec gets its own session so that a terminal's Ctrl-C reaches only hvdrun, which forwards
    it; after a failure or a signal the job is ended, and SIGKILLed if it lingers. mpiexec is
    SIGKILLed by the kernel when hvdrun dies (even by SIGKILL), and the ranks' wrappers end
    their ranks when mpiexec goes. With
    ``start_timeout``, a job whose ``np`` ranks have not all started by then is ended with code 1.
    ``failure_grace`` is how long the other ranks get to report after the first failure
    (None: a failure does not end the job, whose survivors go on: hvdrun --ulfm). ``ssh``:
    the launcher reaches remote hosts by ssh, so a launch that fails before ranks start
    names the hosts ssh could not reach and why.
    """
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, preexec_fn=die_with_parent())
    readers = [threading.Thread(target=relay.relay, args=(process.stdout, sys.stdout.buffer), daemon=True),
               threading.Thread(target=relay.relay, args=(process.stderr, sys.stderr.buffer), daemon=True)]
    for reader in readers:
        reader.start()
    watch = _Watch(process, relay, np, start_timeout, failure_grace)
    # Forward signals while the job runs; the caller's handlers come back afterwards.
    previous = {signum: signal.signal(signum, watch.signalled)
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    while process.poll() is None:
        watch.check(time.monotonic())
        time.sleep(0.05)
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    kill_processes({**watch.left, **launched(process.pid)})
    for reader in readers:  # a process that outlived mpiexec may hold its pipes: do not wait forever
        reader.join(KILL_GRACE_SECONDS)
    if not any(reader.is_alive() for reader in readers):
        relay.close()
    if watch.received:
        return 128 + watch.received[0]
    code = process.returncode if process.returncode >= 0 else 128 - process.returncode
    return _exit_code(command[0], code, relay, np, watch.ending, ssh)


class _Watch:
    """One job's watch while mpiexec runs: the signals received (the first is forwarded, a
    second kills), the start timeout, the end after the first failure, and the SIGKILL of a
    job that lingers, with what mpiexec had started when it was told to end (``left``)."""

    def __init__(self, process: subprocess.Popen, relay: OutputRelay, np: int,
                 start_timeout: Optional[float], failure_grace: Optional[float]):
        self.process, self.relay, self.np = process, relay, np
        self.start_timeout, self.failure_grace = start_timeout, failure_grace
        self.start_deadline = None if start_timeout is None else time.monotonic() + start_timeout
        self.received: List[int] = []
        self.handled = 0
        self.ending = False
        self.kill_at: Optional[float] = None
        self.left: Dict[int, bytes] = {}

    def signalled(self, signum: int, _frame) -> None:
        self.received.append(signum)

    def waits_for_unstarted(self) -> bool:
        """Whether all that keeps mpiexec from ending is ranks that never started (their
        agent lost, their host out of reach): Hydra waits for their proxies even once told to
        end, while every rank that did start has exited and been reported (its wrapper has
        cleaned up), so nothing needs the kill grace."""
        return bool(_unstarted(self.relay, self.np)) and self.relay.started <= self.relay.exited

    def check(self, now: float) -> None:
        """Act on what happened since the last check."""
        process, relay = self.process, self.relay
        if self.start_deadline is not None and now >= self.start_deadline:
            self.start_deadline = None
            missing = _unstarted(relay, self.np)
            if missing:
                relay.not_started(missing, self.start_timeout)
        if len(self.received) > self.handled:
            self.handled = len(self.received)
            if self.handled == 1:
                relay.interrupted = True
                say(f"received {signal.Signals(self.received[0]).name}; ending the job")
                self.left.update(launched(process.pid))  # mpiexec may orphan them as it ends
                process.send_signal(self.received[0])
                self.ending, self.kill_at = True, now + KILL_GRACE_SECONDS
            else:
                self.kill_at = now
        first = relay.first_report()
        # After a start timeout (the only failure chosen before this) nobody is left to report.
        if first is not None and not self.ending and (relay.failure is not None or (
                self.failure_grace is not None and now >= first + self.failure_grace)):
            relay.settle()
            relay.ending = True
            self.left.update(launched(process.pid))
            process.terminate()
            self.ending, self.kill_at = True, now + KILL_GRACE_SECONDS
        if self.ending and self.kill_at is not None and self.waits_for_unstarted():
            self.kill_at = now
        if self.kill_at is not None and now >= self.kill_at:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            kill_processes({**self.left, **launched(process.pid)})
            self.kill_at = None


def _unstarted(relay: OutputRelay, np: int) -> List[int]:
    """The ranks of a job of ``np`` whose start ``relay`` has not seen, in order."""
    return sorted(set(range(np)) - relay.started)


def _exit_code(launcher: str, code: int, relay: OutputRelay, np: int, ending: bool,
               ssh: Optional[SshLaunch]) -> int:
    """hvdrun's exit code for a job whose mpiexec (``launcher``) exited with ``code``: the
    first failure's, or 1 where ranks were lost unseen or none started, with a message (and,
    for ranks not started on hosts reached by ``ssh``, what stopped ssh)."""
    unexited = relay.unexited(EXIT_REPORT_GRACE_SECONDS) if code == 0 and not ending else []
    failure = relay.settle()
    missing = _unstarted(relay, np)
    if code and missing and ssh is not None:
        # Also when ranks that did start failed: mpiexec ends them once a host is out of reach.
        for host, why in unreached.unreached(relay.hosts_of(missing), ssh.port).items():
            say(f"host {host} {why}")
    if failure is not None:
        return failure.code or 1
    if unexited:
        say(f"{launcher} exited with code 0, but {relay.ranks(unexited)} never reported "
            "an exit: their host's MPI daemon or proxy was lost (killed, or its host went "
            "down); failing the job")
        return 1
    if code and missing:
        say(f"{launcher} exited with code {code} before {relay.ranks(missing)} started; "
            "its messages above say why (e.g. ssh could not reach a host)")
    elif code:
        say(f"{launcher} exited with code {code}; no rank reported its own exit (a rank that "
            "calls MPI_Abort is killed before it can)")
    elif np and len(missing) == np:
        say(f"{launcher} exited with code 0 but no rank reported its start: it started "
            "none (is it an MPI launcher? see --mpiexec and HVD_MPIEXEC), or the ranks could "
            "not reach hvdrun's report port (their warnings above say so)")
        return 1
    return code
