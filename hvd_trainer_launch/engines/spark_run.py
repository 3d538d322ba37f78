"""horovod.spark.run over hvd_trainer's engine mechanism: one Spark barrier job whose tasks
are the agents, hvdrun on the driver.

Each task dials the driver's registry (hvd_trainer_launch.engines.registry) and says where it
runs and which resources Spark gave it. Once every task has, the driver lays the ranks out by
host, runs hvdrun with an MPI launcher that hands over one proxy command per host
(hvd_trainer_launch.engines.launch), and answers the first task on each host with its host's
command, which the task runs (engine_agent); the others end. The tasks carry the ranks'
results back as task results.

hvdrun runs on the driver, as Horovod's mpirun and the Ray engine's hvdrun do, so the ranks'
output reaches the driver as it is printed, through the launcher, and nothing keeps it. The
tasks dial the driver because Spark gives a running task no way to hear from it, and its
exchange between tasks (BarrierTaskContext.allGather) costs a second a call (docs/spark.md).
``start_timeout`` bounds the whole start on one clock: every task registered, then every rank
running the function (each rank says so to the registry).
"""
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import (agent as engine_agent, calls, checks as engine_checks,
                                        launch as engine_launch, registry as engine_registry,
                                        spark_causes as causes)
from hvd_trainer_launch.engines.calls import EngineError, EngineTimeout

# Horovod's default start timeout, and the variable it reads first.
_DEFAULT_START_TIMEOUT = 600.0
_START_TIMEOUT_VARIABLE = "HOROVOD_SPARK_START_TIMEOUT"
# How long a task waits for the driver's answer beyond start_timeout (the driver cancels the
# job at start_timeout; this only ends a task whose driver went away).
_ANSWER_GRACE_SECONDS = 60.0
# After the tasks have returned, how long hvdrun gets to end before it is ended.
_HVDRUN_GRACE_SECONDS = 15.0
_POLL_SECONDS = 0.05


def _task(payload: bytes, secret: bytes, registry: str, wait: float) -> Callable:
    """The function each barrier task runs over its (unused) partition: register, then run
    the proxy command the driver answers with, if any; its one row is the outcome of its
    host's ranks (calls.HostOutcome), or None from the tasks that run none. It refers
    to hvd_trainer_launch's modules alone, so that a task imports nothing more (hvd_trainer
    itself, NumPy) before it registers."""

    def task(_partition):
        from pyspark import BarrierTaskContext
        context = BarrierTaskContext.get()
        resources = {name: list(info.addresses) for name, info in context.resources().items()}
        mine = engine_registry.Registration(context.partitionId(), engine_agent.hostname(),
                                            resources)
        assignment = engine_registry.register(registry, secret, mine, wait)
        if assignment.line is None:
            yield None
        else:
            yield engine_agent.run_proxy(assignment.line, payload, secret, env=assignment.env)

    return task


