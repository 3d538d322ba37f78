"""Launch overhead of the engines: from the call to the moment every rank runs the first line
of the function, for hvd_trainer.run (hvdrun), hvd_trainer.ray.RayExecutor.run (a started
executor) and hvd_trainer.spark.run, on the same hosts and rank count, calls interleaved,
median and best of the rounds. The engines' one-off costs (Ray's init and start(), Spark's
session) are timed once apiece.

On one machine (a local Ray instance, a local-cluster Spark session):

    python benchmarks/engine_launch.py [--ranks 3] [--rounds 5]

Across the multi-host test bed's three hosts (root; tests/multihost/testbed.py): a Ray head
and Spark master on h1, a Ray node and a one-core Spark worker on each host, started and
stopped by PID as the fixtures of tests/multihost/test_multihost_engines.py (Ray) and
test_multihost_spark.py (Spark) do; the driver runs on h1, one rank per host (RayExecutor
with num_hosts=3, spark.run on the three executor hosts, hvd_trainer.run with hosts
h1:1,h2:1,h3:1 over the bed's ssh, its folder in the bed's shared one through TMPDIR):

    python benchmarks/engine_launch.py --bed [--rounds 5]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import cloudpickle

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import bed_spark_session, header  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
BED_HOSTS = "h1:1,h2:1,h3:1"


def first_line():
    """The time at which the function starts on a rank."""
    import time
    return time.time()


def measure(calls, rounds):
    """Each call's seconds to every rank's first line, ``rounds`` times, interleaved."""
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            tic = time.time()
            starts = call()
            seconds[name].append(max(starts) - tic)
    return seconds


def report(title, detail, seconds, once):
    import hvd_trainer_launch.mpi as mpi
    flavour = mpi.FLAVOUR_NAMES[mpi.find_launcher().flavour]
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    print(header(title, f"{detail}, {flavour}, commit {commit}"))
    reference = statistics.median(seconds["hvd_trainer.run (hvdrun)"])
    print("| launcher | median s | best s | median / hvdrun's |\n|---|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | "
              f"{statistics.median(values) / reference:.2f} |")
    print("\n| one-off cost | s |\n|---|---|")
    for name, value in once.items():
        print(f"| {name} | {value:.1f} |")


def one_machine(args):
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
    seconds = measure(calls, args.rounds)
    executor.shutdown()
    ray.shutdown()
    spark.stop()
    report("Engine launch overhead: call to every rank's first line",
           f"{args.ranks} ranks on one machine, {args.rounds} rounds interleaved", seconds, once)


def on_bed(args):
    """The driver on h1: join the bed's Ray and Spark clusters, measure, report."""
    import ray
    import hvd_trainer
    import hvd_trainer.spark
    from hvd_trainer.ray import RayExecutor

    once = {}
    tic = time.time()
    ray.init(address=args.ray_address, log_to_driver=False)
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        time.sleep(0.2)
    once["ray.init (joining the bed's cluster)"] = time.time() - tic
    tic = time.time()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=3,
                           num_workers_per_host=1)
    executor.start()
    once["RayExecutor.start"] = time.time() - tic
    tic = time.time()
    spark = bed_spark_session(args.spark_master, args.driver_host, args.jvm_options,
                              "hvd_trainer engine launch")
    while spark.sparkContext.defaultParallelism < 3:
        time.sleep(0.2)
    once["Spark session (the bed's standalone master)"] = time.time() - tic
    calls = {"hvd_trainer.run (hvdrun)": lambda: hvd_trainer.run(first_line, num_proc=3,
                                                                 hosts=BED_HOSTS),
             "RayExecutor.run": lambda: executor.run(first_line),
             "hvd_trainer.spark.run": lambda: hvd_trainer.spark.run(first_line, num_proc=3)}
    seconds = measure(calls, args.rounds)
    executor.shutdown()
    ray.shutdown()
    spark.stop()
    report("Engine launch overhead across hosts: call to every rank's first line",
           f"3 ranks, one per host of the multi-host test bed, {args.rounds} rounds "
           "interleaved", seconds, once)


def bed(args):
    """Build the test bed and its clusters, run :func:`on_bed` on h1, take them down."""
    tests = os.path.join(os.path.dirname(HERE), "tests")
    sys.path[:0] = [os.path.join(tests, "multihost"), tests]  # the fixtures' shared modules
    import testbed
    import test_multihost_engines as clusters
    import test_multihost_spark as spark_clusters
    built = testbed.up(3, tied=True)
    started = []
    try:
        ray_fixture = clusters.ray_bed.__wrapped__(built)
        started.append(ray_fixture)
        ray_address = next(ray_fixture)
        spark_fixture = spark_clusters.spark_bed.__wrapped__(built)
        started.append(spark_fixture)
        spark_master = next(spark_fixture)
        shared_tmp = os.path.join(built.shared, "tmp")  # hvd_trainer.run's folder, on every host
        os.makedirs(shared_tmp, mode=0o700, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=shared_tmp,
                   PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=clusters.HEAD,
                   OMPI_MCA_btl="^ofi,uct", **clusters._TOKEN)
        done = built.run("h1", [sys.executable, os.path.abspath(__file__), "--on-bed",
                                "--ray-address", ray_address, "--spark-master", spark_master,
                                "--driver-host", clusters.HEAD,
                                "--jvm-options", spark_clusters.JVM_OPTIONS,
                                "--rounds", str(args.rounds)],
                         cwd=built.shared, env=env, capture_output=True, text=True, timeout=1800)
        print(done.stdout)
        if done.returncode:
            sys.exit(f"the driver on h1 exited with code {done.returncode}:\n"
                     f"{done.stderr[-4000:]}")
    finally:
        for fixture in reversed(started):
            fixture.close()  # stops its daemons by PID
        built.down()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bed", action="store_true",
                        help="across the multi-host test bed's three hosts (root)")
    parser.add_argument("--on-bed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)
    parser.add_argument("--spark-master", help=argparse.SUPPRESS)
    parser.add_argument("--driver-host", help=argparse.SUPPRESS)
    parser.add_argument("--jvm-options", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bed:
        bed(args)
    elif args.on_bed:
        on_bed(args)
    else:
        one_machine(args)


if __name__ == "__main__":
    main()
