"""The estimators' rank-side Parquet reader, on files written here with pyarrow: which rows each
rank reads and in what order, batches across row groups and passes, the same step count on
uneven shards, the shuffle (a permutation of the rank's rows per pass), 2-D array columns."""
import threading

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
fsspec = pytest.importorskip("fsspec")

from hvd_trainer.spark.common.reader import ShardReader, row_groups  # noqa: E402


def _files(folder, group_sizes):
    """Parquet files of one row group each, rows numbered 0.. in file order."""
    paths, start = [], 0
    for index, size in enumerate(group_sizes):
        ids = np.arange(start, start + size)
        table = pa.table({"id": ids, "vec": pa.array([[float(i), -float(i)] for i in ids])})
        path = str(folder / f"part-{index:05d}.parquet")
        pq.write_table(table, path)
        paths.append(path)
        start += size
    return paths


def _read(paths, rank, size, batch, steps, **kwargs):
    reader = ShardReader(fsspec.filesystem("file"), paths, ["id", "vec"], rank, size, batch,
                         **kwargs)
    return reader, list(reader.batches(steps))


def test_groups_are_dealt_round_robin_and_read_in_order(tmp_path):
    paths = _files(tmp_path, [4, 4, 4, 4, 4, 4])
    assert [g.rows for g in row_groups(fsspec.filesystem("file"), paths)] == [4] * 6
    for rank in range(3):
        reader, batches = _read(paths, rank, 3, 2, 4)
        mine = np.concatenate([np.arange(4) + 4 * g for g in (rank, rank + 3)])
        np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]), mine)
        assert reader.rows == 8
        for batch in batches:
            assert batch["vec"].shape == (2, 2)
            np.testing.assert_array_equal(batch["vec"][:, 0], batch["id"])


def test_an_uneven_shard_cycles_so_every_rank_takes_the_steps(tmp_path):
    paths = _files(tmp_path, [5, 3])
    # Rank 1 has 3 rows: four batches of 2 take its rows, then again from the start.
    reader, batches = _read(paths, 1, 2, 2, 4)
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]),
                                  [5, 6, 7, 5, 6, 7, 5, 6])
    # batches() goes on where the last call stopped (the next epoch).
    np.testing.assert_array_equal(next(reader.batches(1))["id"], [7, 5])


def test_fewer_groups_than_ranks_split_rows(tmp_path):
    paths = _files(tmp_path, [7])
    for rank in range(3):
        mine = np.arange(7)[rank::3]
        reader, batches = _read(paths, rank, 3, 1, len(mine))
        assert reader.rows == len(mine)
        np.testing.assert_array_equal([b["id"][0] for b in batches], mine)


def test_shuffle_is_a_permutation_of_the_shard_per_pass_and_seeded(tmp_path):
    paths = _files(tmp_path, [6, 6, 6, 6])
    shard = np.concatenate([np.arange(6), np.arange(12, 18)])
    # No buffer: each pass is the shard's groups in a new order, each group permuted.
    _, batches = _read(paths, 0, 2, 4, 6, shuffle=True, shuffle_buffer_size=0, seed=11)
    seen = np.concatenate([b["id"] for b in batches])
    for one_pass in (seen[:12], seen[12:]):
        np.testing.assert_array_equal(np.sort(one_pass), shard)
    assert not np.array_equal(seen[:12], shard) and not np.array_equal(seen[:12], seen[12:])
    # A buffer holds rows back across groups (and passes): only the shard's rows come out.
    _, buffered = _read(paths, 0, 2, 4, 6, shuffle=True, shuffle_buffer_size=5, seed=11)
    ids = np.concatenate([b["id"] for b in buffered])
    assert set(ids) == set(shard) and len(ids) == 24
    _, again = _read(paths, 0, 2, 4, 6, shuffle=True, shuffle_buffer_size=5, seed=11)
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in again]), ids)


def test_the_cache_gives_the_same_rows(tmp_path):
    paths = _files(tmp_path, [3, 3])
    _, plain = _read(paths, 0, 1, 4, 6)
    _, cached = _read(paths, 0, 1, 4, 6, cache=True)
    for a, b in zip(plain, cached):
        np.testing.assert_array_equal(a["id"], b["id"])


def test_a_bad_batch_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="batch_size=0: give at least 1"):
        _read(_files(tmp_path, [2]), 0, 1, 0, 1)


def _reading_threads():
    import threading
    return [t for t in threading.enumerate() if t.name == "hvd_trainer parquet reader"]


def test_close_stops_the_reading_thread_and_a_later_stream_starts_over(tmp_path):
    # A reader reads ahead without end; a rank's fit closes it before returning, so that no
    # pyarrow read is under way when the rank's process exits.
    paths = _files(tmp_path, [2, 2, 2])
    before = set(_reading_threads())  # other tests' readers, not yet collected
    reader = ShardReader(fsspec.filesystem("file"), paths, ["id", "vec"], 0, 1, 2)
    first = next(reader.batches(1))["id"]
    mine = set(_reading_threads()) - before
    assert len(mine) == 1
    reader.close()
    assert not any(thread.is_alive() for thread in mine)
    np.testing.assert_array_equal(next(reader.batches(1))["id"], first)
    again = set(_reading_threads()) - before
    reader.close()
    assert len(again) == 1 and not any(thread.is_alive() for thread in again)


class _ThreadsThatRead:
    """A filesystem whose files note the name of each thread that reads them."""

    def __init__(self):
        self.fs, self.names = fsspec.filesystem("file"), set()

    def open(self, path, mode):
        names, opened = self.names, self.fs.open(path, mode)

        class Noted:
            def __getattr__(self, attribute):
                return getattr(opened, attribute)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                opened.close()

            def read(self, *args):
                names.add(threading.current_thread().name)
                return opened.read(*args)

            def readinto(self, *args):
                names.add(threading.current_thread().name)
                return opened.readinto(*args)

        return Noted()


def test_files_are_read_only_in_the_caller_and_the_reading_thread(tmp_path):
    # Arrow's own threads (its IO pool reads ahead with pre_buffer) would call the Python
    # file's read(); one doing so as the interpreter ends aborts the process, and only the
    # reading thread is stopped and joined at exit.
    fs = _ThreadsThatRead()
    reader = ShardReader(fs, _files(tmp_path, [2, 2, 2]), ["id", "vec"], 0, 1, 2)
    batches = list(reader.batches(3))
    reader.close()
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]), np.arange(6))
    assert fs.names <= {threading.current_thread().name, "hvd_trainer parquet reader"}, fs.names
    assert "hvd_trainer parquet reader" in fs.names


def test_a_reader_still_reading_at_exit_is_stopped_before_the_interpreter_ends(tmp_path):
    # Exit handlers run last-registered first: one registered before the reader's module is
    # imported sees what the reader's own handler left.
    import subprocess
    import sys
    paths = _files(tmp_path, [2, 2, 2])
    script = f"""
import atexit, threading
atexit.register(lambda: print("reading at exit:", [t.name for t in threading.enumerate()
                                                   if t.name == "hvd_trainer parquet reader"]))
import fsspec
from hvd_trainer.spark.common.reader import ShardReader
reader = ShardReader(fsspec.filesystem("file"), {paths!r}, ["id"], 0, 1, 2)
next(reader.batches(1))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "reading at exit: []" in done.stdout, done.stdout
