"""Settings from the environment (``HVD_<NAME>``, or Horovod's ``HOROVOD_<NAME>``): their
defaults, their parsers, and how the ranks agree on them at init.

Settings that decide the wire pattern (:data:`AGREED_SETTINGS`) are rank 0's on every rank,
so that all ranks move the same bytes; the others (:data:`OWN_SETTINGS`) are each rank's own.
Every rank reads and parses its view, the views travel in one exchange, and a malformed value
on any rank raises the same error on every rank.
"""
import functools
import logging
import math
import os
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

log = logging.getLogger("hvd_trainer")

DEFAULT_FUSION_THRESHOLD = 64 << 20  # bytes; chosen in benchmarks/README.md
DEFAULT_RING_THRESHOLD = 1 << 20  # bytes; `auto` switches from native to ring here
DEFAULT_STALL_CHECK_SECONDS = 60.0  # as Horovod
# The trainer's gradient buckets, and overlap with backward: both measured on 2 ranks
# sharing 2 cores; see benchmarks/README.md for the figures.
DEFAULT_BUCKET_THRESHOLD = 16 << 20
DEFAULT_OVERLAP = 0


def env(name: str, default: Optional[str] = None) -> Optional[str]:
    """Read ``HVD_<name>``, falling back to Horovod's ``HOROVOD_<name>`` spelling."""
    value = os.environ.get("HVD_" + name)
    if value is None:
        value = os.environ.get("HOROVOD_" + name)
    return default if value in (None, "") else value


# Settings that decide the wire pattern, so every rank must use the same: rank 0's values,
# read from its environment at init (Horovod's way). Each is (default, parser).


def _algorithm(raw: str) -> str:
    if raw not in ("ring", "native", "auto"):
        raise ValueError("is not an allreduce algorithm; use ring, native or auto")
    return raw


def _gpu_communicator(raw: str) -> str:
    if raw not in ("auto", "nccl", "mpi"):
        raise ValueError("is not a GPU communicator; use auto, nccl or mpi")
    return raw


def _whole(raw: str, fix: str = "0 or more") -> int:
    try:
        number = float(raw)
    except ValueError:
        raise ValueError("is not a number; set it to an integer") from None
    if not math.isfinite(number):
        raise ValueError(f"is not a finite number; set it to {fix}")
    if number < 0:
        raise ValueError(f"is negative; set it to {fix}")
    return int(number)


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError("is not a number of seconds >= 0; set it to 0 (never) or more")
    return value


_count = functools.partial(_whole, fix="a number of bytes, or 0")


def _text(raw: str) -> str:
    return raw


AGREED_SETTINGS: Dict[str, Tuple[Any, Callable[[str], Any]]] = {
    "FUSION_THRESHOLD": (DEFAULT_FUSION_THRESHOLD, _count),
    "ALLREDUCE_ALGO": ("auto", _algorithm),
    "RING_THRESHOLD": (DEFAULT_RING_THRESHOLD, _count),
    "BUCKET_THRESHOLD": (DEFAULT_BUCKET_THRESHOLD, _count),
    "OVERLAP": (DEFAULT_OVERLAP, _count),
    "GPU_COMMUNICATOR": ("auto", _gpu_communicator),
    # Host-then-cross collectives of the world (see hvd_trainer/collectives/hierarchical.py);
    # off by default, as measured in benchmarks/hierarchical.py.
    "HIERARCHICAL_ALLREDUCE": (0, _whole),
    "HIERARCHICAL_ALLGATHER": (0, _whole),
    # The reducer's autotuner (see hvd_trainer/training/autotune.py); defaults as Horovod's.
    "AUTOTUNE": (0, _whole),
    "AUTOTUNE_LOG": ("", _text),
    "AUTOTUNE_WARMUP_SAMPLES": (3, _whole),
    "AUTOTUNE_STEPS_PER_SAMPLE": (10, _whole),
}
# Settings that each rank keeps its own value of, read in the same exchange so that a
# malformed one raises on every rank alike.
OWN_SETTINGS: Dict[str, Tuple[Any, Callable[[str], Any]]] = {
    # A rank waiting this long for the others logs who is missing (0: never); after the
    # shutdown time it ends the job (0: never).
    "STALL_CHECK_TIME_SECONDS": (DEFAULT_STALL_CHECK_SECONDS, _seconds),
    "STALL_SHUTDOWN_TIME_SECONDS": (0.0, _seconds),
}


class View(NamedTuple):
    """One rank's view of a setting."""

    raw: Optional[str]  # the variable's text, None when unset
    value: Any  # parsed, or the default
    error: Optional[str]  # why the text does not parse, or None


def read_settings() -> Dict[str, View]:
    """This rank's view of each setting, agreed and own."""
    mine = {}
    for name, (default, parse) in {**AGREED_SETTINGS, **OWN_SETTINGS}.items():
        raw = env(name)
        try:
            mine[name] = View(raw, default if raw is None else parse(raw), None)
        except ValueError as e:
            mine[name] = View(raw, None, f"HVD_{name}={raw!r} {e}")
    return mine


def agree_settings(every: Sequence[Dict[str, View]], rank: int) -> Dict[str, Any]:
    """Rank 0's settings (this rank's own for OWN_SETTINGS), after every rank's parse errors
    are raised on every rank alike.

    A rank whose own environment says otherwise logs which value it uses instead.
    """
    for r, settings in enumerate(every):
        for view in settings.values():
            if view.error:
                raise ValueError(f"rank {r}: {view.error}; every rank reads its settings at init")
    first = every[0]
    chosen = {name: view.value for name, view in first.items()}
    for name, view in every[rank].items():
        if name in OWN_SETTINGS:
            chosen[name] = view.value
        elif view.value != chosen[name]:
            log.warning("HVD_%s is %r on rank %d but %r on rank 0; every rank uses rank 0's "
                        "value so that all ranks move the same bytes", name, view.raw, rank,
                        first[name].raw)
    return chosen
