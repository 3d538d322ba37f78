"""hvd_trainer.collectives.sparse on NumPy in a one-rank world: merging rows, the dense-fallback
rule, and the reduction's result and byte count, against plain NumPy references."""
import numpy as np
import pytest

from hvd_trainer.collectives import sparse


def reference_merge(ids, rows, num_rows):
    """Dense scatter-add, then the touched rows: an independent sum of duplicates."""
    table = np.zeros((num_rows,) + rows.shape[1:], np.float64)
    np.add.at(table, ids, rows)
    touched = np.unique(ids)
    return touched, table[touched]


@pytest.mark.parametrize("row_shape", [(4,), (2, 3)])
def test_merge_sums_duplicates_and_sorts_ids(row_shape):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 30, 50)
    rows = rng.uniform(-1, 1, (50,) + row_shape).astype(np.float32)
    got_ids, got_rows = sparse.merge_rows(ids, rows)
    want_ids, want_rows = reference_merge(ids, rows, 30)
    assert got_ids.dtype == np.int64 and got_rows.dtype == np.float32
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_rows, want_rows, rtol=1e-6, atol=1e-6)


def test_merge_without_duplicates_only_sorts():
    ids = np.array([5, 1, 3])
    rows = np.array([[5.0], [1.0], [3.0]], np.float32)
    got_ids, got_rows = sparse.merge_rows(ids, rows)
    assert got_ids.tolist() == [1, 3, 5] and got_rows.ravel().tolist() == [1.0, 3.0, 5.0]


def test_merge_of_nothing_is_nothing():
    got_ids, got_rows = sparse.merge_rows(np.empty(0, np.int64), np.empty((0, 3), np.float16))
    assert got_ids.shape == (0,) and got_rows.shape == (0, 3) and got_rows.dtype == np.float16


def test_merge_refuses_ids_and_rows_of_different_lengths():
    with pytest.raises(ValueError, match="ids has 2 entries but rows has 3 rows"):
        sparse.merge_rows(np.array([0, 1]), np.zeros((3, 2)))


def test_dense_exactly_when_the_ranks_send_more_rows_than_the_tensor_has():
    # ids travel either way, so the choice is gathered rows vs the dense tensor's rows.
    assert not sparse.use_dense(gathered_rows=0, num_rows=100)
    assert not sparse.use_dense(gathered_rows=100, num_rows=100)
    assert sparse.use_dense(gathered_rows=101, num_rows=100)
    assert sparse.use_dense(gathered_rows=300, num_rows=200)


@pytest.mark.parametrize("force_dense", [False, True])
def test_one_rank_reduction_sums_scales_and_counts_bytes(force_dense):
    rng = np.random.RandomState(1)
    ids = np.array([2, 7, 9])
    rows = rng.uniform(-1, 1, (3, 4)).astype(np.float32)
    got_ids, got_rows, exchange = sparse.allreduce_rows(
        ids, rows, num_rows=10, name=f"unit.sparse.{force_dense}", prescale_factor=0.5,
        force_dense=force_dense)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_allclose(got_rows, 0.5 * rows, rtol=1e-6)
    row_bytes = 4 * 4
    want_bytes = 3 * 8 + (10 * row_bytes if force_dense else 3 * row_bytes)
    assert exchange == sparse.Exchange(force_dense, 3, want_bytes)


def test_rows_unknown_the_dense_path_takes_the_highest_id_gathered_plus_one():
    # A TensorFlow IndexedSlices without dense_shape: the table is as long as the ids need.
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    ids, summed, exchange = sparse.allreduce_rows(np.array([4, 1]), rows, num_rows=None,
                                                  name="unit.sparse.unknown", force_dense=True)
    np.testing.assert_array_equal(ids, [1, 4])
    np.testing.assert_array_equal(summed, rows[[1, 0]])
    assert exchange == sparse.Exchange(True, 2, 2 * 8 + 5 * 3 * 4)
    ids, summed, _ = sparse.allreduce_rows(np.array([], np.int64), np.zeros((0, 3), np.float32),
                                           num_rows=None, name="unit.sparse.none")
    assert ids.size == 0 and summed.shape == (0, 3)
