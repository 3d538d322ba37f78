"""Moving tf.Tensor data to and from the NumPy arrays the core works on, eagerly or in a graph.

**Eagerly** a collective reads its tensors' values as NumPy arrays (``Tensor.numpy()``), runs
the core's collective on them and wraps the results as tensors. **In a graph** (inside a
``tf.function``, a Keras ``model.fit`` step, or a TF1 graph) the same Python function runs
as a ``tf.numpy_function`` op when the graph executes: :func:`call` hides the difference.
Such ops are stateful, so TensorFlow runs them in the order the program creates them (its
automatic control dependencies), the same order on every rank, as the core requires. What
the bridge costs per call, eager and in a ``tf.function``, is measured by
``benchmarks/tf_bridge.py``.

Host tensors only: a tensor on a GPU is copied to host memory by ``numpy()`` and the result
lives on the CPU (TensorFlow moves it back where an op needs it). NumPy has no bfloat16;
TensorFlow gives ``ml_dtypes.bfloat16`` arrays, which the core takes.
"""
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

# What the core cannot carry: strings, resources, variants (and quantized types).
# Applied to the adapter's functions that a tf.function may call: AutoGraph runs them as they
# are instead of converting them and every core function they call (slow, and noisy).
plain_python = tf.autograph.experimental.do_not_convert

_REFUSED = (tf.string, tf.resource, tf.variant, tf.qint8, tf.quint8, tf.qint16, tf.quint16,
            tf.qint32)


def check_tensor(tensor: Any, arg: str) -> tf.Tensor:
    """``tensor`` (a tf.Tensor, tf.Variable or anything ``tf.convert_to_tensor`` takes) as a
    tensor; a TypeError naming ``arg`` for what the collectives cannot carry."""
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(f"{arg} is a tf.IndexedSlices; this collective takes dense tensors "
                        "(tf.convert_to_tensor(...) makes it dense; allreduce and "
                        "grouped_allreduce take IndexedSlices)")
    if isinstance(tensor, tf.SparseTensor):
        raise TypeError(f"{arg} is a tf.SparseTensor; pass tf.sparse.to_dense(...)")
    try:
        result = tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{arg} must be a tf.Tensor or tf.Variable, got "
                        f"{type(tensor).__name__} ({error})") from None
    if result.dtype in _REFUSED:
        raise TypeError(f"{arg} has dtype {result.dtype.name}, which collectives do not carry; "
                        "pass a boolean, integer, floating or complex tensor")
    return result


def eager() -> bool:
    """Whether collectives run now (eager execution) rather than when a graph runs."""
    return tf.executing_eagerly()


def to_numpy(value: Any) -> np.ndarray:
    """An eager tensor's value as a NumPy array (a NumPy array passes through)."""
    return value if isinstance(value, np.ndarray) else value.numpy()


def call(function: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
         dtypes: Sequence[tf.DType], shapes: Optional[Sequence[Any]] = None,
         name: Optional[str] = None) -> List[tf.Tensor]:
    """``function(*arrays)`` on the inputs' values, its arrays returned as tensors of
    ``dtypes``: now when eager, otherwise as a ``tf.numpy_function`` op of the graph being
    built (whose outputs get ``shapes``, where known)."""
    if eager():
        results = function(*[to_numpy(t) for t in inputs])
        return [tf.convert_to_tensor(np.asarray(r), dtype=d) for r, d in zip(results, dtypes)]
    @plain_python
    def on_arrays(*arrays: np.ndarray) -> List[np.ndarray]:
        return [np.asarray(r, dtype=d.as_numpy_dtype) for r, d in zip(function(*arrays), dtypes)]

    outputs = tf.numpy_function(on_arrays, list(inputs), list(dtypes), stateful=True,
                                name=_op_name(name))
    if isinstance(outputs, tf.Tensor):
        outputs = [outputs]
    outputs = list(outputs)
    for output, shape in zip(outputs, shapes or ()):
        if shape is not None:
            output.set_shape(shape)
    return outputs


def _op_name(name: Optional[str]) -> Optional[str]:
    """A graph op name from a collective's name (TensorFlow allows fewer characters)."""
    if name is None:
        return None
    cleaned = "".join(c if c.isalnum() or c in "_." else "_" for c in name)
    return cleaned if cleaned[:1].isalnum() else f"hvd_{cleaned}"
