"""horovod.spark.run_elastic over hvd_trainer's elastic engine jobs (engines.elastic: hvdrun's
elastic mode, its hosts the engine's): the Spark side is spark_agents (slots kept requested as
one-task jobs; each executor with a linked task one of the job's hosts). Its arguments are
checked as Horovod's are, before anything starts."""
import numbers
import os
import time
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from hvd_trainer_launch.engines import (calls, checks as engine_checks, elastic,
                                        launch as engine_launch, spark_agents)
from hvd_trainer_launch.engines.calls import EngineTimeout
from hvd_trainer_launch.engines.spark_run import active_context

WHERE = "hvd_trainer.spark.run_elastic"
# Horovod's defaults, and the variables it reads first.
DEFAULT_START_TIMEOUT = 600.0
START_TIMEOUT_VARIABLE = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_ELASTIC_TIMEOUT = 600.0
ELASTIC_TIMEOUT_VARIABLE = "HOROVOD_ELASTIC_TIMEOUT"


class ElasticArguments(NamedTuple):
    """run_elastic's arguments once checked, with Horovod's defaults filled in."""

    num_proc: int  # the slots the first life waits for
    min_num_proc: int  # fewer usable slots than this for elastic_timeout end the job
    max_num_proc: int  # the slots kept requested from Spark: the most ranks a life has
    start_timeout: float
    elastic_timeout: float
    reset_limit: Optional[int]
    env: Dict[str, str]  # for the ranks
    nics: List[str]
    verbose: bool  # hvdrun's --verbose (verbose >= 2)
    timestamps: bool  # hvdrun's --prefix-output-with-timestamp


def _seconds(value: Any, name: str, variable: str, default: float) -> float:
    """``value`` (or ``$variable``, else ``default`` when None) as seconds > 0; ValueError
    naming ``name`` (or the variable) otherwise."""
    if value is None:
        found = os.environ.get(variable)
        if found is None:
            return default
        try:
            value = float(found)
        except ValueError:
            raise ValueError(f"{WHERE}: ${variable}={found!r} is not a number of seconds") \
                from None
        name = f"${variable}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{WHERE}: {name}={value!r} must be a number of seconds > 0")
    return float(value)


def _alias(value: Any, old: Any, name: str, old_name: str) -> Any:
    """``value``, or the deprecated ``old`` (Horovod's min_np, max_np) with its warning."""
    if old is None:
        return value
    if value is not None:
        raise ValueError(f"{WHERE}: give {name} or the deprecated {old_name}, not both")
    warnings.warn(f"{old_name} is deprecated, use {name} instead", DeprecationWarning,
                  stacklevel=3)
    return old


def check_arguments(num_proc: Any, min_num_proc: Any, max_num_proc: Any, start_timeout: Any,
                    elastic_timeout: Any, reset_limit: Any, env: Any, verbose: Any, nics: Any,
                    prefix_output_with_timestamp: bool, parallelism: int, min_np: Any = None,
                    max_np: Any = None) -> ElasticArguments:
    """The checked arguments: ``num_proc`` (default: Spark's default ``parallelism``),
    ``min_num_proc`` and ``max_num_proc`` (default: ``num_proc``) ints >= 1 in that order,
    the timeouts seconds > 0, ``reset_limit`` None or an int >= 0, ``env`` variables for the
    ranks, ``nics`` names of network interfaces; ValueError naming the first that is not."""
    min_num_proc = _alias(min_num_proc, min_np, "min_num_proc", "min_np")
    max_num_proc = _alias(max_num_proc, max_np, "max_num_proc", "max_np")
    num_proc = parallelism if num_proc is None else \
        engine_checks.check_count(num_proc, "num_proc", WHERE)
    low = num_proc if min_num_proc is None else \
        engine_checks.check_count(min_num_proc, "min_num_proc", WHERE)
    high = num_proc if max_num_proc is None else \
        engine_checks.check_count(max_num_proc, "max_num_proc", WHERE)
    if not low <= num_proc <= high:
        raise ValueError(f"{WHERE}: min_num_proc={low} <= num_proc={num_proc} <= "
                         f"max_num_proc={high} does not hold: the first life waits for num_proc "
                         "slots, and a life has between min_num_proc and max_num_proc ranks")
    if reset_limit is not None and (isinstance(reset_limit, bool)
                                    or not isinstance(reset_limit, int) or reset_limit < 0):
        raise ValueError(f"{WHERE}: reset_limit={reset_limit!r} must be None or an int >= 0")
    if nics is not None and (isinstance(nics, str) or not isinstance(nics, (Sequence, set))
                             or not all(isinstance(nic, str) and nic for nic in nics)):
        raise ValueError(f"{WHERE}: nics={nics!r} must be a list (or set) of network "
                         "interface names, e.g. ['eth0']")
    if isinstance(verbose, bool) or not isinstance(verbose, int):
        raise ValueError(f"{WHERE}: verbose={verbose!r} must be an int (0-2)")
    return ElasticArguments(
        num_proc, low, high,
        _seconds(start_timeout, "start_timeout", START_TIMEOUT_VARIABLE, DEFAULT_START_TIMEOUT),
        _seconds(elastic_timeout, "elastic_timeout", ELASTIC_TIMEOUT_VARIABLE,
                 DEFAULT_ELASTIC_TIMEOUT),
        reset_limit, engine_checks.rank_env(env, "env", WHERE),
        sorted(nics) if isinstance(nics, set) else list(nics or ()), verbose >= 2,
        bool(prefix_output_with_timestamp))



