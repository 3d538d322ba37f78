"""horovod.ray's ``RayExecutor`` over hvd_trainer's engine mechanism: Ray actors are the
agents that run the MPI launcher's proxies; each call is one MPI job, and an executor runs
one at a time (a second call waits for the first, as calls on Horovod's actors queue)."""
import os
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from hvd_trainer_launch.engines import (agent as engine_agent, calls, checks as engine_checks,
                                        launch as engine_launch)
from hvd_trainer_launch.engines.calls import EngineError, EngineTimeout, HostOutcome, LostAgent
from hvd_trainer_launch.engines.ray_shared import driver_path, lost_cause

# After hvdrun has ended, how long the agents get to return before they count as lost.
_AGENT_GRACE_SECONDS = 15.0


class Settings:
    """What :meth:`RayExecutor.create_settings` returns: ``timeout_s`` bounds each job's start
    (hvdrun's --start-timeout), ``placement_group_timeout_s`` the wait for resources, ``nics``
    the network interfaces the ranks use (hvdrun's --network-interfaces)."""

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


class _Place(NamedTuple):
    """Where an agent runs: its host's name and its Ray node."""

    host: str
    node: str


class _Agent:
    """The Ray actor on one worker's resources; the first on each node runs its proxy."""

    def where(self) -> "_Place":
        import ray
        return _Place(engine_agent.hostname(), ray.get_runtime_context().get_node_id())

    def run_proxy(self, line: str, payload: bytes, secret: bytes) -> HostOutcome:
        return engine_agent.run_proxy(line, payload, secret)


def _nics_flags(nics: Optional[Sequence[str]]) -> List[str]:
    """hvdrun's flag for the settings' ``nics``."""
    return ["--network-interfaces", ",".join(nics)] if nics else []


