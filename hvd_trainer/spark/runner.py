"""horovod.spark.run over hvd_trainer's engine mechanism: one Spark barrier job whose tasks
are the agents.

The tasks learn their hosts from one another (BarrierTaskContext.allGather), so the ranks are
laid out by executor host; task 0 runs hvdrun with an MPI launcher that hands over its proxy
lines instead of starting them (hvd_trainer_launch.engine_launch), and hands each host's line
to the first task on that host (a second allGather); each such task runs its proxy, and
returns the outcomes of its host's ranks as its task result. hvdrun runs in task
0 because Spark gives a running task no way to hear from the driver: the ranks' output shows
in that executor's log as it comes, and on the driver (``stdout``/``stderr``) when the job ends.
"""
import io
import json
import os
import shlex
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

from hvd_trainer_launch import engine_agent, engine_checks, engine_launch
from hvd_trainer_launch.engine_launch import EngineError

# Horovod's default start timeout, and the variable it reads first.
_DEFAULT_START_TIMEOUT = 600.0
_START_TIMEOUT_VARIABLE = "HOROVOD_SPARK_START_TIMEOUT"
_ELASTIC = ("hvd_trainer.spark.run_elastic is not supported: hvd_trainer's elastic mode needs "
            "hvdrun to add and remove hosts, and a Spark barrier job is all or nothing (a lost "
            "task fails the stage); run elastic jobs with hvdrun --min-np/--max-np "
            "(docs/limitations.md)")


class EngineTimeout(EngineError, TimeoutError):
    """The barrier job's tasks did not all start within start_timeout."""


class _Tee(io.RawIOBase):
    """A binary stream that writes to this process's stream and keeps a copy."""

    def __init__(self, target):
        self.target, self.kept = target, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.kept += data
        try:
            self.target.write(bytes(data))
            self.target.flush()
        except (OSError, ValueError):
            pass
        return len(data)


def _task(payload: bytes, secret: bytes, start_timeout: float, env: Dict[str, str],
          flavour: str, mpi_args: List[str], hvdrun_args: List[str],
          executable: Optional[str]) -> Callable:
    """The function each barrier task runs over its (unused) partition (``flavour``: the
    MPI launcher's, found on the driver: a task must not load the MPI library)."""

    def task(_partition):
        from pyspark import BarrierTaskContext
        context = BarrierTaskContext.get()
        index = context.partitionId()
        host = engine_agent.hostname()
        hosts = context.allGather(host)
        layout = engine_launch.rank_layout(hosts)
        launch, message = None, ""
        out, err = _Tee(sys.stdout.buffer), _Tee(sys.stderr.buffer)
        if index == 0:
            try:
                launch = engine_launch.AgentLaunch(
                    layout, engine_launch.rank_command(executable), flavour=flavour,
                    secret=secret, env=env, start_timeout=start_timeout, mpi_args=mpi_args,
                    out=out, err=err, hvdrun_args=hvdrun_args)
                message = json.dumps({"lines": launch.proxies(start_timeout)})
            except Exception as error:
                message = json.dumps({"error": str(error)})
        announced = json.loads(context.allGather(message)[0])
        outcome = None
        if "lines" in announced and hosts.index(host) == index:  # the first task on its host
            place = [name for name, _ in layout].index(host)
            outcome = tuple(engine_agent.run_proxy(announced["lines"][place], payload, secret))
        code, messages = None, []
        if launch is not None:
            code, messages = launch.wait(), launch.messages
        yield ("done", index, (host, outcome, code, messages, announced.get("error"),
                               bytes(out.kept), bytes(err.kept)))

    return task


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        stdout=None, stderr=None, verbose: int = 1, nics: Optional[Sequence[str]] = None,
        prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None) -> List[Any]:
    """horovod.spark.run: ``fn(*args, **kwargs)`` on ``num_proc`` ranks (default: Spark's
    default parallelism), one per Spark task, laid out by executor host; the results in rank
    order. Needs an active SparkSession (or SparkContext) whose cluster has ``num_proc``
    task slots free at once. EngineError names a rank (and host) that raised or a lost
    executor; TimeoutError when the tasks do not all start within ``start_timeout``
    (default $HOROVOD_SPARK_START_TIMEOUT, else 600 s). ``use_gloo=True`` raises ValueError:
    hvd_trainer runs on MPI only. ``extra_mpi_args`` go to mpiexec, ``env`` to the ranks;
    the ranks' output is written to ``stdout``/``stderr`` (default: ours) when the job ends."""
    if use_gloo:
        raise ValueError("hvd_trainer.spark.run: use_gloo=True is not supported: hvd_trainer "
                         "runs on MPI only; drop use_gloo")
    if use_mpi is False:
        raise ValueError("hvd_trainer.spark.run: use_mpi=False is not supported: hvd_trainer "
                         "runs on MPI only; drop use_mpi")
    from pyspark import SparkContext
    context = SparkContext._active_spark_context
    if context is None:
        raise ValueError("hvd_trainer.spark.run needs an active SparkSession: create one "
                         "first (SparkSession.builder...getOrCreate())")
    engine_checks.check_function(fn, "hvd_trainer.spark.run")
    flavour = engine_launch.check_launcher().flavour
    num_proc = context.defaultParallelism if num_proc is None else \
        engine_checks.check_count(num_proc, "num_proc", "hvd_trainer.spark.run")
    if start_timeout is None:
        start_timeout = float(os.environ.get(_START_TIMEOUT_VARIABLE, _DEFAULT_START_TIMEOUT))
    hvdrun_args = []
    if nics:
        hvdrun_args += ["--network-interfaces", ",".join(nics)]
    if prefix_output_with_timestamp:
        hvdrun_args.append("--prefix-output-with-timestamp")
    if verbose and verbose >= 2:
        hvdrun_args.append("--verbose")
    name = getattr(fn, "__name__", repr(fn))
    task = _task(engine_launch.payload(fn, args, kwargs), os.urandom(32), start_timeout,
                 engine_checks.rank_env(env, "env", "hvd_trainer.spark.run"), flavour,
                 shlex.split(extra_mpi_args or ""), hvdrun_args, executable)
    rows = _collect(context, num_proc, task, start_timeout)
    return _results(rows, num_proc, name, stdout or sys.stdout, stderr or sys.stderr)