def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
                elastic_timeout: Optional[float] = None, reset_limit: Optional[int] = None,
                env: Optional[Dict[str, str]] = None, stdout=None, stderr=None,
                verbose: int = 1, nics: Optional[Sequence[str]] = None,
                prefix_output_with_timestamp: bool = False, min_np: Optional[int] = None,
                max_np: Optional[int] = None, ulfm: Optional[bool] = None) -> List[Any]:
    """horovod.spark.run_elastic: ``fn(*args, **kwargs)`` (which runs its training under
    ``hvd.elastic.run``) on one rank per Spark task, ``max_num_proc`` tasks kept requested; a
    lost executor shrinks the job (down to ``min_num_proc``), which goes on from the last
    commit, and a new one grows it. Returns the final life's results in rank order. Needs an
    active SparkSession. TimeoutError (``Timed out waiting for Spark tasks to start``) when
    fewer than ``num_proc`` tasks run within ``start_timeout``; EngineError naming why the
    job ended otherwise: fewer than ``min_num_proc`` slots for ``elastic_timeout`` seconds,
    more restarts than ``reset_limit``, every executor lost, or a rank's error. ``ulfm``
    (hvd_trainer's own; None: ``$HVD_ELASTIC_ULFM``): under Open MPI 5, the ranks of the
    executors left keep their processes when one is lost (hvdrun's --ulfm)."""
    context = active_context(None, None, WHERE)
    checked = check_arguments(num_proc, min_num_proc, max_num_proc, start_timeout,
                              elastic_timeout, reset_limit, env, verbose, nics,
                              prefix_output_with_timestamp, context.defaultParallelism,
                              min_np, max_np)
    engine_checks.check_function(fn, WHERE)
    flavour = engine_launch.check_launcher().flavour
    in_place = elastic.ulfm_wanted(ulfm, flavour, WHERE)
    settings = elastic.ElasticSettings(
        min_np=checked.min_num_proc, max_np=checked.max_num_proc, np=checked.num_proc,
        reset_limit=checked.reset_limit, elastic_timeout=checked.elastic_timeout,
        start_timeout=checked.start_timeout, nics=checked.nics, verbose=checked.verbose,
        ulfm=in_place,
        hvdrun_args=["--prefix-output-with-timestamp"] if checked.timestamps else [])
    began = time.monotonic()
    agents = spark_agents.SparkAgents(context, checked.max_num_proc)
    try:
        _wait_for_tasks(agents, checked, began, context.defaultParallelism)
        job = elastic.ElasticJob(calls.payload(fn, args, kwargs), flavour=flavour,
                                 settings=settings, serve=agents.serve, env=checked.env,
                                 name=getattr(fn, "__name__", repr(fn)))
        agents.attach(job)
        return job.run(out=stdout, err=stderr)
    finally:
        agents.close()

def _wait_for_tasks(agents: spark_agents.SparkAgents, checked: ElasticArguments, began: float,
                    parallelism: int) -> None:
    """Until ``num_proc`` of the slots' tasks have linked up; EngineTimeout (Horovod's words)
    at ``start_timeout`` from ``began``, naming how many had."""
    while True:
        count = sum(executor.slots for executor in agents.executors())
        if count >= checked.num_proc:
            return
        if time.monotonic() - began >= checked.start_timeout:
            raise EngineTimeout(
                f"Timed out waiting for Spark tasks to start: {count} of the "
                f"{checked.num_proc} tasks started within start_timeout="
                f"{checked.start_timeout:g} s (Spark's default parallelism is {parallelism}): "
                "add executors or ask for a smaller num_proc, or a longer start_timeout if "
                "executors come on demand")
        time.sleep(0.05)
