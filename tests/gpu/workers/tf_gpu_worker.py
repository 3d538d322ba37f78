"""hvd_trainer.tensorflow hands eager GPU tensors to the core through DLPack without a host
copy, and takes GPU results back the same way (tensorflow/bridge.py). TensorFlow's CPU build
makes no GPU tensors: where TensorFlow sees no GPU, a stand-in GPU tensor (CuPy device
memory with TensorFlow's DLPack methods, whose ``numpy()`` refuses to copy) takes a GPU
tensor's place, and bridge.from_dlpack gives one back; where it sees one, real ones."""
from gpu_common import data, place_gpus, run_cases

place_gpus()
import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_trainer.tensorflow as hvd  # noqa: E402
from hvd_trainer.collectives import ops as core  # noqa: E402
from hvd_trainer.collectives.dlpack import Capsule  # noqa: E402
from hvd_trainer.tensorflow import bridge  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
REAL = bool(tf.config.list_physical_devices("GPU"))


class StandInGPUTensor:
    """What the bridge reads of an eager GPU tensor: its dtype and its DLPack methods; its
    ``numpy()`` would copy it to the host, and raises unless ``host_copy``."""

    def __init__(self, array, dtype=None, host_copy=None):
        self.array, self.host_copy = array, host_copy
        self.dtype = dtype or tf.as_dtype(array.dtype)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, stream=None):
        return self.array.toDlpack()

    def numpy(self):
        if self.host_copy is None:
            raise AssertionError("a GPU tensor was copied to the host")
        return self.host_copy


if not REAL:
    bridge.from_dlpack = lambda capsule: StandInGPUTensor(cupy.from_dlpack(capsule))


def on_gpu(values: np.ndarray):
    if REAL:
        with tf.device("GPU:0"):
            return tf.constant(values)
    return StandInGPUTensor(cupy.asarray(values))


def memory(tensor) -> int:
    """The device address of a GPU tensor's memory."""
    return cupy.from_dlpack(Capsule(tensor.__dlpack__(), tensor.__dlpack_device__())).data.ptr


def values(tensor) -> np.ndarray:
    return tensor.numpy() if REAL else tensor.array.get()


def an_eager_gpu_tensor_reaches_the_core_without_a_host_copy() -> None:
    x = on_gpu(data(rank, (5, 3)))
    given = []

    def work(a):
        given.append(a)
        return [core.allreduce(a, hvd.Sum, "tf.gpu", prescale_factor=2.0)]

    out = bridge.call(work, [x], [tf.float32], device=True)[0]
    assert isinstance(given[0], cupy.ndarray) and given[0].data.ptr == memory(x)
    assert out.__dlpack_device__()[0] == 2, "the result is not in GPU memory"
    np.testing.assert_allclose(values(out), sum(2 * data(r, (5, 3)) for r in range(size)),
                               rtol=1e-5)


def host_tensors_and_bfloat16_go_through_numpy() -> None:
    half = data(rank, 4).astype(ml_dtypes.bfloat16)
    for x in (tf.constant(data(rank, 4)),
              StandInGPUTensor(cupy.zeros(4, cupy.float32), tf.bfloat16, host_copy=half)):
        given = []
        out = bridge.call(lambda a: given.append(a) or [core.allreduce(a, hvd.Sum, "tf.host")],
                          [x], [x.dtype], device=True)[0]
        assert isinstance(given[0], np.ndarray) and out.device.endswith("CPU:0"), out.device


def the_dense_collectives_ask_for_gpu_memory_and_the_others_do_not() -> None:
    asked = []
    original = bridge.call

    def recording(function, inputs, dtypes, shapes=None, name=None, device=False):
        asked.append(device)
        return original(function, inputs, dtypes, shapes, name, device)

    t = tf.constant(data(rank, (2 * size, 3)))
    slices = tf.IndexedSlices(t, tf.range(2 * size), tf.constant([2 * size, 3]))
    calls = {True: [lambda: hvd.allreduce(t), lambda: hvd.grouped_allreduce([t]),
                    lambda: hvd.allgather(t), lambda: hvd.grouped_allgather([t]),
                    lambda: hvd.broadcast(t, 0), lambda: hvd.reducescatter(t),
                    lambda: hvd.grouped_reducescatter([t]),
                    lambda: hvd.broadcast_variables([tf.Variable(t)], 0)],
             False: [lambda: hvd.alltoall(t), lambda: hvd.allreduce(slices)]}
    bridge.call = recording
    try:
        for device, functions in calls.items():
            for function in functions:
                asked.clear()
                function()
                assert asked == [device], (function, asked)
    finally:
        bridge.call = original


run_cases({"an_eager_gpu_tensor_reaches_the_core_without_a_host_copy":
               an_eager_gpu_tensor_reaches_the_core_without_a_host_copy,
           "host_tensors_and_bfloat16_go_through_numpy":
               host_tensors_and_bfloat16_go_through_numpy,
           "the_dense_collectives_ask_for_gpu_memory_and_the_others_do_not":
               the_dense_collectives_ask_for_gpu_memory_and_the_others_do_not})
