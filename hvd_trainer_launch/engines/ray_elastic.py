"""horovod.ray's ``ElasticRayExecutor`` (and RayExecutor's elastic form) over the elastic
engine job (engines.elastic): Ray is the source of hosts and the starter of agents.

Each :meth:`ElasticRayExecutor.run` watches the hosts a discovery reports (Ray's live nodes
and their resources, :class:`RayHostDiscovery`, or the settings' own ``discovery``) every
DISCOVERY_SECONDS, starts a Ray actor on each new host (pinned to it by Ray's ``node:<host>``
resource, holding the CPUs and GPUs of its slots) and says it joined once the actor answers;
a host that the discovery drops leaves the job, and its actor is killed once its life ends.
Each life's proxy line goes to the actor of its host (agent.ElasticAgent.run_life), and so
does the line of a host that a growth in place adds mid-life (MPICH); an actor
that Ray loses (its node died, it was killed) leaves the job, and hvdrun restarts the ranks
on the others from the last commit (or, under Open MPI with ``ulfm``, the ranks on the others
go on in their processes).
"""
import threading
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from hvd_trainer_launch.engines import (agent as engine_agent, calls, checks as engine_checks,
                                        elastic, launch as engine_launch)
from hvd_trainer_launch.engines.calls import EngineError
from hvd_trainer_launch.engines.ray_shared import driver_path, lost_cause

DISCOVERY_SECONDS = 1.0  # how often the hosts are discovered while a job runs
DEFAULT_ELASTIC_TIMEOUT = 600.0  # seconds, as Horovod's
CLOSE_SECONDS = 10.0  # how long an actor that ends gets to remove its commits folder


class RayHostDiscovery:
    """horovod.ray.RayHostDiscovery: the live Ray nodes by address, each with the slots its
    resources hold (CPUs / ``cpus_per_slot``, and with ``use_gpu`` GPUs / ``gpus_per_slot``
    too), as Horovod's counts them: from each node's total resources."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float = 1):
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """{node address: slots} of the live nodes."""
        import ray
        hosts = {}
        for node in ray.nodes():
            if not node.get("alive", node.get("Alive", True)):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // self.cpus_per_slot)
            if self.use_gpu:
                slots = min(slots, int(resources.get("GPU", 0) // self.gpus_per_slot))
            hosts[node["NodeManagerAddress"]] = slots
        return hosts


class ElasticSettings:
    """What :meth:`ElasticRayExecutor.create_settings` returns; ``discovery`` (an object with
    ``find_available_hosts_and_slots() -> {host: slots}``) is used with
    ``override_discovery=False``."""

    def __init__(self, min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                 reset_limit: Optional[int] = None,
                 elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT, timeout_s: float = 30,
                 nics: Optional[Sequence[str]] = None, verbose: bool = False,
                 cooldown_range: Optional[Sequence[float]] = None,
                 ulfm: Optional[bool] = None):
        self.min_num_proc, self.max_num_proc = min_num_proc, max_num_proc
        self.reset_limit, self.elastic_timeout, self.timeout_s = reset_limit, elastic_timeout, timeout_s
        self.nics, self.verbose, self.cooldown_range = nics, verbose, cooldown_range
        self.ulfm = ulfm  # None: $HVD_ELASTIC_ULFM (engines.elastic.ulfm_wanted)
        self.discovery: Any = None


class _RayAgent:
    """The Ray actor on one host for the whole job: an ElasticAgent (engines.agent)."""

    def __init__(self):
        self.agent = engine_agent.ElasticAgent()

    def ready(self) -> str:
        return engine_agent.hostname()

    def run_life(self, line: str, payload: bytes, secret: bytes,
                 ulfm: bool = False) -> calls.HostOutcome:
        return self.agent.run_life(line, payload, secret, ulfm=ulfm)

    def close(self) -> None:
        self.agent.close()


class ElasticDriver:
    """``ElasticRayExecutor.driver``: what Horovod's driver tells a discovery of the newest
    life (Horovod's test discovery paces itself so, waiting for the hosts it reported before
    to register); before a job runs, it has no slot."""

    def __init__(self, job: Optional[elastic.ElasticJob]):
        self.job = job

    def get_slot_info(self, host: str, local_rank: int) -> elastic.SlotInfo:
        """The slot ``local_rank`` of ``host`` in the newest life (``hostname`` "" if none)."""
        return self.job.slot_info(host, local_rank) if self.job else elastic.NO_SLOT

    def get_worker_client(self, slot: elastic.SlotInfo) -> Optional[elastic.Dispatch]:
        """Truthy once the agent of ``slot``'s host has the newest life's proxy line, which
        starts its ranks: hvd_trainer's ranks register with hvdrun, not with this driver, so
        this stands in for Horovod's client of a registered worker."""
        return self.job.dispatched(slot.hostname) if self.job and slot.hostname else None


