"""MXNet's DLPack capsules reach an array-API consumer through dlpack.Capsule without a copy.

On a CPU machine the consumer is NumPy; tests/gpu/test_dlpack_cuda.py checks the CUDA side with
CuPy. This is the hand-off bridge.to_cupy makes for GPU NDArrays.
"""
import mxnet as mx
import numpy as np
import pytest

from hvd_trainer.collectives.dlpack import CPU, Capsule
from hvd_trainer.mxnet.bridge import _data_pointer


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8"])
def test_an_mxnet_capsule_gives_numpy_the_ndarray_memory(dtype):
    values = np.arange(12).reshape(3, 4).astype(dtype)
    x = mx.nd.array(values, dtype=dtype)
    view = np.from_dlpack(Capsule(x.to_dlpack_for_read(), (CPU, 0)))
    assert view.__array_interface__["data"][0] == _data_pointer(x)
    assert view.dtype == np.dtype(dtype) and view.shape == (3, 4)
    np.testing.assert_array_equal(view, values)
    x += 1  # an MXNet write after the hand-off shows through the same memory
    x.wait_to_read()
    np.testing.assert_array_equal(view, values + 1)


def test_the_view_outlives_the_ndarray_object():
    x = mx.nd.arange(1000)
    view = np.from_dlpack(Capsule(x.to_dlpack_for_read(), (CPU, 0)))
    del x  # the capsule's deleter, called when NumPy lets go, owns the memory now
    np.testing.assert_array_equal(view, np.arange(1000, dtype=np.float32))

