"""An engine's agent on one host (a Ray actor, a Spark barrier task): runs the MPI launcher's
proxy command for this host, in place of ssh, and carries back the results of the ranks that
the proxy started here.

The proxy dies with the agent's process (PR_SET_PDEATHSIG), and hvdrun's wrapper ends its rank
when the proxy goes, so killing an agent leaves no process behind on its host; its folder,
which SIGKILL keeps it from removing, goes with the next job's agent there (owned_folders).

The agent hands its ranks, in the proxy's environment, what the MPI launcher must not carry
(its control port is open to anyone who can reach it): the secret that signs the function and
results, and the job's secret that signs the wrappers' reports to hvdrun (derived from it:
protocol.engine_job_secret). It also writes hvd_trainer's horovod shim into its folder, which
each rank puts on its path where no Horovod is installed (engines/rank.py).
"""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
from typing import Dict, List, Optional

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines.calls import HostOutcome
from hvd_trainer_launch.files import owned_folders, signed
from hvd_trainer_launch.processes import die_with_parent, identity
from hvd_trainer_launch.rank import horovod_shim

# The agents' folders in the temporary folder: "hvd_engine." and their maker (owned_folders).
FOLDER_PREFIX = "hvd_engine."

# After a signal asks the proxy to end, how long before it is SIGKILLed.
_KILL_GRACE_SECONDS = 5.0
# How much of the end of the proxy's messages comes back.
_MESSAGE_BYTES = 4096


def hostname() -> str:
    """The name this host goes by in the job (its rank layout and messages)."""
    return socket.gethostname()


def run_proxy(line: str, payload: bytes, secret: bytes,
              env: Optional[Dict[str, str]] = None, outlive: bool = False) -> HostOutcome:
    """Run the proxy ``line`` (what the MPI launcher handed over for this host) with the
    pickled (function, args, kwargs) ``payload`` where this host's ranks find it, wait for it,
    and return this host's outcomes. The job's ``secret`` (the engine launch's: AgentLaunch's
    ``secret``) signs the files in between, and the reports (protocol.engine_job_secret);
    ``env``: more variables for the proxy and its ranks. The ranks end when this process
    dies (their wrappers watch it); so does the proxy, unless ``outlive`` (an elastic job
    under --ulfm: Open MPI 5's runtime ends the whole job when it loses a host's daemon, so
    the daemon stays, its ranks gone, until the launcher ends it with the life)."""
    owned_folders.sweep(FOLDER_PREFIX)  # what agents killed on this host left
    folder = owned_folders.make(FOLDER_PREFIX)
    try:
        signed.write_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), secret, payload)
        horovod_shim.write(os.path.join(folder, protocol.ENGINE_SHIM_FOLDER))
        env = {**os.environ, **(env or {}), protocol.ENGINE_FOLDER_VARIABLE: folder,
               protocol.ENGINE_SECRET_VARIABLE: secret.hex(),
               protocol.SECRET_VARIABLE: protocol.engine_job_secret(secret),
               protocol.ENGINE_WORKDIR_VARIABLE: os.getcwd(),
               protocol.ENGINE_AGENT_VARIABLE: identity(os.getpid())}
        # The proxy's own messages (the ranks' output travels to mpiexec, not here).
        messages = tempfile.TemporaryFile()
        # Outliving the agent, the proxy is no child of it: Ray's workers kill their own
        # children as they exit (RAY_kill_child_processes_on_worker_exit), not their
        # grandchildren; the shell in between waits for it and exits with its status.
        argv = ["/bin/sh", "-c", f"{line} & wait $!"] if outlive else shlex.split(line)
        proxy = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                 stderr=messages, start_new_session=True,
                                 preexec_fn=None if outlive else die_with_parent())
        try:
            code = proxy.wait()
        except BaseException:  # the engine interrupts the agent: end the proxy first
            _end(proxy)
            raise
        messages.seek(max(0, messages.seek(0, os.SEEK_END) - _MESSAGE_BYTES))
        said = messages.read().decode(errors="replace")
        messages.close()
        outcomes = {}
        prefix = protocol.ENGINE_RESULT.format(rank="")
        for name in os.listdir(folder):
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                outcomes[int(name[len(prefix):])] = signed.read_signed(
                    os.path.join(folder, name), secret)
        return HostOutcome(hostname(), code if code >= 0 else 128 - code, outcomes, said,
                           _events(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# The folders, in the temporary folder, where an elastic job's agent keeps the commits of its
# host's ranks across lives (owned_folders: swept once the agent is gone).
COMMITS_PREFIX = "hvd_engine_commits."


class ElasticAgent:
    """An agent's side of an elastic engine job (engines.elastic) on one host, alive for the
    whole job: it runs the proxy line of each life it takes part in (:meth:`run_life`), its
    ranks keeping their commits in a private folder of its own that outlives the lives (the
    next life's ranks here restore from it), removed by :meth:`close` or, when the agent is
    killed, by the next agent on the host that starts or closes."""

    def __init__(self):
        owned_folders.sweep(COMMITS_PREFIX)
        self.commits = owned_folders.make(COMMITS_PREFIX)

    def run_life(self, line: str, payload: bytes, secret: bytes,
                 env: Optional[Dict[str, str]] = None, ulfm: bool = False) -> HostOutcome:
        """Run one life's proxy ``line`` as :func:`run_proxy` (``env``: more variables for
        the proxy and its ranks, such as a Spark task's resources; ``ulfm``: the job runs
        under --ulfm, whose proxy outlives the agent); this host's outcomes."""
        return run_proxy(line, payload, secret,
                         {**(env or {}), protocol.ENGINE_COMMITS_VARIABLE: self.commits},
                         outlive=ulfm)

    def close(self) -> None:
        """Remove the commits' folder (the job is over), and those that killed agents left on
        this host."""
        shutil.rmtree(self.commits, ignore_errors=True)
        owned_folders.sweep(COMMITS_PREFIX)


def _events(folder: str) -> List[str]:
    """The events the ranks in ``folder`` logged (protocol.ENGINE_EVENTS: JSON lines, which
    the driver parses, never unpickles), by rank, each in its order."""
    prefix = protocol.ENGINE_EVENTS.format(rank="")
    ranks = sorted(int(name[len(prefix):]) for name in os.listdir(folder)
                   if name.startswith(prefix) and name[len(prefix):].isdigit())
    events = []
    for rank in ranks:
        with open(os.path.join(folder, protocol.ENGINE_EVENTS.format(rank=rank)),
                  errors="replace") as file:
            events += [line.rstrip("\n") for line in file if line.strip()]
    return events


def _end(proxy: subprocess.Popen) -> None:
    """SIGTERM the proxy's session, then SIGKILL it if it lingers."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proxy.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proxy.wait(_KILL_GRACE_SECONDS)
            return
        except subprocess.TimeoutExpired:
            pass