class _Serving(NamedTuple):
    """A life's line that an actor runs: the life, the host, the actor."""

    life: int
    host: str
    actor: Any


class ElasticRayExecutor:
    """horovod.ray.ElasticRayExecutor: ``run(worker_fn)`` on every usable slot of the hosts
    that the discovery reports (between the settings' min_num_proc and max_num_proc), the job
    shrinking when a host is lost and growing when one comes, from the last commit
    (hvd.elastic.run and a State); returns the final life's results in rank order."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None,
                        elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT, timeout_s: float = 30,
                        ssh_identity_file: Optional[str] = None,
                        nics: Optional[Sequence[str]] = None, ulfm: Optional[bool] = None,
                        **kwargs) -> ElasticSettings:
        """Horovod's settings; ssh_identity_file is accepted and unused (no ssh here), and so
        are Horovod's other keywords (``verbose`` is kept). ``ulfm`` (hvd_trainer's own; None:
        ``$HVD_ELASTIC_ULFM``): under Open MPI 5, the ranks on the hosts left keep their
        processes when a host is lost (hvdrun's --ulfm)."""
        if not isinstance(min_num_proc, int) or min_num_proc < 1:
            raise ValueError(f"ElasticRayExecutor: min_num_proc={min_num_proc!r}; give an int >= 1")
        if max_num_proc is not None and max_num_proc < min_num_proc:
            raise ValueError(f"ElasticRayExecutor: max_num_proc={max_num_proc} is below "
                             f"min_num_proc={min_num_proc}")
        return ElasticSettings(min_num_proc, max_num_proc, reset_limit, elastic_timeout,
                               timeout_s, sorted(nics) if nics else None,
                               bool(kwargs.get("verbose", False)), ulfm=ulfm)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[Dict[str, str]] = None, override_discovery: bool = True):
        if not override_discovery and settings.discovery is None:
            raise ValueError("ElasticRayExecutor: override_discovery=False needs "
                             "settings.discovery (an object with find_available_hosts_and_slots)")
        self.settings, self.use_gpu = settings, use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot if gpus_per_slot is not None else (1 if use_gpu else 0)
        self.env_vars = engine_checks.rank_env(env_vars, "env_vars", "ElasticRayExecutor")
        self.override_discovery = override_discovery
        self._flavour = ""
        self.driver = ElasticDriver(None)  # the running job's (Horovod's name)

    def discovery(self) -> Any:
        """The discovery of this executor's hosts."""
        if self.override_discovery:
            return RayHostDiscovery(self.use_gpu, self.cpus_per_slot, self.gpus_per_slot or 1)
        return self.settings.discovery

    def start(self) -> None:
        """Connect to Ray (ray.init() when this process has not) and find the MPI launcher."""
        import ray
        self._flavour = engine_launch.check_launcher().flavour
        if not ray.is_initialized():
            ray.init()

    def run(self, worker_fn: Callable[[], Any], callbacks: Optional[List[Callable]] = None,
            args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
        """``worker_fn(*args, **kwargs)`` on the ranks, elastically; the final life's results
        in rank order. Each callback gets each event the ranks logged
        (hvd_trainer.ray.ray_logger.log), once the job has ended. EngineError names why the job
        ended: hvdrun's reason (fewer than min_num_proc slots for elastic_timeout, over
        reset_limit, every host lost) or the rank that raised."""
        engine_checks.check_function(worker_fn, "ElasticRayExecutor.run")
        if not self._flavour:
            raise EngineError("ElasticRayExecutor: call start() first")
        settings = self.settings
        job_settings = elastic.ElasticSettings(
            min_np=settings.min_num_proc, max_np=settings.max_num_proc,
            reset_limit=settings.reset_limit, elastic_timeout=float(settings.elastic_timeout),
            start_timeout=float(settings.timeout_s), nics=tuple(settings.nics or ()),
            verbose=settings.verbose, cooldown_range=(tuple(settings.cooldown_range)
                                                      if settings.cooldown_range else None),
            ulfm=elastic.ulfm_wanted(getattr(settings, "ulfm", None), self._flavour,
                                     "ElasticRayExecutor"))
        env = {**driver_path(self.env_vars.get("PYTHONPATH")),
               **{k: v for k, v in self.env_vars.items() if k != "PYTHONPATH"}}
        engine = _RayEngine(self, self._flavour, calls.payload(worker_fn, args, kwargs),
                            job_settings, env, getattr(worker_fn, "__name__", repr(worker_fn)))
        self.driver = ElasticDriver(engine.job)
        results = engine.run()
        for callback in callbacks or ():
            for event in engine.job.events():
                callback(event)
        return results


class _RayEngine:
    """One elastic job on Ray: the discovery's hosts, their actors, and the lives' lines."""

    def __init__(self, executor: ElasticRayExecutor, flavour: str, payload: bytes,
                 settings: elastic.ElasticSettings, env: Dict[str, str], name: str):
        import ray
        self.executor, self.discovery = executor, executor.discovery()
        self.job = elastic.ElasticJob(payload, flavour=flavour, settings=settings,
                                      serve=self.serve, env=env, name=name)
        self.payload = ray.put(payload)
        self.actors: Dict[str, Any] = {}  # host -> its actor (starting, ready, or leaving)
        self.starting: Dict[Any, str] = {}  # an actor's ready() -> its host
        self.slots: Dict[str, int] = {}
        self.serving: Dict[Any, _Serving] = {}  # a run_life call -> its life and host
        self.leaving: set = set()  # hosts the discovery dropped whose actor still serves
        self.lost_in: Dict[Any, int] = {}  # a lost actor -> the first life it failed
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.ending: List[threading.Thread] = []  # actors being ended

    def run(self) -> List[Any]:
        watcher = threading.Thread(target=self.watch, daemon=True, name="hvd-ray-elastic")
        watcher.start()
        try:
            return self.job.run()
        finally:
            self.stopped.set()
            watcher.join()
            self.close()

    def serve(self, dispatch: elastic.Dispatch) -> None:
        """Hand a life's line to its host's actor (an asynchronous call). A host whose actor
        is gone, or is a new one not yet ready, lost the actor the life was laid out for."""
        with self.lock:
            actor = self.actors.get(dispatch.host)
            ready = actor is not None and dispatch.host not in self.starting.values()
            if ready:
                ref = actor.run_life.remote(dispatch.line, self.payload, self.job.secret,
                                            self.job.settings.ulfm)
                self.serving[ref] = _Serving(dispatch.life, dispatch.host, actor)
        if not ready:
            self.job.lost(dispatch.life, dispatch.host, "its actor was gone before the life began",
                          absent=True)

    def watch(self) -> None:
        """Until the job ends: discover the hosts every DISCOVERY_SECONDS, and take the
        answers of the actors that start and of the lives they serve."""
        import ray
        import time
        next_discovery = 0.0
        while not self.stopped.is_set():
            if time.monotonic() >= next_discovery:
                self.discover()
                next_discovery = time.monotonic() + DISCOVERY_SECONDS
            with self.lock:
                refs = list(self.starting) + list(self.serving)
            if not refs:
                self.stopped.wait(0.1)
                continue
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.1)
            for ref in done:
                self.settle(ref)

    def discover(self) -> None:
        """Start an actor on each new host; let the hosts the discovery dropped leave."""
        try:
            found = {str(host): int(slots) for host, slots in
                     self.discovery.find_available_hosts_and_slots().items() if int(slots) > 0}
        except Exception as error:  # the discovery is the user's: its failure is no end
            warnings.warn(f"ElasticRayExecutor: the host discovery failed ({error!r}); keeping "
                          "the hosts as they are", RuntimeWarning)
            return
        with self.lock:
            for host, slots in found.items():
                if host not in self.actors:
                    self.start_actor(host, slots)
                elif host in self.leaving:  # back before its actor ended
                    self.leaving.discard(host)
                    self.job.joined(host, self.slots[host])
            for host in [host for host in self.actors if host not in found]:
                if host not in self.leaving:
                    self.leaving.add(host)
                    self.job.left(host)
                    self.end_if_idle(host)

    def start_actor(self, host: str, slots: int) -> None:
        """(Under the lock.) An actor on ``host`` holding the resources of ``slots``."""
        import ray
        executor = self.executor
        options = {"num_cpus": executor.cpus_per_slot * slots, "resources": {f"node:{host}": 0.01}}
        if executor.use_gpu:
            options["num_gpus"] = executor.gpus_per_slot * slots
        actor = ray.remote(_RayAgent).options(**options).remote()
        self.actors[host], self.slots[host] = actor, slots
        self.starting[actor.ready.remote()] = host

    def settle(self, ref: Any) -> None:
        """An actor's answer: ready (its host joins), or a life's outcome, or its loss."""
        import ray
        with self.lock:
            host, serving = self.starting.pop(ref, None), self.serving.pop(ref, None)
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayError as error:
            if serving is not None:
                self.job.lost(serving.life, serving.host, lost_cause(error),
                              absent=self.lost_after(serving))
            self.drop(host or serving.host)
            return
        if host is not None and self.actors.get(host) is not None and host not in self.leaving:
            self.job.joined(host, self.slots[host])
        elif serving is not None:
            self.job.returned(serving.life, serving.host, outcome)
            with self.lock:
                self.end_if_idle(serving.host)

    def lost_after(self, serving: _Serving) -> bool:
        """Whether ``serving``'s actor, now lost, was lost in an earlier life than its own:
        handed the next life before Ray failed the call of the one it died in. One loss is
        counted against its host once, in the earliest life the actor served."""
        with self.lock:
            lives = [s.life for s in self.serving.values() if s.actor is serving.actor]
            first = min([serving.life, *lives, self.lost_in.get(serving.actor, serving.life)])
            self.lost_in[serving.actor] = first
        return serving.life > first

    def drop(self, host: str) -> None:
        """Forget ``host``'s actor (lost: the next discovery may start another)."""
        with self.lock:
            self.job.left(host)
            self.actors.pop(host, None)
            self.leaving.discard(host)

    def end_if_idle(self, host: str) -> None:
        """(Under the lock.) End the actor of a host that left once it serves no life."""
        if host in self.leaving and not any(s.host == host for s in self.serving.values()):
            self.leaving.discard(host)
            self.end_actor(self.actors.pop(host))

    def end_actor(self, actor: Any) -> None:
        """End ``actor`` on a thread of its own (:func:`_close`)."""
        ending = threading.Thread(target=_close, args=(actor,), daemon=True)
        ending.start()
        self.ending.append(ending)

    def close(self) -> None:
        """End every actor, each removing its commits folder first, and wait for them."""
        with self.lock:
            actors, self.actors = list(self.actors.values()), {}
            for actor in actors:
                self.end_actor(actor)
        for ending in self.ending:
            ending.join()


def _close(actor: Any) -> None:
    """Let ``actor`` remove its commits folder (for CLOSE_SECONDS at most), then kill it."""
    import ray
    try:
        ray.get(actor.close.remote(), timeout=CLOSE_SECONDS)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        pass
    ray.kill(actor)
