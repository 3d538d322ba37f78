"""Launch overhead of the engines: from the call to the moment every rank runs the first line
of the function, for hvd_trainer.run (hvdrun), hvd_trainer.ray.RayExecutor.run (a started
executor on a local Ray instance) and hvd_trainer.spark.run (a local-cluster session), on
the same machine and rank count, calls interleaved, median and best of the rounds. The
engines' one-off costs (Ray's init and start(), Spark's session) are timed once apiece.

    python benchmarks/engine_launch.py [--ranks 3] [--rounds 5]
"""
import argparse
import os
import statistics
import sys
import time

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import header  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def first_line():
    """The time at which the function starts on a rank."""
    import time
    return time.time()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import ray
    from pyspark.sql import SparkSession
    import hvd_trainer
    import hvd_trainer.spark
    from hvd_trainer.ray import RayExecutor

    once = {}
    tic = time.time()
    ray.init(num_cpus=args.ranks, include_dashboard=False, log_to_driver=False)
    once["ray.init"] = time.time() - tic
    tic = time.time()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.ranks)
    executor.start()
    once["RayExecutor.start"] = time.time() - tic
    tic = time.time()
    spark = (SparkSession.builder.master(f"local-cluster[1,{args.ranks},1024]")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    while spark.sparkContext.defaultParallelism < args.ranks:
        time.sleep(0.2)
    once["Spark session (local-cluster)"] = time.time() - tic

    calls = {"hvd_trainer.run (hvdrun)": lambda: hvd_trainer.run(first_line, num_proc=args.ranks),
             "RayExecutor.run": lambda: executor.run(first_line),
             "hvd_trainer.spark.run": lambda: hvd_trainer.spark.run(first_line,
                                                                      num_proc=args.ranks)}
    seconds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            tic = time.time()
            starts = call()
            seconds[name].append(max(starts) - tic)
    executor.shutdown()
    ray.shutdown()
    spark.stop()
    print(header("Engine launch overhead: call to every rank's first line",
                 f"{args.ranks} ranks, {args.rounds} rounds interleaved, MPICH"))
    print("| launcher | median s | best s |\n|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} |")
    print("\n| one-off cost | s |\n|---|---|")
    for name, value in once.items():
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main()
