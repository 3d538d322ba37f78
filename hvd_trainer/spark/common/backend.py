"""horovod.spark.common.backend: how an estimator runs its training function on the ranks.

``SparkBackend`` runs it through :func:`hvd_trainer.spark.run` on the active Spark cluster;
another ``Backend`` (a test's, or one for a cluster outside Spark) may stand in, as in Horovod.
"""
import abc
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["Backend", "SparkBackend", "default_num_proc"]


def default_num_proc() -> int:
    """Spark's default parallelism: the number of task slots of the active cluster."""
    from pyspark import SparkContext
    context = SparkContext._active_spark_context
    if context is None:
        raise ValueError("the Spark estimators need an active SparkSession: create one first "
                         "(SparkSession.builder...getOrCreate())")
    return context.defaultParallelism


class Backend(abc.ABC):
    """Runs a function on every rank and returns the results in rank order."""

    @abc.abstractmethod
    def run(self, fn: Callable, args: Sequence[Any] = (), kwargs: Optional[Dict] = None,
            env: Optional[Dict[str, str]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank (with ``env`` set there); the results in
        rank order."""

    @abc.abstractmethod
    def num_processes(self) -> int:
        """How many ranks run() starts."""


class SparkBackend(Backend):
    """Horovod's SparkBackend: :func:`hvd_trainer.spark.run` with ``num_proc`` ranks (default:
    Spark's default parallelism). ``env`` goes to the ranks (added to what each executor has;
    Horovod copied the driver's whole environment, which hvd_trainer does not: the ranks keep
    their executors' PATH and libraries); the other keywords (``stdout``, ``stderr``,
    ``prefix_output_with_timestamp``, ``start_timeout``, ``verbose``, ``nics``,
    ``extra_mpi_args``) go to spark.run."""

    def __init__(self, num_proc: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 **kwargs: Any) -> None:
        self._num_proc = num_proc or default_num_proc()
        self._env = dict(env or {})
        self._kwargs = kwargs

    def run(self, fn: Callable, args: Sequence[Any] = (), kwargs: Optional[Dict] = None,
            env: Optional[Dict[str, str]] = None) -> List[Any]:
        import hvd_trainer.spark
        return hvd_trainer.spark.run(fn, args=args, kwargs=kwargs, num_proc=self._num_proc,
                                     env={**self._env, **(env or {})}, **self._kwargs)

    def num_processes(self) -> int:
        return self._num_proc
