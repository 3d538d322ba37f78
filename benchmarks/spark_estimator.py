"""An epoch of the torch Spark Estimator against the same training loop over in-memory arrays
through hvd_trainer.spark.run, and the one-time Parquet preparation, on a local-cluster.

Both train the same MLP with hvd_trainer.torch's DistributedOptimizer on 3 ranks, the same
batches per rank and steps per epoch; the estimator reads its rows from the store's Parquet
files (hvd_trainer.spark.common.reader), the reference slices NumPy arrays it was handed.
Each is run with 1 and with ``--epochs`` epochs, so the marginal cost of an epoch,
(t(E) - t(1)) / (E - 1), leaves out what a call pays once (the launch, imports, the model's
trip); runs are interleaved over the rounds, medians reported, and the ratio
estimator / in-memory. The preparation (prepare_data: the sizes' aggregation and Spark's
Parquet write) is timed on fresh DataFrames.

    python benchmarks/spark_estimator.py [--rows 96000] [--width 32] [--epochs 3] [--rounds 2]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

RANKS, BATCH, LR = 3, 64, 0.01
JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"


def model(width):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def in_memory(x, y, width, epochs):
    """The rank's loop over its rows (every third), the estimator's steps and batches."""
    import torch
    import hvd_trainer.torch as hvd
    hvd.init()
    net = model(width)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR * hvd.size())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    mine_x = torch.tensor(x[hvd.rank()::hvd.size()], dtype=torch.float32)
    mine_y = torch.tensor(y[hvd.rank()::hvd.size()], dtype=torch.float32)
    steps = len(x) // (BATCH * hvd.size())
    for _ in range(epochs):
        for step in range(steps):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(mine_x[rows]), mine_y[rows].reshape(-1, 1))
            loss.backward()
            optimizer.step()
    return float(loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=96000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import cloudpickle
    import torch
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession
    import hvd_trainer.spark
    import hvd_trainer.spark.torch as hvd_spark
    from hvd_trainer.spark.common import prepare
    from hvd_trainer.spark.common.store import Store
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master(f"local-cluster[1,{RANKS},1024]")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.extraJavaOptions", JVM)
             .config("spark.executor.extraJavaOptions", JVM).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    while spark.sparkContext.defaultParallelism < RANKS:
        time.sleep(0.1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, args.width))
    y = x @ rng.normal(size=args.width)
    rows = [(Vectors.dense(f.tolist()), float(t)) for f, t in zip(x, y)]
    with tempfile.TemporaryDirectory(prefix="hvd_estimator_bench.") as folder:
        store = Store.create(folder)
        preparation = []
        for _ in range(args.rounds):
            df = spark.createDataFrame(rows, ["features", "y"]).coalesce(1).cache()
            df.count()
            start = time.perf_counter()
            with prepare.prepare_data(RANKS, store, df, ["y"], ["features"],
                                      partitions_per_process=1):
                preparation.append(time.perf_counter() - start)
        df = spark.createDataFrame(rows, ["features", "y"]).coalesce(1)

        def estimator(epochs):
            net = model(args.width)
            return hvd_spark.TorchEstimator(
                num_proc=RANKS, store=store, model=net,
                optimizer=torch.optim.SGD(net.parameters(), lr=LR),
                loss=torch.nn.functional.mse_loss, input_shapes=[[-1, args.width]],
                feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=epochs,
                shuffle=False, partitions_per_process=1, verbose=0).fit(df)

        estimator(1)  # prepares the DataFrame once; later fits reuse the files
        times = {("estimator", 1): [], ("estimator", args.epochs): [],
                 ("in-memory", 1): [], ("in-memory", args.epochs): []}
        for _ in range(args.rounds):
            for epochs in (1, args.epochs):
                start = time.perf_counter()
                estimator(epochs)
                times[("estimator", epochs)].append(time.perf_counter() - start)
                start = time.perf_counter()
                hvd_trainer.spark.run(in_memory, args=(x, y, args.width, epochs), num_proc=RANKS)
                times[("in-memory", epochs)].append(time.perf_counter() - start)
    spark.stop()
    per_epoch = {}
    for name in ("estimator", "in-memory"):
        marginal = [(long - short) / (args.epochs - 1) for short, long in
                    zip(times[(name, 1)], times[(name, args.epochs)])]
        per_epoch[name] = statistics.median(marginal)
        print(f"{name:10s} call of 1 epoch {statistics.median(times[(name, 1)]):.2f} s, of "
              f"{args.epochs} {statistics.median(times[(name, args.epochs)]):.2f} s; an epoch "
              f"{per_epoch[name]:.3f} s (range {min(marginal):.3f}..{max(marginal):.3f})")
    print(f"epoch ratio estimator / in-memory: "
          f"{per_epoch['estimator'] / per_epoch['in-memory']:.2f}")
    print(f"preparation of {args.rows} rows x {args.width}: median "
          f"{statistics.median(preparation):.2f} s (range {min(preparation):.2f}.."
          f"{max(preparation):.2f})")


if __name__ == "__main__":
    sys.exit(main())
