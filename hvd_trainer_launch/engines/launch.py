"""The launching side of an engine job (hvd_trainer.spark, hvd_trainer.ray): hvdrun with an
MPI launcher that starts no proxy itself but hands each host's proxy command line to the
engine's agents instead of ssh (what the ranks send back is calls.py's).

Under MPICH, its manual launcher (``mpiexec -launcher manual``) prints the lines. Open MPI has
none: its mpirun calls a launcher agent in place of ssh (``--mca plm_rsh_agent``: ssh.py),
which hands each line over a Unix socket in this launch's private folder, signed with the
launch's secret. mpirun is given a name of its own for each host (``hvd-agent<N>-<host>``),
so that it starts even its own host's daemon through the agent there, as Hydra does: the ranks
are the agents' descendants on every host, and the ranks put their host's own name back in
HOROVOD_HOSTNAME (rank.py).

hvdrun runs as it does for a script (its wrapper per rank, HOROVOD_* variables, the report
port, a failure naming its rank and host, the start timeout), under the guard that ends the
job when this process dies. Its output is shown as it comes, except the launcher's
``HYDRA_LAUNCH`` lines, which are kept for the agents; its own messages are kept too, for the
error that a failed job raises.

What the MPI launcher carries to the hosts (its control port, or mpirun's, is open to anyone
who reaches it) is only what the ranks may show: the caller's ``env`` and hvdrun's own
variables. The secrets travel through the engine instead: the caller gives the job's secret
to each agent (agent.py), which hands it to its ranks; this process's environment does not
travel at all (a rank's is its agent's, plus those variables).
"""
import collections
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Deque, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.elastic.driver import sweep_job_folders
from hvd_trainer_launch.engines.calls import EngineError, EngineTimeout
from hvd_trainer_launch.files import owned_folders
from hvd_trainer_launch.job.relay import START_TIMEOUT_TEXT

# After asking hvdrun to end the job, how long before it is SIGKILLed.
_KILL_GRACE_SECONDS = 10.0
# hvdrun's own lines on stderr start so.
_HVDRUN_MESSAGE = b"hvdrun: "
# The socket, in the launch's private folder, where Open MPI's launcher agent hands the lines.
_AGENT_SOCKET = "agent.sock"
# The launches' private folders in the temporary folder (owned_folders).
FOLDER_PREFIX = "hvd_engine_launch."
# How many of the MPI launcher's own last lines on stderr are kept, and how much of each.
_LAUNCHER_LINES = 20
_LAUNCHER_LINE_BYTES = 1000


def check_launcher(mpiexec: Optional[str] = None) -> mpi.Launcher:
    """The MPI launcher that matches mpi4py's library (MPICH's Hydra or Open MPI's mpirun);
    EngineError naming what is missing when there is none. It loads the MPI library here,
    whose UCX takes over SIGHUP (its debug signal): ask on the driver, never in an agent, which
    must die with its engine's worker (a Spark worker is ended by SIGHUP)."""
    try:
        return mpi.find_launcher(mpiexec)
    except mpi.MPIError as error:
        raise EngineError(str(error)) from None


def agent_names(hosts: Sequence[str]) -> List[str]:
    """The names under which Open MPI's mpirun is given ``hosts``: one of its own for each, so
    that mpirun takes none for its own host (which it would start itself, not through the
    agent there), without a dot (mpirun cuts a name at its first dot)."""
    return [agent_name(index, host) for index, host in enumerate(hosts)]


def agent_name(index: int, host: str) -> str:
    """The name of agent ``index`` of a job, on ``host``: ``hvd-agent<index>-<host>``, the
    host's name up to its first dot with other characters than letters, digits and ``-``
    made ``-``."""
    return f"hvd-agent{index}-{re.sub(r'[^A-Za-z0-9-]', '-', host.split('.')[0])}"


class HostRanks(NamedTuple):
    """A host of a job's layout and how many ranks it runs."""

    host: str
    ranks: int


class LifeLines(NamedTuple):
    """One life of an elastic engine job (``AgentLaunch(on_life=...)``): its number (the
    restarts before it), its hosts with their ranks in rank order, and each host's proxy
    command line, in the same order. A life that grows in place comes again, with the same
    number: the hosts it adds, and theirs."""

    number: int
    hosts: List[HostRanks]
    lines: List[str]


