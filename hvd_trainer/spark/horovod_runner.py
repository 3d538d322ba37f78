"""Databricks' ``sparkdl.HorovodRunner`` over hvd_trainer: ``HorovodRunner(np=N).run(main,
**kwargs)`` runs ``main(**kwargs)`` on N ranks and returns rank 0's value.

``np > 0`` runs the ranks on the executors, through :func:`hvd_trainer.spark.run`; ``np < 0``
runs ``-np`` ranks on the driver's machine, the usual way to debug, through the same engine
path with the driver as its only agent (hvdrun and its launcher's proxy here, no Spark job,
no SparkSession needed); ``np = 0`` (Databricks' deprecated "every task slot") is refused.
"""
import io
import os
from typing import Any, Callable

from hvd_trainer.spark.runner import run as spark_run
from hvd_trainer_launch import engine_agent, engine_launch

__all__ = ["HorovodRunner"]

_VERBOSITIES = ("all", "log_callback_only")


class _Nowhere(io.TextIOBase):
    """A text stream that drops what it is given (the ranks' output under
    ``driver_log_verbosity='log_callback_only'``)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)


class HorovodRunner:
    """sparkdl.HorovodRunner: ``HorovodRunner(np=N, driver_log_verbosity=...)``, keyword-only
    as Databricks'.

    ``np``: the number of ranks: ``N > 0`` runs them on the executors, one Spark task each
    (an active SparkSession with N free task slots); ``N < 0`` runs ``-N`` ranks on the
    driver's machine with no Spark job; 0 raises ValueError (Databricks deprecated "every
    slot": give the number). ``driver_log_verbosity`` (``np > 0``): ``'all'`` shows every
    rank's output on the driver as it is printed; ``'log_callback_only'`` (Databricks'
    default) shows none of it, as Databricks' notebook does (hvd_trainer has no log callbacks:
    docs/limitations.md); a failing rank's traceback is in the exception either way."""

    def __init__(self, *, np: int, driver_log_verbosity: str = "log_callback_only"):
        if type(np) is not int:
            raise ValueError(f"HorovodRunner: np={np!r}: give an int: N > 0 ranks on the "
                             "executors, or -N to run N ranks on the driver")
        if np == 0:
            raise ValueError("HorovodRunner: np=0 is refused: it meant 'every task slot of "
                             "the cluster', which Databricks deprecated because the slots "
                             "change as executors come and go; give the number of ranks (np=N "
                             "on the executors, np=-N on the driver)")
        if driver_log_verbosity not in _VERBOSITIES:
            raise ValueError(f"HorovodRunner: driver_log_verbosity={driver_log_verbosity!r}: "
                             f"give one of {', '.join(map(repr, _VERBOSITIES))}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """``main(**kwargs)`` on every rank; rank 0's return value (it travels by cloudpickle,
        as Databricks'). An exception on a rank raises EngineError naming the rank and host."""
        if self.num_processor < 0:
            return _run_here(main, kwargs, -self.num_processor)
        quiet = self.driver_log_verbosity == "log_callback_only"
        return spark_run(main, kwargs=kwargs, num_proc=self.num_processor,
                         stdout=_Nowhere() if quiet else None,
                         stderr=_Nowhere() if quiet else None)[0]


def _run_here(main: Callable[..., Any], kwargs: dict, size: int) -> Any:
    """``main(**kwargs)`` on ``size`` ranks of this machine: hvdrun with the launcher's proxy
    run by this process as the only agent; rank 0's result. The ranks' output is shown here."""
    host, secret = engine_agent.hostname(), os.urandom(32)
    launch = engine_launch.AgentLaunch([(host, size)], engine_launch.rank_command(),
                                       flavour=engine_launch.check_launcher().flavour,
                                       secret=secret)
    try:
        line, = launch.proxies()
        outcome = engine_agent.run_proxy(line, engine_launch.payload(main, (), kwargs), secret)
        code = launch.wait()
    except BaseException:  # Ctrl-C, or a start that failed: end the job, then go
        launch.end()
        raise
    return engine_launch.gather(outcome.outcomes, size, getattr(main, "__name__", repr(main)),
                                engine_launch.host_of_ranks([(host, size)]), code,
                                launch.messages,
                                proxies=[(outcome.host, outcome.code, outcome.messages)])[0]