class RayExecutor:
    """horovod.ray.RayExecutor: run a function on ``num_workers`` ranks (or ``num_hosts`` ×
    ``num_workers_per_host``) placed by Ray; results come back in rank order."""

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Optional[Sequence[str]] = None) -> Settings:
        """Horovod's settings; the ssh arguments are accepted and unused (no ssh here: the
        agents run the MPI launcher's proxies)."""
        return Settings(timeout_s, placement_group_timeout_s, nics)

    def __init__(self, settings: Settings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: Optional[int] = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence] = None,
                 elastic_timeout: Optional[int] = None, override_discovery: Optional[bool] = None):
        # Horovod's elastic form: min_workers or max_workers given (engines.ray_elastic).
        self._elastic = None
        self.settings, self._executable = settings, (None, (), {})
        if min_workers is not None or max_workers is not None:
            self._elastic = _elastic_form(settings, min_workers, max_workers, reset_limit,
                                          cooldown_range, elastic_timeout, override_discovery,
                                          cpus_per_worker, use_gpu, gpus_per_worker)
            return
        for name, value in (("reset_limit", reset_limit), ("cooldown_range", cooldown_range),
                            ("elastic_timeout", elastic_timeout),
                            ("override_discovery", override_discovery)):
            if value is not None:
                raise ValueError(f"RayExecutor: {name}={value!r} is for elastic jobs: give "
                                 "min_workers (and max_workers) too")
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
        self.use_current_placement_group = use_current_placement_group
        self._actors: List[Any] = []
        self._agents: List[Any] = []  # one per host: the actor that runs its proxy
        self._layout: List[engine_launch.HostRanks] = []  # in rank order
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
        travel). ValueError inside a placement group (a Ray Tune trial's) unless
        use_current_placement_group=False: its bundles are not used (docs/limitations.md).
        In the elastic form, only connects to Ray: each call starts its agents on the hosts
        of the moment (engines.ray_elastic)."""
        import ray
        if self._elastic is not None:
            return self._start_elastic(executable_cls, executable_args, executable_kwargs,
                                       extra_env_vars)
        from ray.util.placement_group import (get_current_placement_group, placement_group,
                                              remove_placement_group)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if self._pg is not None:
            raise EngineError(f"RayExecutor.start: this executor has started already (its "
                              f"{len(self._actors)} workers hold their resources); call "
                              "shutdown() first to start it again")
        env = engine_checks.rank_env(extra_env_vars, "extra_env_vars", "RayExecutor.start")
        self._flavour = engine_launch.check_launcher().flavour
        if not ray.is_initialized():
            ray.init()
        # (Asked only now: Ray's question starts a Ray instance when none runs.)
        if self.use_current_placement_group and get_current_placement_group() is not None:
            raise ValueError("RayExecutor.start: this runs inside a Ray placement group, whose "
                             "bundles use_current_placement_group=True (the default) asks the "
                             "workers to take, and hvd_trainer does not place them there: pass "
                             "use_current_placement_group=False, and the executor reserves a "
                             "placement group of its own (the enclosing one must leave room)")
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
        # Ranks in node order: the ranks on one node are consecutive (local_rank, local_size).
        # The first actor on a node is its agent (two Ray nodes on one machine: two agents).
        agents: Dict[str, Any] = {}
        ranks: Dict[str, int] = {}
        for actor, place in zip(self._actors, places):
            agents.setdefault(place.node, (actor, place.host))
            ranks[place.node] = ranks.get(place.node, 0) + per_bundle
        self._agents = [actor for actor, _ in agents.values()]
        self._layout = [engine_launch.HostRanks(host, ranks[node])
                        for node, (_, host) in agents.items()]

    def _start_elastic(self, executable_cls: Optional[type],
                       executable_args: Optional[Sequence[Any]],
                       executable_kwargs: Optional[Dict[str, Any]],
                       extra_env_vars: Optional[Dict[str, str]]) -> None:
        """start() of the elastic form: keep the executable and the ranks' variables for
        the calls, and connect to Ray."""
        self._executable = (executable_cls, tuple(executable_args or ()),
                            dict(executable_kwargs or {}))
        self._elastic.env_vars = engine_checks.rank_env(extra_env_vars, "extra_env_vars",
                                                        "RayExecutor.start")
        self._elastic.start()

    def shutdown(self) -> None:
        """Kill the agents and free their resources (a job in flight ends with them); the
        elastic form holds none between calls."""
        import ray
        if self._elastic is not None:
            return
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
        if self._elastic is not None:
            return self._elastic.run(fn, callbacks, args, kwargs)
        return self._job(calls.payload(fn, args, kwargs), self._layout,
                         getattr(fn, "__name__", repr(fn)), callbacks)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every rank (the instance of start's ``executable_cls``, made
        on the rank for this call; None without one); the results in rank order."""
        engine_checks.check_function(fn, "RayExecutor.execute")
        cls, args, kwargs = self._executable
        if self._elastic is not None:
            return self._elastic.run(_call_with_executable, callbacks, (fn, cls, args, kwargs))
        return self._job(calls.payload(_call_with_executable, (fn, cls, args, kwargs)),
                         self._layout, getattr(fn, "__name__", repr(fn)), callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on one rank (a job of size 1 on the first host); its result."""
        engine_checks.check_function(fn, "RayExecutor.execute_single")
        if self._elastic is not None:
            raise ValueError("RayExecutor.execute_single: not in the elastic form (min_workers, "
                             "max_workers), whose ranks come and go: use execute or run")
        cls, args, kwargs = self._executable
        return self._job(calls.payload(_call_with_executable, (fn, cls, args, kwargs)),
                         [engine_launch.HostRanks(self._layout[0].host, 1)]
                         if self._layout else [],
                         getattr(fn, "__name__", repr(fn)), None)[0]

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
        """As :meth:`run`, then one ObjectRef per rank, in rank order, holding its result.
        The job has ended when it returns (each call is one MPI job); a failure raises here,
        as in :meth:`run`."""
        import ray
        return [ray.put(value) for value in self.run(fn, args, kwargs)]

    # -- one job -------------------------------------------------------------------------

    def _job(self, payload: bytes, layout: Sequence[engine_launch.HostRanks], name: str,
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

    def _one_job(self, payload: bytes, layout: Sequence[engine_launch.HostRanks], name: str) -> List[Any]:
        """hvdrun with the agents of ``layout``'s hosts running its proxies; the results."""
        import ray
        if not self._agents:
            raise EngineError("RayExecutor: call start() first (or again after shutdown())")
        size = sum(count for _, count in layout)
        secret = os.urandom(32)
        env = {**driver_path(self._env.get("PYTHONPATH")),
               **{k: v for k, v in self._env.items() if k != "PYTHONPATH"}}
        launch = engine_launch.AgentLaunch(layout, engine_launch.rank_command(),
                                           flavour=self._flavour, secret=secret, env=env,
                                           start_timeout=self.settings.timeout_s,
                                           verbose=self.settings.verbose,
                                           hvdrun_args=_nics_flags(self.settings.nics))
        outcomes: Dict[int, bytes] = {}
        lost: List[LostAgent] = []
        proxies: List[HostOutcome] = []
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
                        ended = ray.get(ref)
                        outcomes.update(ended.outcomes)
                        proxies.append(ended)
                    except ray.exceptions.RayError as error:
                        lost.append(LostAgent(refs[ref], lost_cause(error)))
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
        return calls.gather(outcomes, size, name, engine_launch.host_of_ranks(layout),
                                    code, launch.messages, lost, proxies)

    def _start_timeout(self, name: str, said: str) -> EngineTimeout:
        """The error of a job whose ranks did not all start within timeout_s."""
        return EngineTimeout(
            f"RayExecutor: {name}: the ranks did not all start within the settings' "
            f"timeout_s={self.settings.timeout_s:g} s, the time from launching the job to "
            "every rank's start (the MPI launcher's proxies, hvdrun's wrappers, the Python of "
            f"each rank); give a larger timeout_s\n{said}")


def _elastic_form(settings: Settings, min_workers: Optional[int], max_workers: Optional[int],
                  reset_limit: Optional[int], cooldown_range: Optional[Sequence],
                  elastic_timeout: Optional[int], override_discovery: Optional[bool],
                  cpus_per_worker: float, use_gpu: bool,
                  gpus_per_worker: Optional[float]) -> Any:
    """The ElasticRayExecutor that runs an elastic RayExecutor's calls (Horovod 0.28's
    RayExecutor takes these arguments for its elastic form)."""
    from hvd_trainer_launch.engines import ray_elastic
    if cooldown_range is not None and (len(cooldown_range) != 2
                                       or not 0 <= cooldown_range[0] <= cooldown_range[1]):
        raise ValueError(f"RayExecutor: cooldown_range={cooldown_range!r}; give (MIN, MAX) "
                         "seconds with 0 <= MIN <= MAX")
    elastic_settings = ray_elastic.ElasticRayExecutor.create_settings(
        min_num_proc=min_workers if min_workers is not None else 1, max_num_proc=max_workers, reset_limit=reset_limit,
        elastic_timeout=(elastic_timeout if elastic_timeout is not None
                         else ray_elastic.DEFAULT_ELASTIC_TIMEOUT),
        timeout_s=settings.timeout_s, nics=settings.nics, verbose=settings.verbose)
    elastic_settings.cooldown_range = tuple(cooldown_range) if cooldown_range else None
    elastic_settings.discovery = getattr(settings, "discovery", None)
    return ray_elastic.ElasticRayExecutor(
        elastic_settings, use_gpu=use_gpu, cpus_per_slot=cpus_per_worker,
        gpus_per_slot=gpus_per_worker, override_discovery=override_discovery is not False)
