"""A rank's reader of a prepared dataset: its own row groups of the Parquet files, in batches
of NumPy arrays, through pyarrow.

The row groups, listed in file-name order, are dealt out round-robin: rank ``r`` of ``size``
reads groups ``r, r + size, ...`` (fewer groups than ranks: every rank reads every group and
keeps rows ``r, r + size, ...``). A rank's stream of rows cycles through its shard without
end, so every rank can take the same number of steps in each epoch however unevenly the rows
fell; ``batches(steps)`` takes the next ``steps`` batches from it. With ``shuffle`` the order
of the groups changes on every pass and rows go through a shuffle buffer, seeded by the seed,
the rank and the pass. The next row groups are read and decoded in a thread while the rank
trains on the current ones (pyarrow releases the GIL while it reads).

Why pyarrow and not Petastorm 0.13.1 (benchmarks/spark_reader.py, docs/performance.md):
Petastorm reads through pyarrow too, adding a worker pool and dependencies the estimators'
batches of NumPy arrays do not need; it does not import with pyarrow 15 or later (it uses
``pyarrow.filesystem`` and ``ParquetDataset(validate_schema=)``), and in an environment of its
own (pyarrow 14) it read at 0.72 of pyarrow's rate, where this reader reads at pyarrow's.
"""
import atexit
import queue
import threading
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np

__all__ = ["RowGroup", "row_groups", "ShardReader"]

_PREFETCH = 2  # row groups decoded ahead of the one being batched
_JOIN_SECONDS = 10.0  # the most a stopped reading thread is waited for (one row group's read)
# The reading threads running now (their stop events): stopped and waited for when their
# stream closes, and at the latest at interpreter exit, so that no pyarrow read is under way
# while the interpreter and pyarrow's own threads shut down (a rank that returned from an
# estimator's fit with its reader still reading ahead died in "terminate called without an
# active exception" as it exited).
_reading: Set[Tuple[threading.Event, threading.Thread]] = set()
_reading_lock = threading.Lock()


def _stop(reading: Sequence[Tuple[threading.Event, threading.Thread]]) -> None:
    """Stop the reading threads ``reading`` and wait for each (_JOIN_SECONDS at most)."""
    for stop, _ in reading:
        stop.set()
    for stop, thread in reading:
        thread.join(_JOIN_SECONDS)
        with _reading_lock:
            _reading.discard((stop, thread))


@atexit.register
def _stop_all() -> None:
    with _reading_lock:
        reading = list(_reading)
    _stop(reading)


class RowGroup(NamedTuple):
    """One row group of one Parquet file."""
    path: str
    index: int
    rows: int


def row_groups(fs: Any, paths: Sequence[str]) -> List[RowGroup]:
    """Every row group of ``paths`` (in the order given), read from the files' footers."""
    import pyarrow.parquet as pq
    groups = []
    for path in paths:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        groups += [RowGroup(path, i, meta.row_group(i).num_rows)
                   for i in range(meta.num_row_groups) if meta.row_group(i).num_rows]
    return groups


class _Shard(NamedTuple):
    """A rank's row groups, and the stride of rows it keeps from each (1: all)."""
    groups: List[RowGroup]
    offset: int
    stride: int


def _deal(groups: List[RowGroup], rank: int, size: int) -> _Shard:
    if len(groups) >= size:
        return _Shard(groups[rank::size], 0, 1)
    return _Shard(groups, rank, size)


def _columns(table: Any, names: Sequence[str]) -> Dict[str, np.ndarray]:
    """A pyarrow table's columns as NumPy arrays; list columns as 2-D arrays."""
    import pyarrow as pa
    out = {}
    for name in names:
        column = table.column(name).combine_chunks()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or \
                pa.types.is_fixed_size_list(column.type):
            values = column.flatten().to_numpy(zero_copy_only=False)
            out[name] = values.reshape(len(column), -1) if len(column) else \
                values.reshape(0, 0)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
    return out


