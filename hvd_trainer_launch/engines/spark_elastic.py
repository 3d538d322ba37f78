"""horovod.spark.run_elastic over hvd_trainer's elastic engine jobs: its arguments, checked as
Horovod's are, and their meaning for the job (spark_agents says how Spark's tasks become the
job's agents)."""
import numbers
import os
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from hvd_trainer_launch.engines import checks as engine_checks
from hvd_trainer_launch.engines.spark_run import hvdrun_flags

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
    hvdrun_flags: List[str]  # nics, prefix_output_with_timestamp, verbose


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
        hvdrun_flags(sorted(nics) if isinstance(nics, set) else nics,
                     prefix_output_with_timestamp, verbose))

