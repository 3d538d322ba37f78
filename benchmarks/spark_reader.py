"""The Spark estimators' rank reader against pyarrow reading the same files directly.

A prepared dataset's layout (float64 array features, a float label, several Parquet files of
one row group each, as Spark writes them) is written with pyarrow; rank 0 of 3 then reads its
share (every third row group) in batches, three ways, rounds interleaved:

- ours: hvd_trainer.spark.common.reader.ShardReader, no shuffle, batches of NumPy arrays;
- pyarrow: ``ParquetFile.read_row_group`` of the same groups, columns to NumPy (the list
  column flattened and reshaped), sliced into the same batches;
- with ``--petastorm PYTHON``: Petastorm 0.13.1's ``make_batch_reader`` (shard 0 of 3, one
  epoch) run by that interpreter (an environment that has petastorm), same files.

Prints rows per second (median and range over the rounds) and ours / pyarrow.

    python benchmarks/spark_reader.py [--rows 300000] [--width 64] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

RANKS, RANK = 3, 0

_PETASTORM = r'''
import json, sys, time
from petastorm import make_batch_reader
urls, batch = json.loads(sys.argv[1]), int(sys.argv[2])
start = time.perf_counter(); rows = 0
with make_batch_reader(urls, cur_shard=0, shard_count=3, num_epochs=1, shuffle_rows=False,
                       shuffle_row_groups=False, workers_count=2) as reader:
    for part in reader:
        rows += len(part.label)
print(json.dumps({"rows": rows, "seconds": time.perf_counter() - start}))
'''


def write(folder, rows, width, files):
    """``files`` Parquet files of one row group each: features (list<double>), label."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    paths = []
    for index, chunk in enumerate(np.array_split(np.arange(rows), files)):
        features = rng.normal(size=(len(chunk), width))
        table = pa.table({"features": pa.FixedSizeListArray.from_arrays(
            pa.array(features.ravel()), width).cast(pa.list_(pa.float64())),
            "label": pa.array(rng.normal(size=len(chunk)))})
        path = os.path.join(folder, f"part-{index:05d}.parquet")
        pq.write_table(table, path, row_group_size=len(chunk))
        paths.append(path)
    return paths


def ours(paths, batch):
    import fsspec
    from hvd_trainer.spark.common.reader import ShardReader
    start = time.perf_counter()
    reader = ShardReader(fsspec.filesystem("file"), paths, ["features", "label"], RANK, RANKS,
                         batch)
    steps = reader.rows // batch
    rows = sum(len(b["label"]) for b in reader.batches(steps))
    return rows, time.perf_counter() - start


def direct(paths, batch):
    import pyarrow.parquet as pq
    start = time.perf_counter()
    rows, carry = 0, None
    for path in paths[RANK::RANKS]:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            table = parquet.read_row_group(group, columns=["features", "label"])
            features = table.column("features").combine_chunks()
            x = features.flatten().to_numpy().reshape(len(features), -1)
            y = table.column("label").to_numpy()
            if carry is not None:
                x, y = np.concatenate([carry[0], x]), np.concatenate([carry[1], y])
            full = len(y) // batch * batch
            for offset in range(0, full, batch):
                rows += len(y[offset:offset + batch])
            carry = (x[full:], y[full:])
    return rows, time.perf_counter() - start


def petastorm(python, paths, batch):
    out = subprocess.run([python, "-c", _PETASTORM, json.dumps(
        [f"file://{p}" for p in paths]), str(batch)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return found["rows"], found["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--files", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--petastorm", help="a Python that has petastorm 0.13.1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hvd_reader_bench.") as folder:
        paths = write(folder, args.rows, args.width, args.files)
        rates = {"ours": [], "pyarrow": [], "petastorm": []}
        for _ in range(args.rounds):
            for name, run in (("pyarrow", lambda: direct(paths, args.batch)),
                              ("ours", lambda: ours(paths, args.batch))):
                rows, seconds = run()
                rates[name].append(rows / seconds)
            if args.petastorm:
                rows, seconds = petastorm(args.petastorm, paths, args.batch)
                if rows is None:
                    print(f"petastorm: {seconds}")
                    args.petastorm = None
                else:
                    rates["petastorm"].append(rows / seconds)
    print(f"rank {RANK} of {RANKS}: {args.rows // RANKS} rows of {args.width} float64 features, "
          f"{args.files} files, batches of {args.batch}, {args.rounds} rounds")
    for name, values in rates.items():
        if values:
            print(f"{name:10s} {statistics.median(values):12,.0f} rows/s (range "
                  f"{min(values):,.0f}..{max(values):,.0f})")
    ratio = [o / p for o, p in zip(rates["ours"], rates["pyarrow"])]
    print(f"ours / pyarrow: median {statistics.median(ratio):.2f} (range {min(ratio):.2f}.."
          f"{max(ratio):.2f})")
    if rates["petastorm"]:
        print(f"petastorm / pyarrow: median "
              f"{statistics.median(rates['petastorm']) / statistics.median(rates['pyarrow']):.2f}")


if __name__ == "__main__":
    sys.exit(main())