class AgentLaunch:
    """hvdrun running ``command`` on the ranks of ``hosts`` ((name, ranks) in rank order)
    with no ssh: :meth:`proxies` gives the command line each host's agent must run,
    :meth:`wait` the job's exit code.

    ``flavour``: the launcher's (mpi.HYDRA or mpi.OPENMPI, from :func:`check_launcher` on
    the driver); ``secret``: the job's 32 random bytes, which the caller hands each agent
    (agent.run_proxy) through the engine, never through the MPI launcher; ``env``:
    variables for the ranks, which with hvdrun's own are all that the launcher carries (the
    rest of a rank's environment is its agent's: this process's does not travel);
    ``out``/``err``: streams for the ranks' output and hvdrun's messages (default: ours);
    ``mpi_args``: more arguments for the MPI launcher, word by word; ``hvdrun_args``: more of
    hvdrun's flags (--network-interfaces, --prefix-output-with-timestamp).

    Elastic (``on_life`` given): ``hosts`` is empty, ``hvdrun_args`` hold hvdrun's elastic
    flags (its host discovery names the hosts, by names that are theirs alone in the job:
    engines.elastic), and hvdrun runs one life after another; ``on_life`` gets each life's
    :class:`LifeLines` once the launcher has handed over all its lines, and
    :meth:`proxies` is not used; hvdrun reads the agents the engine lost in the file
    ``lost_file`` (protocol.ENGINE_LOST_VARIABLE)."""

    def __init__(self, hosts: Sequence[Tuple[str, int]], command: Sequence[str], *,
                 flavour: str, secret: bytes, env: Optional[Dict[str, str]] = None,
                 start_timeout: Optional[float] = None, mpi_args: Sequence[str] = (),
                 out=None, err=None, verbose: bool = False, hvdrun_args: Sequence[str] = (),
                 on_life: Optional[Callable[[LifeLines], None]] = None,
                 lost_file: Optional[str] = None):
        self.hosts = [(name, count) for name, count in hosts]
        self._lost_file = lost_file
        self._on_life = on_life
        # The life whose lines are being handed over (one life alone without on_life), its
        # lines by the host's place in it, and Open MPI's lines that came before its life did.
        self._life: Optional[protocol.EngineLife] = \
            None if on_life else protocol.EngineLife(0, self.hosts)
        self._lines: Dict[int, str] = {}
        self._early: Dict[str, str] = {}
        self._lock = threading.Lock()
        self._announced = threading.Event()
        self.messages: List[str] = []  # hvdrun's own lines, and the ranks' wrappers'
        # The launcher's own lines on stderr (the end of them), for a launch that fails.
        self.launcher_messages: Deque[str] = collections.deque(maxlen=_LAUNCHER_LINES)
        self._listener: Optional[socket.socket] = None
        self._watching, self._process, self._readers = -1, None, []
        owned_folders.sweep(FOLDER_PREFIX)  # what launches whose driver was killed left
        self._folder = owned_folders.make(FOLDER_PREFIX)  # the guard's to remove if we die
        try:
            self._start(command, flavour, secret, dict(env or {}), start_timeout, mpi_args,
                        verbose, hvdrun_args)
        except BaseException:
            self._close()
            raise
        self._readers = [
            threading.Thread(target=self._read_stdout, args=(out or sys.stdout.buffer,),
                             daemon=True),
            threading.Thread(target=self._read_stderr, args=(err or sys.stderr.buffer,),
                             daemon=True)]
        for reader in self._readers:
            reader.start()

    def _start(self, command: Sequence[str], flavour: str, secret: bytes,
               env: Dict[str, str], start_timeout: Optional[float], mpi_args: Sequence[str],
               verbose: bool, hvdrun_args: Sequence[str]) -> None:
        """Start hvdrun under the guard: its environment is ours with ``env``, the job's
        secret and the names of ``env`` (protocol.ENGINE_*), which it passes to the ranks."""
        run_env = dict(os.environ)
        run_env.update(env)
        run_env[protocol.ENGINE_JOB_SECRET_VARIABLE] = protocol.engine_job_secret(secret)
        run_env[protocol.ENGINE_RANK_VARIABLES_VARIABLE] = json.dumps(sorted(env))
        if self._on_life is not None:
            run_env[protocol.ENGINE_LIVES_VARIABLE] = "1"
            if self._lost_file:
                run_env[protocol.ENGINE_LOST_VARIABLE] = self._lost_file
            own = list(protocol.MANUAL_LAUNCHER_ARGUMENTS) if flavour == mpi.HYDRA \
                else self._serve_agent(run_env)
            names = []
        elif flavour == mpi.HYDRA:
            names, own = [name for name, _ in self.hosts], list(protocol.MANUAL_LAUNCHER_ARGUMENTS)
        else:
            hosts = [name for name, _ in self.hosts]
            twice = sorted({name for name in hosts if hosts.count(name) > 1})
            if twice:  # e.g. two Ray nodes on one machine
                raise EngineError(
                    f"{', '.join(twice)} holds several agents, and Open MPI's daemons collide on "
                    "one machine (each reports the machine's name to mpirun): run one agent per "
                    "machine, or use MPICH (pip install mpich mpi4py)")
            names, own = agent_names(hosts), self._serve_agent(run_env)
        size = sum(count for _, count in self.hosts)
        arguments = ["-np", str(size), "-H", ",".join(
            f"{name}:{count}" for name, (_, count) in zip(names, self.hosts))] if names else []
        arguments.append("--mpi-args=" + shlex.join([*own, *mpi_args]))
        if start_timeout is not None:
            arguments += ["--start-timeout", str(start_timeout)]
        if verbose:
            arguments.append("--verbose")
        arguments += list(hvdrun_args)
        watched, self._watching = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "hvd_trainer_launch.cli.guard", str(watched), self._folder,
                 *arguments, "--", *command],
                env=run_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(watched,), start_new_session=True,
                cwd="/")  # mpiexec's folder must exist on every host
        finally:
            os.close(watched)

    def _serve_agent(self, env: Dict[str, str]) -> List[str]:
        """Listen for Open MPI's launcher agent (ssh.py) in this launch's folder, and give
        it the launch's secret through ``env``; mpirun's arguments that make it call the agent
        in place of ssh, for every host at once (no tree), its daemons staying in the
        foreground (each is the process its agent runs, and dies with it)."""
        path = os.path.join(self._folder, _AGENT_SOCKET)
        agent = [sys.executable, "-m", "hvd_trainer_launch.engines.ssh", path]
        if any(any(c.isspace() for c in word) for word in agent):  # mpirun splits at spaces
            raise EngineError(f"Open MPI's mpirun cannot call {' '.join(agent)!r} as its "
                              "launcher agent: a path holds a space; run from a Python (and "
                              "a temporary folder, TMPDIR) whose paths have none")
        secret = os.urandom(32)
        env[protocol.ENGINE_LAUNCH_SECRET_VARIABLE] = secret.hex()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(socket.SOMAXCONN)
        threading.Thread(target=self._take_lines, args=(self._listener, secret),
                         daemon=True, name="hvd-engine-agent").start()
        return ["--mca", "plm_rsh_agent", " ".join(agent), "--mca", "plm_rsh_no_tree_spawn",
                "1", "--leave-session-attached"]

    def _names(self) -> List[str]:
        """The names under which mpirun knows the hosts of the life being handed over: their
        own in an elastic job (made for the job), else :func:`agent_names`."""
        hosts = [name for name, _ in self._life.hosts]
        return hosts if self._on_life else agent_names(hosts)

    def _take_lines(self, listener: socket.socket, secret: bytes) -> None:
        """Keep the line the launcher agent hands for each host of each life."""
        while not self._announced.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the launch is over
                return
            with conn:
                try:
                    found = protocol.receive_proxy_line(conn, secret)
                except (OSError, ValueError):  # not this launch's agent, or it went away
                    continue
            with self._lock:
                self._early[found.host] = found.line
                self._take_early()

    def _take_early(self) -> None:
        """(Under the lock.) Take the Open MPI lines of the life being handed over; once it
        has them all, it is handed on."""
        if self._life is None:
            return
        names = self._names()
        for name in [name for name in self._early if name in names]:
            self._lines.setdefault(names.index(name), self._early.pop(name))
        if len(self._lines) == len(names):
            self._handed_over()

    def _handed_over(self) -> None:
        """(Under the lock.) Every line of the life is in: hand it to ``on_life``, or, for
        the one job of a launch that is not elastic, to :meth:`proxies`."""
        if self._on_life is None:
            self._announced.set()
            return
        life, lines = self._life, self._lines
        self._life, self._lines = None, {}
        if len(lines) != len(life.hosts):  # hosts without a line: their ranks would never come
            self.messages.append(f"the MPI launcher handed over {len(lines)} proxy commands for "
                                 f"the {len(life.hosts)} hosts announced; ending the job")
            self._process.send_signal(signal.SIGTERM)
            return
        self._on_life(LifeLines(life.number, [HostRanks(host, ranks) for host, ranks in life.hosts],
                                [lines[index] for index in range(len(life.hosts))]))

    def _read_stdout(self, out) -> None:
        """Keep the manual launcher's proxy lines and hvdrun's life lines, show the rest."""
        prefix = protocol.MANUAL_LAUNCH_PREFIX.encode()
        end = protocol.MANUAL_LAUNCH_END.encode()
        life = protocol.ENGINE_LIFE_PREFIX.encode()
        for line in iter(self._process.stdout.readline, b""):
            if self._announced.is_set():
                _show(out, line)
                continue
            with self._lock:
                if line.startswith(life) and self._on_life is not None:
                    self._life, self._lines = protocol.parse_life_line(line.decode().strip()), {}
                    self._take_early()
                elif line.startswith(prefix) and self._life is not None:
                    self._lines[len(self._lines)] = line[len(prefix):].decode().strip()
                elif line.strip() == end and self._life is not None:
                    self._handed_over()
                else:
                    _show(out, line)
        self._announced.set()  # hvdrun ended before announcing: proxies() sees no lines

    def _read_stderr(self, err) -> None:
        """Show hvdrun's stderr, keeping its own messages, the ranks' wrappers' (``[N]<stderr>:
        hvdrun: ...``: a command that cannot run, a rank killed by SIGBUS) and the end of the
        MPI launcher's own lines."""
        for line in iter(self._process.stderr.readline, b""):
            # Open MPI's help messages end with a NUL byte, which then leads the next line.
            text = line.lstrip(b"\0").rstrip()
            ranked = protocol.LINE_PREFIX.match(text)
            said = text[ranked.end():] if ranked and not protocol.is_continued(ranked[3]) \
                else b""
            if text.startswith(_HVDRUN_MESSAGE):
                self.messages.append(text[len(_HVDRUN_MESSAGE):].decode(errors="replace"))
            elif said.startswith(_HVDRUN_MESSAGE):
                self.messages.append(f"rank {int(ranked[1])}: "
                                     + said[len(_HVDRUN_MESSAGE):].decode(errors="replace"))
            elif text and not ranked:
                self.launcher_messages.append(text[:_LAUNCHER_LINE_BYTES].decode(errors="replace"))
            _show(err, line)

    def said(self) -> str:
        """hvdrun's messages, then the MPI launcher's own lines, for an error."""
        return "; ".join(self.messages) + "".join(
            f"\nthe MPI launcher said: {line}" for line in self.launcher_messages)

    def proxies(self, timeout: Optional[float] = None) -> List[str]:
        """The proxy command line of each host, in the order of ``hosts``; EngineError when
        hvdrun ends (or ``timeout`` passes) before the launcher handed them all over."""
        if not self._announced.wait(timeout):
            self.end()
            raise EngineTimeout(f"the MPI launcher handed over no proxy commands within "
                                f"{timeout:g} s of its start")
        lines = dict(self._lines)
        if len(lines) != len(self.hosts):
            code = self.wait()
            raise EngineError(
                f"the MPI launcher handed over {len(lines)} proxy commands for "
                f"{len(self.hosts)} hosts and hvdrun exited with code {code}: "
                + (self.said() or "see its output above"))
        return [lines[index] for index in range(len(self.hosts))]

    def start_timed_out(self) -> bool:
        """Whether hvdrun ended the job because ranks did not start within start_timeout."""
        return any(START_TIMEOUT_TEXT in message for message in self.messages)

    def poll(self) -> Optional[int]:
        """hvdrun's exit code, or None while it runs."""
        return self._process.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for hvdrun (subprocess.TimeoutExpired after ``timeout``) and its output; return
        its exit code."""
        code = self._process.wait(timeout)
        for reader in self._readers:
            reader.join(_KILL_GRACE_SECONDS)
        self._close()
        return code

    def end(self, signum: int = signal.SIGTERM) -> int:
        """Ask hvdrun to end the job (as on ``signum``), SIGKILL it if it lingers; its code."""
        if self._process.poll() is None:
            try:
                self._process.send_signal(signum)
                self._process.wait(_KILL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
                sweep_job_folders()  # what its finally would have removed
            except ProcessLookupError:
                pass
        return self.wait()

    def _close(self) -> None:
        """Close the guard's pipe and the launcher agent's socket; remove the folder."""
        if self._watching >= 0:
            os.close(self._watching)
            self._watching = -1
        if self._listener is not None:
            try:  # wakes the thread that waits in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        shutil.rmtree(self._folder, ignore_errors=True)


def _show(out, data: bytes) -> None:
    """Write ``data`` to ``out``, a binary or text stream; a reader gone is ignored."""
    try:
        out.write(data.decode(errors="replace") if isinstance(out, io.TextIOBase) else data)
        out.flush()
    except (BrokenPipeError, ValueError):
        pass


def rank_layout(hosts: Iterable[str]) -> List[HostRanks]:
    """The hosts of the agents' slots, one entry per slot, as (host, ranks) in order of first
    appearance: the ranks on one host are consecutive and share local_rank/local_size."""
    counts: Dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    return [HostRanks(host, ranks) for host, ranks in counts.items()]


def host_of_ranks(layout: Sequence[Tuple[str, int]]) -> Dict[int, str]:
    """Each rank's host under ``layout``."""
    hosts, rank = {}, 0
    for host, count in layout:
        for _ in range(count):
            hosts[rank] = host
            rank += 1
    return hosts


def rank_command(executable: Optional[str] = None) -> List[str]:
    """The command each rank runs: engines.rank under ``executable`` (default: this Python,
    whose path must exist on every host)."""
    return [executable or sys.executable, "-m", "hvd_trainer_launch.engines.rank"]
