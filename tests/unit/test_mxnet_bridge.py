"""The NDArray <-> NumPy bridge: zero-copy views that share memory and respect MXNet's engine."""
import mxnet as mx
import numpy as np
import pytest

from hvd_trainer.mxnet import bridge

DTYPES = ["float32", "float16", "float64", "int32", "int64", "uint8"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx", [mx.cpu(0), mx.cpu(1)])
def test_views_share_memory_with_the_ndarray(dtype, ctx):
    values = np.arange(12).reshape(3, 4).astype(dtype)
    x = mx.nd.array(values, ctx=ctx, dtype=dtype)
    view = bridge.read_view(x)
    np.testing.assert_array_equal(view, values)
    x += 1  # an engine write: the view taken earlier sees it once it has finished
    x.wait_to_read()
    np.testing.assert_array_equal(view, values + 1)
    bridge.write_view(x)[1] = 7  # a NumPy write: MXNet sees it without any copy
    expected = values + 1
    expected[1] = 7
    np.testing.assert_array_equal(x.asnumpy(), expected)
    assert view.dtype == np.dtype(dtype) and view.shape == (3, 4)


def test_view_of_a_row_slice_starts_at_the_slice():
    x = mx.nd.arange(20).reshape((5, 4))
    part = x[1:3]  # shares x's memory at an offset
    np.testing.assert_array_equal(bridge.read_view(part), np.arange(4, 12).reshape(2, 4))
    bridge.write_view(part)[...] = -1
    assert (x.asnumpy()[1:3] == -1).all() and (x.asnumpy()[[0, 3, 4]] >= 0).all()


def test_read_view_waits_for_pending_writes():
    a = mx.nd.ones((800, 800)) * 0.5
    product = mx.nd.dot(a, a)  # queued, typically still running when the view is taken
    product += 1
    np.testing.assert_array_equal(bridge.read_view(product), np.full((800, 800), 201.0))


def test_write_view_waits_for_pending_reads():
    a = mx.nd.ones((800, 800))
    product = mx.nd.dot(a, a)  # reads a; writing a must wait until this is done
    bridge.write_view(a)[...] = 0
    np.testing.assert_array_equal(product.asnumpy(), np.full((800, 800), 800.0))
    assert not a.asnumpy().any()


def test_assign_and_to_ndarray():
    x = mx.nd.zeros((2, 3), ctx=mx.cpu(1), dtype="int64")
    bridge.assign(x, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(x.asnumpy(), np.arange(6).reshape(2, 3))
    y = bridge.to_ndarray(np.arange(4, dtype=np.float16), mx.cpu(1))
    assert y.context == mx.cpu(1) and y.dtype == np.float16


def test_empty_arrays_have_empty_views():
    x = mx.nd.empty((0, 3))
    assert bridge.read_view(x).shape == (0, 3) and bridge.write_view(x).shape == (0, 3)


def test_check_dense_names_the_argument():
    with pytest.raises(TypeError, match="grads\\[2\\] must be an mxnet NDArray"):
        bridge.check_dense(np.ones(3), "grads[2]")
    with pytest.raises(TypeError, match="weight has storage type 'row_sparse'"):
        bridge.check_dense(mx.nd.zeros((3, 2)).tostype("row_sparse"), "weight")
    x = mx.nd.ones(2)
    assert bridge.check_dense(x, "x") is x
