"""Optimizer states with the reducer's state (compression residuals) attached, as one value.

Plain optimizer states (what ``gluon.Trainer`` writes) pass through unchanged, so a file
without residuals stays readable by the framework itself.
"""
import pickle
from typing import Any, Tuple

_MAGIC = b"hvd_trainer residuals 1\n"


def attach_residuals(states: bytes, residuals: Any) -> bytes:
    """Optimizer states with the residuals (any picklable value: every rank's, with the
    settings they belong to) appended; ``states`` alone when None."""
    if residuals is None:
        return states
    return _MAGIC + pickle.dumps((states, residuals), pickle.HIGHEST_PROTOCOL)


def detach_residuals(data: bytes) -> Tuple[bytes, Any]:
    """Split what :func:`attach_residuals` wrote; plain optimizer states have no residuals."""
    if not data.startswith(_MAGIC):
        return data, None
    return pickle.loads(data[len(_MAGIC):])
