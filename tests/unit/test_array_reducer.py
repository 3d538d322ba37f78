"""The core's ArrayReducer in a size-1 world against NumPy: dense gradients in buckets and
outside them, row-sparse ones merged, the agreed kind's form whatever form a step hands over,
missing gradients and the postscale. Across ranks (sums, the predivide factor, compression)
it runs under the TensorFlow adapter (tests/parallel/test_tf.py)."""
import numpy as np

from hvd_trainer.runtime import runtime
from hvd_trainer.training.array_reducer import DENSE, NONE, SPARSE, ArrayReducer


def make(**settings):
    runtime.init()
    return ArrayReducer([(4, 2), (), (5, 3), (3,)], ["<f4", "<f8", "<f4", "<f4"], **settings)


def test_dense_and_rows_come_back_summed_and_scaled():
    reducer = make()
    dense, scalar, table = np.arange(8, dtype=np.float32).reshape(4, 2), np.float64(3.0), None
    ids, rows = np.array([4, 1, 4]), np.ones((3, 3), np.float32)
    out = reducer.reduce([dense, scalar, (ids, rows), table], postscale=3.0)
    assert reducer.kinds == [DENSE, DENSE, SPARSE, NONE]
    np.testing.assert_allclose(out[0], dense * 3.0)
    np.testing.assert_allclose(out[1], 9.0)
    got_ids, got_rows = out[2]
    assert got_ids.tolist() == [1, 4]  # repeats merged, sorted
    np.testing.assert_allclose(got_rows, np.array([[1.0] * 3, [2.0] * 3]) * 3.0)
    assert out[3] is None  # no gradient anywhere yet
    assert not np.shares_memory(out[0], dense)


def test_a_step_in_the_other_form_gets_the_agreed_form():
    reducer = make()
    reducer.reduce([np.ones((4, 2), np.float32), np.float64(1), (np.array([0]),
                    np.ones((1, 3), np.float32)), np.ones(3, np.float32)])
    # Now gradient 0 is dense and 2 sparse: hand them over the other way round.
    out = reducer.reduce([(np.array([3, 3]), np.ones((2, 2), np.float32)), None,
                          np.full((5, 3), 2.0, np.float32), None])
    np.testing.assert_allclose(out[0], [[0, 0], [0, 0], [0, 0], [2, 2]])
    ids, rows = out[2]
    assert ids.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(rows, np.full((5, 3), 2.0))
    assert out[1] is None  # missing on the only rank
    assert reducer.kinds[3] == DENSE and out[3] is None  # kind kept from the first step

