"""torch_digits.py on a Spark cluster: the same training function, started in one Spark
barrier job by hvd_trainer.spark.run (horovod.spark's API) instead of hvdrun, with no ssh.

    python examples/torch_digits_spark.py --master 'local-cluster[1,3,1024]' --num-proc 3
    python examples/torch_digits_spark.py --master spark://HOST:7077 --num-proc 3

The cluster needs num-proc task slots free at once; the executors must run this Python
(PYSPARK_PYTHON) and find MPICH's mpiexec at the same path. Prints rank 0's epochs (in the
executor's log, and here when the job ends) and every rank's final test accuracy.
"""
import argparse
import os
import sys

import cloudpickle
from pyspark.sql import SparkSession

import hvd_trainer.spark
import torch_digits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local-cluster[1,3,1024]")
    parser.add_argument("--num-proc", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=25)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # The training function travels by value, so the executors need not see this folder.
    cloudpickle.register_pickle_by_value(torch_digits)
    spark = (SparkSession.builder.master(args.master).appName("torch_digits_spark")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        accuracies = hvd_trainer.spark.run(torch_digits.train, kwargs={"epochs": args.epochs},
                                           num_proc=args.num_proc, start_timeout=120)
    finally:
        spark.stop()
    print("test accuracy per rank:", " ".join(f"{a:.4f}" for a in accuracies))


if __name__ == "__main__":
    main()
