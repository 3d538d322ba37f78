"""The adapter's errors are MXNet's: a misused collective raises an ``MXNetError``, as in Horovod.

horovod.mxnet reports a misused collective (a mismatch across ranks, an alltoall whose
splits do not fit, a rank outside the process set) as ``MXNetError``, and Horovod scripts
catch that. The core raises ``ValueError``, ``TypeError`` or ``MismatchError`` (a
``RuntimeError``). At the adapter's boundary such an error becomes an instance of a class
deriving from both ``MXNetError`` and the core's class, with the same message and
attributes, so ``except MXNetError`` and ``except ValueError`` (or ``MismatchError``) both
catch it.
"""
import functools
from typing import Callable, TypeVar

from mxnet.base import MXNetError

from ..coordination.messages import also_raised_as

_F = TypeVar("_F", bound=Callable)


def as_mxnet_error(error: Exception) -> Exception:
    """``error`` as an instance of a class deriving from ``MXNetError`` and its own class
    (``MXNetValueError`` ...): same message, same fields."""
    return also_raised_as(error, MXNetError, "MXNet", __name__)


def raises_mxnet_errors(function: _F) -> _F:
    """Make ``function`` raise its ValueError, TypeError and RuntimeError as MXNet's kind."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (ValueError, TypeError, RuntimeError) as error:
            translated = as_mxnet_error(error)
            if translated is error:
                raise
            raise translated.with_traceback(error.__traceback__) from None
    return wrapper  # type: ignore[return-value]
