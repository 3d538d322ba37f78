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
from typing import Callable, Dict, Type, TypeVar

from mxnet.base import MXNetError

_classes: Dict[type, type] = {}
_F = TypeVar("_F", bound=Callable)


def mxnet_class(cls: Type[Exception]) -> Type[Exception]:
    """The class deriving from ``MXNetError`` and ``cls`` (``cls`` itself if it already is one)."""
    if issubclass(cls, MXNetError):
        return cls
    if cls not in _classes:
        _classes[cls] = type(f"MXNet{cls.__name__}", (MXNetError, cls), {
            "__module__": __name__,
            "__doc__": f"A {cls.__name__} that is also an MXNetError, as horovod.mxnet raises."})
    return _classes[cls]


def as_mxnet_error(error: Exception) -> Exception:
    """``error`` as an instance of :func:`mxnet_class` of its class: same message, same fields."""
    cls = mxnet_class(type(error))
    if cls is type(error):
        return error
    translated = cls.__new__(cls)
    translated.args = error.args
    translated.__dict__.update(error.__dict__)
    return translated


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
