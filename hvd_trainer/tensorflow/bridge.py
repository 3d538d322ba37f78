"""Moving tf.Tensor data to and from the NumPy arrays the core works on, eagerly or in a graph.

**Eagerly** a collective reads its tensors' values as NumPy arrays (``Tensor.numpy()``), runs
the core's collective on them and wraps the results as tensors. **In a graph** (inside a
``tf.function``, a Keras ``model.fit`` step, or a TF1 graph) the same Python function runs
as a ``tf.numpy_function`` op when the graph executes: :func:`call` hides the difference.
Such ops are stateful, so TensorFlow runs them in the order the program creates them (its
automatic control dependencies), the same order on every rank, as the core requires. What
the bridge costs per call, eager and in a ``tf.function``, is measured by
``benchmarks/tf_bridge.py``.

**GPU tensors, eagerly.** The collectives that the core runs on GPU memory (allreduce,
allgather, broadcast, reducescatter and their grouped forms) take an eager tensor in GPU
memory as a CuPy array sharing it, through DLPack (``to_dlpack`` returns once TensorFlow's
writes to it are done), without a copy to the host, and their CuPy results become GPU tensors
the same way, once the GPU work on them is done (TensorFlow reads them on streams of its
own). Where CuPy cannot run, for dtypes CuPy lacks (bfloat16), in a graph (a
``tf.numpy_function`` takes host arrays), and for the other collectives, a GPU tensor is
copied to host memory by ``numpy()`` and the result lives on the CPU (TensorFlow moves it
back where an op needs it). NumPy has no bfloat16; TensorFlow gives ``ml_dtypes.bfloat16``
arrays, which the core takes.
"""
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..collectives.dlpack import CUDA, Capsule
from ..runtime import runtime

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
    """An eager tensor's value as a NumPy array (a NumPy array passes through); a 0-d
    tensor's as a 0-d array, where ``numpy()`` gives a NumPy scalar the core refuses."""
    return value if isinstance(value, np.ndarray) else np.asarray(value.numpy())


def gpu_array(value: Any) -> Any:
    """A CuPy array sharing an eager tensor's GPU memory; None for a tensor elsewhere, of a
    dtype CuPy lacks, or where CuPy cannot run."""
    device = getattr(value, "__dlpack_device__", None)
    if device is None or device()[0] != CUDA or value.dtype == tf.bfloat16 \
            or not runtime.cuda_built():
        return None
    import cupy
    return cupy.from_dlpack(Capsule(value.__dlpack__(), device()))


def from_dlpack(capsule: Any) -> tf.Tensor:
    """TensorFlow's tensor over a ``dltensor`` capsule's memory (tests replace it where
    TensorFlow's CPU build cannot take GPU memory)."""
    return tf.experimental.dlpack.from_dlpack(capsule)


def gpu_tensor(array: Any) -> tf.Tensor:
    """A GPU tensor sharing CuPy ``array``'s memory, once the GPU work on it is done: the
    core queued it on the communication thread's current stream, CuPy's null stream."""
    import cupy
    with cupy.cuda.Device(array.device.id):
        cupy.cuda.Stream.null.synchronize()
    return from_dlpack(array.toDlpack())


def call(function: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
         dtypes: Sequence[tf.DType], shapes: Optional[Sequence[Any]] = None,
         name: Optional[str] = None, device: bool = False) -> List[tf.Tensor]:
    """``function(*arrays)`` on the inputs' values, its arrays returned as tensors of
    ``dtypes``: now when eager, otherwise as a ``tf.numpy_function`` op of the graph being
    built (whose outputs get ``shapes``, where known). With ``device``, eager GPU tensors
    reach ``function`` as CuPy arrays (see the module docstring) and CuPy results come back
    as GPU tensors."""
    if eager():
        arrays = [(gpu_array(t) if device else None) for t in inputs]
        results = function(*[to_numpy(t) if a is None else a for t, a in zip(inputs, arrays)])
        return [tf.convert_to_tensor(np.asarray(r), dtype=d)
                if isinstance(r, (np.ndarray, np.generic)) else gpu_tensor(r)
                for r, d in zip(results, dtypes)]
    @plain_python
    def on_arrays(*arrays: np.ndarray) -> List[np.ndarray]:
        # A 0-d input arrives as a NumPy scalar: made an array, as to_numpy does.
        results = function(*[np.asarray(a) for a in arrays])
        return [np.asarray(r, dtype=d.as_numpy_dtype) for r, d in zip(results, dtypes)]

    outputs = tf.numpy_function(on_arrays, list(inputs), list(dtypes), stateful=True,
                                name=_op_name(name))
    if isinstance(outputs, tf.Tensor):
        outputs = [outputs]
    outputs = list(outputs)
    for output, shape in zip(outputs, shapes or ()):
        if shape is not None:
            output.set_shape(shape)
    return outputs


def graph_name(kind: str, name: Optional[str]) -> Optional[str]:
    """``name``; for an unnamed collective in a TF1 graph being built, a name made from the
    graph's unique op names, the same on every rank (which builds the same graph). A TF1
    session runs independent ops in any order, on several threads; the core matches named
    calls by name, so such ops meet whatever order each rank runs them in. A ``tf.function``
    runs them in program order: there they keep automatic names, which pair the ranks'
    calls in order, so ranks whose functions differ get a mismatch error (names that never
    meet would wait)."""
    graph = tf.compat.v1.get_default_graph()
    if name is not None or eager() or graph.building_function:
        return name
    return f"{kind}.graph.{graph.unique_name(kind)}"


def _op_name(name: Optional[str]) -> Optional[str]:
    """A graph op name from a collective's name (TensorFlow allows fewer characters)."""
    if name is None:
        return None
    cleaned = "".join(c if c.isalnum() or c in "_." else "_" for c in name)
    return cleaned if cleaned[:1].isalnum() else f"hvd_{cleaned}"
