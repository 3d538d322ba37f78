"""horovod.ray's ``RayExecutor`` over hvd_trainer's engine mechanism: Ray actors are the
agents that run the MPI launcher's proxies; each call is one MPI job, and an executor runs
one at a time (a second call waits for the first, as calls on Horovod's actors queue)."""
import os
import re
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from hvd_trainer_launch import engine_agent, engine_checks, engine_launch
from hvd_trainer_launch.engine_launch import EngineError, EngineTimeout, LostAgent

# After hvdrun has ended, how long the agents get to return before they count as lost.
_AGENT_GRACE_SECONDS = 15.0
# How much of what Ray says of a lost actor an EngineError quotes.
_CAUSE_CHARS = 600
_ELASTIC = ("elastic Ray jobs are not supported: hvd_trainer's elastic mode needs hvdrun to "
            "add and remove hosts, which a Ray placement group does not do; run elastic jobs "
            "with hvdrun --min-np/--max-np (docs/limitations.md)")


class Settings:
    """What :meth:`RayExecutor.create_settings` returns: ``timeout_s`` bounds each job's start
    (hvdrun's --start-timeout), ``placement_group_timeout_s`` the wait for resources."""

    def __init__(self, timeout_s: float = 30, placement_group_timeout_s: float = 100,
                 nics: Optional[Sequence[str]] = None, verbose: bool = False):
        self.timeout_s = timeout_s
        self.placement_group_timeout_s = placement_group_timeout_s
        self.nics = nics
        self.verbose = verbose


def _call_with_executable(fn: Callable[[Any], Any], cls: Optional[type],
                          args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """On a rank: ``fn(executable_cls(*args, **kwargs))``, or ``fn(None)`` without a class."""
    return fn(cls(*args, **kwargs) if cls is not None else None)


class _Agent:
    """The Ray actor on one worker's resources; the first on each node runs its proxy."""

    def where(self) -> tuple:
        import ray
        return engine_agent.hostname(), ray.get_runtime_context().get_node_id()

    def run_proxy(self, line: str, payload: bytes, secret: bytes) -> tuple:
        return tuple(engine_agent.run_proxy(line, payload, secret))


def _driver_path(given: Optional[str]) -> Dict[str, str]:
    """PYTHONPATH for the ranks: ``given`` (extra_env_vars'), then the driver's sys.path, as
    Ray gives its workers the driver's (so functions that refer to the driver's modules load
    there too), but not the driver's working directory ('' on its sys.path: a folder of the
    driver's, not of the ranks'); extra_env_vars={"PYTHONPATH": ...} can name it."""
    import sys
    entries = [entry for entry in sys.path if entry and os.path.isdir(entry)]
    return {"PYTHONPATH": os.pathsep.join(([given] if given else []) + entries)}


def _lost_cause(error: Exception) -> str:
    """What Ray said of a lost actor, without the fields that name the actor itself (class,
    id, pid, namespace): its death and why (ray.kill, the worker's exit, out of memory)."""
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")
             and line.strip() != getattr(error, "BASE_ERROR_MSG", None)]
    cause = re.sub(r"\s+", " ", " ".join(lines) or text).strip()
    return f"{type(error).__name__}: " + (cause if len(cause) <= _CAUSE_CHARS
                                          else cause[:_CAUSE_CHARS] + " ...")