def _collect(context, num_proc: int, task: Callable, start_timeout: float) -> list:
    """Run the barrier job and return its rows; cancel it after ``start_timeout`` if its
    tasks have not all started, or on Ctrl-C."""
    group = f"hvd_trainer.spark.run.{uuid.uuid4().hex}"
    box: Dict[str, Any] = {}

    def job():
        context.setJobGroup(group, "hvd_trainer.spark.run", interruptOnCancel=True)
        try:
            # A barrier result stage whose task fails is not retried: Spark ends the job.
            box["rows"] = (context.parallelize(range(num_proc), num_proc).barrier()
                           .mapPartitions(task).collect())
        except BaseException as error:
            box["error"] = error

    from pyspark import InheritableThread
    thread = InheritableThread(target=job, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    try:
        while thread.is_alive():
            thread.join(0.2)
            if deadline is not None and time.monotonic() >= deadline:
                started = _started(context, group)
                if started >= num_proc:
                    deadline = None
                else:
                    context.cancelJobGroup(group)
                    thread.join(30)
                    raise EngineTimeout(
                        f"hvd_trainer.spark.run: {started} of the {num_proc} "
                        f"tasks started within start_timeout={start_timeout:g} s; a barrier "
                        f"job needs all {num_proc} task slots at once (Spark's default "
                        f"parallelism is {context.defaultParallelism}): add executors or ask "
                        "for a smaller num_proc")
    except KeyboardInterrupt:
        context.cancelJobGroup(group)
        thread.join(30)
        raise
    if "error" in box:
        text = str(box["error"])
        if "BarrierJobSlotsNumberCheckFailed" in text or "requires more slots" in text:
            raise EngineTimeout(
                f"hvd_trainer.spark.run: num_proc={num_proc} needs {num_proc} task slots at "
                f"once and the cluster has fewer (Spark's default parallelism is "
                f"{context.defaultParallelism}): add executors or ask for a smaller "
                "num_proc") from None
        reason = next((line for line in text.splitlines() if "Job aborted" in line),
                      text.splitlines()[0] if text else repr(box["error"]))
        raise EngineError(f"hvd_trainer.spark.run: the Spark job failed (a lost executor or "
                          f"task ends the job; it is not retried): {reason}") from box["error"]
    return box["rows"]


def _started(context, group: str) -> int:
    """How many tasks of the job group's stages are running or done."""
    tracker = context.statusTracker()
    count = 0
    for job_id in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job_id)
        for stage_id in (info.stageIds if info else ()):
            stage = tracker.getStageInfo(stage_id)
            if stage:
                count += stage.numActiveTasks + stage.numCompletedTasks
    return count


def _results(rows: list, num_proc: int, name: str, stdout, stderr) -> List[Any]:
    """The ranks' results from the tasks' rows, after showing task 0's copy of the output."""
    outcomes: Dict[int, bytes] = {}
    code, messages, layout, error, proxies = 0, [], [], None, []
    for _, index, (host, outcome, task_code, task_messages, task_error, out, err) in rows:
        if index == 0:
            code, messages, error = task_code, task_messages, task_error
            _write(stdout, out)
            _write(stderr, err)
        if outcome is not None:
            outcomes.update(outcome[2])
            proxies.append((outcome[0], outcome[1], outcome[3]))
    hosts = [row[2][0] for row in sorted(rows, key=lambda row: row[1])]
    layout = engine_launch.rank_layout(hosts)
    if error:
        raise EngineError(f"hvd_trainer.spark.run: the MPI job did not start: {error}")
    return engine_launch.gather(outcomes, num_proc, name, engine_launch.host_of_ranks(layout),
                                code or 0, messages, proxies=proxies)


def _write(stream, data: bytes) -> None:
    if data:
        stream.write(data.decode(errors="replace") if isinstance(stream, io.TextIOBase)
                     or hasattr(stream, "encoding") else data)
        stream.flush()


def run_elastic(*args, **kwargs):
    """horovod.spark.run_elastic: refused (ValueError with the reason)."""
    raise ValueError(_ELASTIC)