def _num_proc(num_proc: Any, context) -> int:
    """``num_proc``, or Spark's default parallelism for None; ValueError unless a positive int."""
    if num_proc is None:
        return context.defaultParallelism
    return engine_checks.check_count(num_proc, "num_proc", "hvd_trainer.spark.run")


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        stdout=None, stderr=None, verbose: int = 1, nics: Optional[Sequence[str]] = None,
        prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None) -> List[Any]:
    """horovod.spark.run: ``fn(*args, **kwargs)`` on ``num_proc`` ranks (a positive int;
    default: Spark's default parallelism), one per Spark task, laid out by executor host; the
    results in rank order. Needs an active SparkSession (or SparkContext) whose cluster has
    ``num_proc`` task slots free at once. EngineError names a rank (and host) that raised, or
    a lost executor's host and what Spark said; TimeoutError (message starting "Timed out
    waiting for") when the tasks, or then the ranks, have not all started within
    ``start_timeout`` of the call (default $HOROVOD_SPARK_START_TIMEOUT, else 600 s).
    ``use_gloo=True`` raises ValueError: hvd_trainer runs on MPI only. ``extra_mpi_args`` go
    to mpiexec, ``env`` to the ranks; the ranks' output is written to ``stdout``/``stderr``
    (default: ours) as it comes."""
    began = time.monotonic()
    context = active_context(use_gloo, use_mpi, "hvd_trainer.spark.run")
    num_proc = _num_proc(num_proc, context)
    ranks_env = engine_checks.rank_env(env, "env", "hvd_trainer.spark.run")
    flavour = engine_launch.check_launcher().flavour
    if start_timeout is None:
        start_timeout = float(os.environ.get(_START_TIMEOUT_VARIABLE, _DEFAULT_START_TIMEOUT))
    secret = os.urandom(32)
    conf = context.getConf()
    payload = calls.payload(fn, args, kwargs)
    registry = engine_registry.Registry(conf.get("spark.driver.host"), secret, num_proc,
                                        num_proc, bind=conf.get("spark.driver.bindAddress"))
    start = _Start(began, start_timeout, num_proc, context.defaultParallelism)
    job = launch = None
    try:
        job = _BarrierJob(context, num_proc, _task(payload, secret, registry.address,
                                                   start_timeout + _ANSWER_GRACE_SECONDS))
        tasks = start.wait_for_tasks(job, registry)
        # Only now: Horovod's own tests pass fn=None to a job whose tasks cannot start, and
        # expect its TimeoutError; no rank has started yet either way.
        engine_checks.check_function(fn, "hvd_trainer.spark.run")
        layout = engine_launch.rank_layout(tasks[index].host for index in range(num_proc))
        launch = engine_launch.AgentLaunch(
            layout, engine_launch.rank_command(executable), flavour=flavour, secret=secret,
            env=ranks_env,
            mpi_args=shlex.split(extra_mpi_args or ""), out=stdout or sys.stdout,
            err=stderr or sys.stderr,
            hvdrun_args=hvdrun_flags(nics, prefix_output_with_timestamp, verbose))
        try:
            lines = launch.proxies(max(start.left(), 0))
        except EngineError as error:
            if start.left() <= 0:
                raise start.ranks_late("hvdrun's launcher had not handed over its proxy "
                                       "commands") from None
            raise EngineError(f"hvd_trainer.spark.run: the MPI job did not start: {error}") \
                from None
        registry.answer(_assignments(tasks, layout, lines, registry.address))
        start.wait_for_ranks(job, registry, launch, layout)
        results = job.results(tasks)
        try:
            code = launch.wait(_HVDRUN_GRACE_SECONDS)
        except subprocess.TimeoutExpired:  # its proxies are gone: it would end by itself
            code = launch.end()
    except BaseException:  # a failure, a timeout or Ctrl-C: end the Spark job and hvdrun
        if job is not None and not job.done():
            job.cancel()
        if launch is not None:
            launch.end()
        raise
    finally:
        registry.close()
    hosts = [outcome for outcome in results if outcome is not None]
    return calls.gather(
        {rank: outcome for host in hosts for rank, outcome in host.outcomes.items()}, num_proc,
        getattr(fn, "__name__", repr(fn)), engine_launch.host_of_ranks(layout), code,
        launch.messages, proxies=hosts)


def active_context(use_gloo: Optional[bool], use_mpi: Optional[bool], where: str):
    """The active SparkContext; ValueError (naming ``where``: the entry point) for the
    arguments that ask for no MPI, or when there is no active SparkSession."""
    if use_gloo:
        raise ValueError(f"{where}: use_gloo=True is not supported: hvd_trainer runs on MPI "
                         "only; drop use_gloo")
    if use_mpi is False:
        raise ValueError(f"{where}: use_mpi=False is not supported: hvd_trainer runs on MPI "
                         "only; drop use_mpi")
    from pyspark import SparkContext
    context = SparkContext._active_spark_context
    if context is None:
        raise ValueError(f"{where} needs an active SparkSession: create one first "
                         "(SparkSession.builder...getOrCreate())")
    return context


def hvdrun_flags(nics: Optional[Sequence[str]], timestamps: bool, verbose: int) -> List[str]:
    """hvdrun's flags for horovod.spark's ``nics``, ``prefix_output_with_timestamp`` and
    ``verbose`` (run's and run_elastic's)."""
    flags = ["--network-interfaces", ",".join(nics)] if nics else []
    if timestamps:
        flags.append("--prefix-output-with-timestamp")
    if verbose and verbose >= 2:
        flags.append("--verbose")
    return flags


def _assignments(tasks: Dict[int, engine_registry.Registration], layout: Sequence[tuple],
                 lines: Sequence[str], registry: str) -> Dict[int, engine_registry.Assignment]:
    """The first task on each host gets its host's proxy command, and for its ranks the
    registry's address and the host's tasks' resources in local rank order (task index order,
    as the layout numbers them); the other tasks get nothing to run."""
    assignments = {}
    for (host, _), line in zip(layout, lines):
        on_host = sorted(index for index, task in tasks.items() if task.host == host)
        resources = [tasks[index].resources for index in on_host]
        assignments[on_host[0]] = engine_registry.Assignment(
            line, {protocol.SPARK_RESOURCES_VARIABLE: json.dumps(resources),
                   engine_registry.VARIABLE: registry})
    return assignments


