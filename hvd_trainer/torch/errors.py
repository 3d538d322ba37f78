"""The adapter's errors are Horovod's: a misused collective raises ``HorovodInternalError``.

horovod.torch raises errors found by its background thread (ranks that disagree, splits
that do not fit, a rank outside the process set) as ``HorovodInternalError``, a
``RuntimeError``. The core raises ``ValueError``, ``TypeError`` or ``MismatchError``. When
:func:`synchronize` hands such an error to the caller it becomes an instance of a class
deriving from both ``HorovodInternalError`` and the core's class, with the same message, so
``except HorovodInternalError`` and ``except ValueError`` both catch it.
"""
from typing import Dict


class HorovodInternalError(RuntimeError):
    """A collective failed: raised on every rank of its process set, as in Horovod."""


_classes: Dict[type, type] = {}


def as_horovod_error(error: Exception) -> Exception:
    """``error`` as an instance of a class deriving from HorovodInternalError and its own."""
    cls = type(error)
    if issubclass(cls, HorovodInternalError):
        return error
    if cls not in _classes:
        _classes[cls] = type(f"Horovod{cls.__name__}", (HorovodInternalError, cls), {
            "__module__": __name__,
            "__doc__": f"A {cls.__name__} that is also a HorovodInternalError."})
    translated = _classes[cls].__new__(_classes[cls])
    translated.args = error.args
    translated.__dict__.update(error.__dict__)
    return translated
