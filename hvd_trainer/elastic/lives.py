"""What one life of an elastic job learns from hvdrun, and the check a restart makes: a
restart that finds no commit although an earlier life wrote one fails instead of training
again from the start, unless the user allowed that (``hvdrun --elastic-allow-fresh-start``).

hvdrun counts the lives (``HVD_ELASTIC_RESTART``) and hears, at rank 0's questions on its
notice port, the newest commit that rank 0 had written by then; each life gets that number in
``HVD_ELASTIC_COMMITTED``. Commits can vanish between lives (a cleaner of /dev/shm, a host
rebooted, a user's ``rm``): without this check the next life would begin again at step 0
and the job would end with 0 as if nothing had happened.
"""
import logging
import os
from typing import Sequence

from hvd_trainer_launch.protocol import (ALLOW_FRESH_START_VARIABLE, COMMITTED_VARIABLE,
                                          RESTART_VARIABLE)

log = logging.getLogger("hvd_trainer")

ALLOW_FRESH_START_FLAG = "--elastic-allow-fresh-start"


class CommitsLostError(RuntimeError):
    """A restart found no commit on any rank, though an earlier life of the job wrote one."""


def count_variable(name: str, default: int = 0) -> int:
    """The whole number >= 0 in the environment variable ``name`` (``default`` when unset or
    empty); ValueError naming the variable when it holds anything else."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name}={os.environ[name]!r} is not a whole number >= 0; hvdrun sets "
                         f"it for the ranks of an elastic job: unset it, or start the job with "
                         "hvdrun")
    return int(value)


def restarts() -> int:
    """How many times hvdrun restarted the job before this life (0 outside elastic mode)."""
    return count_variable(RESTART_VARIABLE)


def no_commit_found(rank: int, folders: Sequence[str]) -> None:
    """Called on every rank when no rank holds a commit (``folders``: where this rank looked).
    On the first life nothing happens. On a restart after commits were written,
    CommitsLostError on every rank ends the job (every rank fails, so hvdrun ends it), unless
    a fresh start is allowed: then rank 0 says so in an error line and training begins
    again."""
    restart = restarts()
    written = count_variable(COMMITTED_VARIABLE)
    if restart == 0 or written == 0:
        if restart and rank == 0:
            log.info("restart %d: no earlier life wrote a commit; training starts from the "
                     "initial state", restart)
        return
    lost = (f"restart {restart} of the elastic job finds no commit on any rank, though an "
            f"earlier life wrote commit {written}: the job's commit folders "
            f"({', '.join(folders) or 'none set'}) were removed or lost")
    if os.environ.get(ALLOW_FRESH_START_VARIABLE, "") in ("", "0"):
        raise CommitsLostError(
            f"{lost}. Ending the job instead of training again from the initial state; to "
            f"allow that, run hvdrun with {ALLOW_FRESH_START_FLAG} (or set "
            f"{ALLOW_FRESH_START_VARIABLE}=1)")
    if rank == 0:
        log.error("%s; %s is set: training starts again from the initial state", lost,
                  ALLOW_FRESH_START_VARIABLE)