class _Start:
    """The job's start on one clock from the call: the tasks' registration, then the ranks'."""

    def __init__(self, began: float, seconds: float, num_proc: int, parallelism: int):
        self.began, self.seconds = began, seconds
        self.num_proc, self.parallelism = num_proc, parallelism
        self.tasks_at: Optional[float] = None

    def left(self) -> float:
        return self.began + self.seconds - time.monotonic()

    def wait_for_tasks(self, job: "_BarrierJob", registry) -> Dict[int, Any]:
        """Every task's registration; EngineTimeout at start_timeout, the job's error if it
        fails first."""
        while not registry.wait_registered(min(_POLL_SECONDS, max(self.left(), 0))):
            if job.done():
                job.results({})  # raises what Spark said
                raise EngineError("hvd_trainer.spark.run: the Spark job ended before its "
                                  "tasks registered with the driver")
            if self.left() <= 0:
                count = len(registry.registered())
                raise EngineTimeout(
                    f"Timed out waiting for Spark tasks to start: {count} of the "
                    f"{self.num_proc} tasks started within start_timeout={self.seconds:g} s; "
                    f"a barrier job needs all {self.num_proc} task slots at once (Spark's "
                    f"default parallelism is {self.parallelism}): add executors or ask for a "
                    "smaller num_proc, or a longer start_timeout if executors come on demand")
        self.tasks_at = time.monotonic()
        return registry.registered()

    def wait_for_ranks(self, job: "_BarrierJob", registry, launch, layout) -> None:
        """Until every rank runs the function (or the job or hvdrun ended: their outcome
        says why); EngineTimeout naming the ranks still starting at start_timeout."""
        while not registry.wait_running(min(_POLL_SECONDS, max(self.left(), 0))):
            if job.done() or launch.poll() is not None:
                return
            if self.left() <= 0:
                hosts = engine_launch.host_of_ranks(layout)
                late = sorted(set(range(self.num_proc)) - registry.running())
                where = sorted({hosts[rank] for rank in late})
                raise self.ranks_late(f"rank{'s' if len(late) > 1 else ''} "
                                      f"{', '.join(map(str, late))} on {', '.join(where)} had "
                                      "not begun running the function")

    def ranks_late(self, what: str) -> EngineTimeout:
        """The error for a start past start_timeout once the tasks had started."""
        return EngineTimeout(
            f"Timed out waiting for the ranks to start: {what} within "
            f"start_timeout={self.seconds:g} s (the Spark tasks had all started after "
            f"{self.tasks_at - self.began:.1f} s); a rank's start is hvdrun's, its Python's "
            "(`executable`) and the function's unpickling: check them, or give a longer "
            "start_timeout")


class _BarrierJob:
    """The barrier job of ``num_proc`` tasks, collected in a thread of its own job group."""

    def __init__(self, context, num_proc: int, task: Callable):
        from pyspark import InheritableThread
        self._context, self._task, self._num_proc = context, task, num_proc
        self._group = f"hvd_trainer.spark.run.{uuid.uuid4().hex}"
        self._box: Dict[str, Any] = {}
        self._thread = InheritableThread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        self._context.setJobGroup(self._group, "hvd_trainer.spark.run", interruptOnCancel=True)
        try:
            # A barrier result stage whose task fails is not retried: Spark ends the job.
            self._box["rows"] = (self._context.parallelize(range(self._num_proc),
                                                           self._num_proc)
                                 .barrier().mapPartitions(self._task).collect())
        except BaseException as error:
            self._box["error"] = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Cancel the job (Spark kills its tasks' Python workers) and wait for it to end."""
        self._context.cancelJobGroup(self._group)
        self._thread.join(30)

    def results(self, tasks: Dict[int, Any]) -> List[Optional[calls.HostOutcome]]:
        """The tasks' rows once the job ends; EngineError (or EngineTimeout when the
        cluster has too few slots) saying why it failed (``tasks``: the registrations)."""
        while self._thread.is_alive():
            self._thread.join(0.2)  # short waits: Ctrl-C stays responsive
        if "error" not in self._box:
            return self._box["rows"]
        text = str(self._box["error"])
        if "BarrierJobSlotsNumberCheckFailed" in text or "requires more slots" in text:
            raise EngineTimeout(
                f"hvd_trainer.spark.run: num_proc={self._num_proc} needs {self._num_proc} task "
                f"slots at once and the cluster has fewer (Spark's default parallelism is "
                f"{self._context.defaultParallelism}): add executors or ask for a smaller "
                "num_proc") from None
        hosts = {index: task.host for index, task in tasks.items()}
        raise EngineError(f"hvd_trainer.spark.run: the Spark job failed (a lost executor or "
                          f"task ends the job; it is not retried): "
                          f"{causes.explain(text, hosts)}") from self._box["error"]

