"""The adapter's errors are TensorFlow's, as in horovod.tensorflow.

horovod.tensorflow reports ranks that disagree (shapes, dtypes, root ranks) as
``tf.errors.FailedPreconditionError`` and bad arguments (alltoall splits that do not fit) as
``tf.errors.InvalidArgumentError``. The core raises ``MismatchError`` (a ``RuntimeError``),
``ValueError`` or ``TypeError``. An eager collective raises such an error as an instance of a
class deriving from both TensorFlow's class and the core's, with the same message, so
``except tf.errors.OpError`` and ``except ValueError`` both catch it. In a graph TensorFlow
itself turns a Python error raised by the op into an ``OpError``: ``ValueError`` and
``TypeError`` become ``InvalidArgumentError``, the rest ``UnknownError`` (with the core's
message), which docs/limitations.md lists.
"""
import functools
from typing import Callable, TypeVar

import tensorflow as tf

from ..coordination.messages import also_raised_as

_F = TypeVar("_F", bound=Callable)


def as_tensorflow_error(error: Exception) -> Exception:
    """``error`` as an instance of a class deriving from TensorFlow's matching ``OpError``
    and its own class: same message and fields."""
    if isinstance(error, (ValueError, TypeError)):
        base, code = tf.errors.InvalidArgumentError, tf.errors.INVALID_ARGUMENT
    else:
        base, code = tf.errors.FailedPreconditionError, tf.errors.FAILED_PRECONDITION
    translated = also_raised_as(error, base, "TF", __name__)
    if translated is not error:
        # OpError keeps its message and code in fields its __init__ would have set.
        translated._message = str(error)
        translated._node_def = translated._op = None
        translated._error_code = code
        translated._experimental_payloads = {}
    return translated


def raises_tensorflow_errors(function: _F) -> _F:
    """Make ``function`` raise its ValueError, TypeError and RuntimeError as TensorFlow's
    kind (see :func:`as_tensorflow_error`)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except tf.errors.OpError:
            raise
        except (ValueError, TypeError, RuntimeError) as error:
            raise as_tensorflow_error(error).with_traceback(error.__traceback__) from None
    return wrapper  # type: ignore[return-value]