def _concat(parts: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _length(part: Optional[Dict[str, np.ndarray]]) -> int:
    return 0 if not part else len(next(iter(part.values())))


def _take(part: Dict[str, np.ndarray], index: Any) -> Dict[str, np.ndarray]:
    return {name: values[index] for name, values in part.items()}


class ShardReader:
    """Batches (dicts of column name to NumPy array) of rank ``rank``'s rows of the Parquet
    files ``paths`` on filesystem ``fs``."""

    def __init__(self, fs: Any, paths: Sequence[str], columns: Sequence[str], rank: int,
                 size: int, batch_size: int, shuffle: bool = False,
                 shuffle_buffer_size: Optional[int] = None, seed: Optional[int] = None,
                 cache: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: give at least 1")
        self._fs, self._columns = fs, list(columns)
        self._shard = _deal(row_groups(fs, paths), rank, size)
        if not self._shard.groups:
            raise ValueError(f"rank {rank} of {size} has no rows in {list(paths)[:3]}...: "
                             "the dataset is empty")
        self.rows = sum(len(range(self._shard.offset, g.rows, self._shard.stride))
                        for g in self._shard.groups) if self._shard.stride > 1 else \
            sum(g.rows for g in self._shard.groups)
        self._batch_size, self._shuffle = batch_size, shuffle
        self._buffer = (shuffle_buffer_size if shuffle_buffer_size is not None
                        else min(self.rows, 10000)) if shuffle else 0
        self._seed = (seed or 0, rank)
        self._cache: Optional[Dict[RowGroup, Dict[str, np.ndarray]]] = {} if cache else None
        self._stream: Optional[Iterator[Dict[str, np.ndarray]]] = None

    def _read(self, group: RowGroup) -> Dict[str, np.ndarray]:
        if self._cache is not None and group in self._cache:
            return self._cache[group]
        import pyarrow.parquet as pq
        with self._fs.open(group.path, "rb") as f:
            # Read and decoded in this (reading) thread alone, which is joined at exit:
            # Arrow's CPU pool, once started, has threads that can still be joinable when the
            # process exits, and with pre_buffer its IO pool's threads call the Python file's
            # read(); either aborts the process as the interpreter ends ("terminate called
            # without an active exception", seen at a loaded rank's exit and in a CI run).
            table = pq.ParquetFile(f, pre_buffer=False).read_row_group(
                group.index, columns=self._columns, use_threads=False)
        part = _columns(table, self._columns)
        if self._shard.stride > 1:
            part = _take(part, slice(self._shard.offset, None, self._shard.stride))
        if self._cache is not None:
            self._cache[group] = part
        return part

    def _passes(self) -> Iterator[Dict[str, np.ndarray]]:
        """The shard's row groups, decoded, pass after pass (in a reading thread)."""
        pass_number = 0
        while True:
            order = list(self._shard.groups)
            if self._shuffle:
                rng = np.random.default_rng((*self._seed, pass_number, 1))
                order = [order[i] for i in rng.permutation(len(order))]
            for group in order:
                yield self._read(group)
            pass_number += 1

    def _prefetched(self) -> Iterator[Dict[str, np.ndarray]]:
        """_passes() run ahead in a daemon thread; its errors are raised here."""
        ahead: "queue.Queue" = queue.Queue(maxsize=_PREFETCH)
        stop = threading.Event()

        def offer(item: Any) -> bool:
            """Queue ``item`` unless the stream stops first; whether it was queued."""
            while not stop.is_set():
                try:
                    ahead.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def fill() -> None:
            try:
                for part in self._passes():
                    if not offer(part):
                        return
            except BaseException as error:  # handed to the consumer, raised there
                offer(error)

        thread = threading.Thread(target=fill, name="hvd_trainer parquet reader", daemon=True)
        with _reading_lock:
            _reading.add((stop, thread))
        thread.start()
        try:
            while True:
                item = ahead.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            _stop([(stop, thread)])

    def _rows(self) -> Iterator[Dict[str, np.ndarray]]:
        """Blocks of rows in training order: as read, or through the shuffle buffer."""
        if not self._shuffle:
            yield from self._prefetched()
            return
        rng = np.random.default_rng((*self._seed, 0, 2))
        kept: Optional[Dict[str, np.ndarray]] = None
        for part in self._prefetched():
            pool = _concat([kept, part]) if kept else part
            pool = _take(pool, rng.permutation(_length(pool)))
            out = max(0, _length(pool) - self._buffer)
            kept = _take(pool, slice(out, None))
            if out:
                yield _take(pool, slice(0, out))

    def _batches(self) -> Iterator[Dict[str, np.ndarray]]:
        pending: List[Dict[str, np.ndarray]] = []
        count = 0
        for block in self._rows():
            pending.append(block)
            count += _length(block)
            if count < self._batch_size:
                continue
            rows = _concat(pending)
            start = 0
            while count - start >= self._batch_size:
                yield _take(rows, slice(start, start + self._batch_size))
                start += self._batch_size
            pending = [_take(rows, slice(start, None))] if count > start else []
            count -= start

    def batches(self, steps: int) -> Iterator[Dict[str, np.ndarray]]:
        """The next ``steps`` batches of the rank's endless stream of rows."""
        if self._stream is None:
            self._stream = self._batches()
        for _ in range(steps):
            yield next(self._stream)

    def close(self) -> None:
        """Stop reading ahead and wait for the reading thread; a later batches() starts the
        stream again from the shard's start."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