class RayExecutor:
    """horovod.ray.RayExecutor: run a function on ``num_workers`` ranks (or ``num_hosts`` ×
    ``num_workers_per_host``) placed by Ray; results come back in rank order."""

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Optional[Sequence[str]] = None) -> Settings:
        """Horovod's settings; the ssh arguments are accepted and unused (no ssh here)."""
        return Settings(timeout_s, placement_group_timeout_s, nics)

    def __init__(self, settings: Settings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: Optional[int] = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True):
        for name, value in (("min_workers", min_workers), ("max_workers", max_workers),
                            ("reset_limit", reset_limit), ("cooldown_range", cooldown_range)):
            if value is not None:
                raise ValueError(f"RayExecutor: {name}={value!r}: {_ELASTIC}")
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give num_workers, or num_hosts with "
                             "num_workers_per_host, not both")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None or (name == "num_workers_per_host" and num_hosts is not None):
                engine_checks.check_count(value, name, "RayExecutor")
        self.settings = settings
        self.num_workers = num_workers if num_workers is not None else \
            num_hosts * num_workers_per_host
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker if gpus_per_worker is not None else \
            (1 if use_gpu else 0)
        self._actors: List[Any] = []
        self._agents: List[Any] = []  # one per host: the actor that runs its proxy
        self._layout: List[tuple] = []  # (host, ranks) in rank order
        self._pg = None
        self._env: Dict[str, str] = {}
        self._executable = (None, (), {})
        self._flavour = ""  # the MPI launcher's, found by start()
        self._busy = threading.Lock()  # held by the call whose job runs
        self._running = ""  # that call, for the one that waits

    # -- start and stop ------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[Dict[str, Any]] = None,
              extra_env_vars: Optional[Dict[str, str]] = None) -> None:
        """Reserve the workers' resources and start the agents. TimeoutError (EngineTimeout)
        when the cluster cannot place them within ``placement_group_timeout_s``; EngineError
        when this executor has started already (shutdown() first). ``extra_env_vars`` are
        the ranks' variables on top of their actor's environment (the driver's does not
        travel)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if self._pg is not None:
            raise EngineError(f"RayExecutor.start: this executor has started already (its "
                              f"{len(self._actors)} workers hold their resources); call "
                              "shutdown() first to start it again")
        env = engine_checks.rank_env(extra_env_vars, "extra_env_vars", "RayExecutor.start")
        self._flavour = engine_launch.check_launcher().flavour
        if not ray.is_initialized():
            ray.init()
        self._executable = (executable_cls, tuple(executable_args or ()),
                            dict(executable_kwargs or {}))
        self._env = env
        per_bundle = self.num_workers_per_host if self.num_hosts is not None else 1
        bundle = {"CPU": self.cpus_per_worker * per_bundle}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * per_bundle
        count = self.num_hosts if self.num_hosts is not None else self.num_workers
        strategy = "STRICT_SPREAD" if self.num_hosts is not None else "PACK"
        self._pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            remove_placement_group(self._pg)
            self._pg = None
            have = ray.cluster_resources()
            raise EngineTimeout(
                f"RayExecutor.start: Ray could not place {count} {strategy} bundles of "
                f"{bundle} within placement_group_timeout_s="
                f"{self.settings.placement_group_timeout_s:g} s (the cluster has "
                f"{have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs on "
                f"{len(ray.nodes())} nodes); add nodes or ask for fewer workers")
        agent_cls = ray.remote(_Agent)
        self._actors = [agent_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=index)).remote()
            for index in range(count)]
        try:
            places = ray.get([actor.where.remote() for actor in self._actors],
                             timeout=self.settings.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise EngineTimeout(f"RayExecutor.start: the agents did not come up within "
                                f"timeout_s={self.settings.timeout_s:g} s") from None
        by_node: Dict[str, int] = {}
        self._agents, self._layout = [], []
        for actor, (host, node) in zip(self._actors, places):
            if node not in by_node:
                by_node[node] = len(self._agents)
                self._agents.append(actor)
                self._layout.append([host, 0])
            self._layout[by_node[node]][1] += per_bundle
        # Ranks in node order: the ranks on one host are consecutive (local_rank, local_size).
        self._layout = [tuple(entry) for entry in self._layout]

    def shutdown(self) -> None:
        """Kill the agents and free their resources (a job in flight ends with them)."""
        import ray
        for actor in self._actors:
            ray.kill(actor)
        self._actors, self._agents, self._layout = [], [], []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._pg)
            self._pg = None

    # -- calls -----------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Dict[str, Any]] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order. EngineError
        names the rank and host that raised, or the agent lost and what Ray said of it."""
        engine_checks.check_function(fn, "RayExecutor.run")
        return self._job(engine_launch.payload(fn, args, kwargs), self._layout,
                         getattr(fn, "__name__", repr(fn)), callbacks)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every rank (the instance of start's ``executable_cls``, made
        on the rank for this call; None without one); the results in rank order."""
        engine_checks.check_function(fn, "RayExecutor.execute")
        cls, args, kwargs = self._executable
        return self._job(engine_launch.payload(_call_with_executable, (fn, cls, args, kwargs)),
                         self._layout, getattr(fn, "__name__", repr(fn)), callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on one rank (a job of size 1 on the first host); its result."""
        engine_checks.check_function(fn, "RayExecutor.execute_single")
        cls, args, kwargs = self._executable
        return self._job(engine_launch.payload(_call_with_executable, (fn, cls, args, kwargs)),
                         [(self._layout[0][0], 1)] if self._layout else [],
                         getattr(fn, "__name__", repr(fn)), None)[0]

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
        """As :meth:`run`, then one ObjectRef per rank, in rank order, holding its result.
        The job has ended when it returns (each call is one MPI job); a failure raises here,
        as in :meth:`run`."""
        import ray
        return [ray.put(value) for value in self.run(fn, args, kwargs)]

    # -- one job -------------------------------------------------------------------------

    def _job(self, payload: bytes, layout: Sequence[tuple], name: str,
             callbacks: Optional[List[Callable]]) -> List[Any]:
        """Run one job on ``layout``, after the one running on this executor (if any) ends:
        its workers serve one job at a time, so a call made meanwhile waits, saying so."""
        if not self._busy.acquire(blocking=False):
            warnings.warn(f"RayExecutor: {name} waits for {self._running} to end: an executor "
                          "runs one job at a time on its workers (use another RayExecutor "
                          "to run both at once)", RuntimeWarning, stacklevel=3)
            self._busy.acquire()
        try:
            self._running = f"{name} (running since {time.strftime('%H:%M:%S')})"
            results = self._one_job(payload, layout, name)
        finally:
            self._running = ""
            self._busy.release()
        for callback in callbacks or ():
            for result in results:
                callback(result)
        return results

    def _one_job(self, payload: bytes, layout: Sequence[tuple], name: str) -> List[Any]:
        """hvdrun with the agents of ``layout``'s hosts running its proxies; the results."""
        import ray
        if not self._agents:
            raise EngineError("RayExecutor: call start() first (or again after shutdown())")
        size = sum(count for _, count in layout)
        secret = os.urandom(32)
        env = {**_driver_path(self._env.get("PYTHONPATH")),
               **{k: v for k, v in self._env.items() if k != "PYTHONPATH"}}
        launch = engine_launch.AgentLaunch(layout, engine_launch.rank_command(),
                                           flavour=self._flavour, secret=secret, env=env,
                                           start_timeout=self.settings.timeout_s,
                                           verbose=self.settings.verbose)
        outcomes: Dict[int, bytes] = {}
        lost: List[LostAgent] = []
        proxies: List[tuple] = []
        try:
            try:
                lines = launch.proxies(self.settings.timeout_s)
            except EngineTimeout as error:
                raise self._start_timeout(name, str(error)) from None
            data = ray.put(payload)
            refs = {agent.run_proxy.remote(line, data, secret): host
                    for agent, line, (host, _) in zip(self._agents, lines, layout)}
            pending, ended_at = list(refs), None
            while pending:
                done, pending = ray.wait(pending, timeout=0.2)
                for ref in done:
                    try:
                        host, proxy_code, found, said = ray.get(ref)
                        outcomes.update(found)
                        proxies.append((host, proxy_code, said))
                    except ray.exceptions.RayError as error:
                        lost.append(LostAgent(refs[ref], _lost_cause(error)))
                        launch.end()
                if launch.poll() is not None and pending:
                    ended_at = ended_at or time.monotonic()
                    if time.monotonic() - ended_at > _AGENT_GRACE_SECONDS:
                        lost += [LostAgent(refs[ref], "its actor did not return within "
                                           f"{_AGENT_GRACE_SECONDS:g} s of the job's end")
                                 for ref in pending]
                        break
            code = launch.wait()
        except BaseException:  # Ctrl-C, or a start that failed: end the job, then go
            launch.end()
            raise
        if launch.start_timed_out():
            raise self._start_timeout(name, f"hvdrun: {launch.said()}")
        return engine_launch.gather(outcomes, size, name, engine_launch.host_of_ranks(layout),
                                    code, launch.messages, lost, proxies)

    def _start_timeout(self, name: str, said: str) -> EngineTimeout:
        """The error of a job whose ranks did not all start within timeout_s."""
        return EngineTimeout(
            f"RayExecutor: {name}: the ranks did not all start within the settings' "
            f"timeout_s={self.settings.timeout_s:g} s, the time from launching the job to "
            "every rank's start (the MPI launcher's proxies, hvdrun's wrappers, the Python of "
            f"each rank); give a larger timeout_s\n{said}")


class ElasticRayExecutor:
    """horovod.ray.ElasticRayExecutor: refused (ValueError with the reason)."""

    def __init__(self, *args, **kwargs):
        raise ValueError(f"ElasticRayExecutor: {_ELASTIC}")

    @staticmethod
    def create_settings(*args, **kwargs):
        raise ValueError(f"ElasticRayExecutor: {_ELASTIC}")
