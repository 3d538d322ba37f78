"""The adapter's errors are Horovod's: a misused collective raises ``HorovodInternalError``.

horovod.torch raises errors found by its background thread (ranks that disagree, splits
that do not fit, a rank outside the process set) as ``HorovodInternalError``, a
``RuntimeError``. The core raises ``ValueError``, ``TypeError`` or ``MismatchError``. When
:func:`synchronize` hands such an error to the caller it becomes an instance of a class
deriving from both ``HorovodInternalError`` and the core's class, with the same message, so
``except HorovodInternalError`` and ``except ValueError`` both catch it.
``HorovodInternalError`` is the elastic core's class, so ``hvd.HorovodInternalError`` and
``hvd.elastic.HorovodInternalError`` are one class, as in Horovod.
"""
from ..coordination.messages import also_raised_as
from ..elastic import HorovodInternalError


def as_horovod_error(error: Exception) -> Exception:
    """``error`` as an instance of a class deriving from HorovodInternalError and its own."""
    return also_raised_as(error, HorovodInternalError, "Horovod", __name__)
