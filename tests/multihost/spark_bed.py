"""The multi-host test bed's Spark cluster, shared by the Spark tests (test_multihost_spark.py
in the main environment, test_multihost_spark_keras.py in TensorFlow's): a standalone master on
h1 and a one-core worker per host, and what their drivers on h1 share, the session and the way
Horovod's examples run there. Drivers import this module (tests/multihost on their path)."""
import contextlib
import json
import os
import runpy
import secrets
import sys
import time
from typing import Iterator, List

import multihost

MASTER = f"spark://{multihost.HEAD}:7077"
# Every JVM of the bed (master, workers, driver, executors), as tests/engines' JVM_OPTIONS: the
# client compiler only and the serial collector start a JVM several times faster on two cores.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"


@contextlib.contextmanager
def cluster(bed) -> Iterator[str]:
    """Start the master and the workers, inside their hosts; the master's URL while it runs.
    Every process they start carries a marker in its environment and is ended by PID."""
    import pyspark
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    marker = secrets.token_hex(8)
    daemons = []
    try:
        for host in ["h1", *bed.hosts]:
            address = bed.address(host)
            env = dict(os.environ, SPARK_LOCAL_IP=address, PYSPARK_PYTHON=sys.executable,
                       HVD_TEST_SPARK_BED=marker, SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
                       SPARK_DAEMON_MEMORY="256m")
            master = not daemons
            argv = ([spark_class, "org.apache.spark.deploy.master.Master", "--host",
                     multihost.HEAD, "--port", "7077"] if master else
                    [spark_class, "org.apache.spark.deploy.worker.Worker", MASTER,
                     "--host", address, "--cores", "1", "--memory", "1g",
                     "--work-dir", "/tmp/spark-work"])
            log_path = os.path.join(bed.shared, f"spark-{'master' if master else host}.log")
            with open(log_path, "wb") as log:
                daemons.append(bed.popen(host, argv, cwd=bed.shared, env=env, stdout=log,
                                         stderr=log, start_new_session=True))
            if master:
                multihost.wait_for_text(log_path, "I have been elected leader", 90)
        yield MASTER
    finally:
        multihost.stop_processes_with(f"HVD_TEST_SPARK_BED={marker}")
        for daemon in daemons:
            daemon.wait(30)


def driver_command(script: str, *args: str) -> List[str]:
    """A driver on h1: this interpreter running ``script`` with ``args``."""
    return [sys.executable, "-c", script, MASTER, *args]


def driver_environment() -> dict:
    """A driver's environment: tests/ and tests/multihost importable, one OpenMP thread."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=multihost.HEAD,
                PYTHONPATH=os.pathsep.join([multihost.TESTS, os.path.dirname(__file__)]))


def session(master: str):
    """In a driver on h1: the session on the bed's cluster, once its three executors are up."""
    from pyspark.sql import SparkSession
    built = (SparkSession.builder.master(master).appName("hvd_trainer bed")
             .config("spark.driver.host", multihost.HEAD)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
             .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "2")
             .config("spark.executor.memory", "512m")
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
             .getOrCreate())
    wait_for_executors(built)
    return built


def wait_for_executors(built, count: int = 3) -> None:
    """Wait until the session has ``count`` executors (one core each)."""
    deadline = time.monotonic() + 120
    while built.sparkContext.defaultParallelism < count:
        assert time.monotonic() < deadline, built.sparkContext.defaultParallelism
        time.sleep(0.1)


def run_example(folder: str, script: str, arguments: str) -> None:
    """In a driver on h1: Horovod's example ``script``, unmodified, run as its ``__main__``
    with ``arguments`` (a JSON list) and hvd_trainer's horovod shim importable; it stops the
    session."""
    from hvd_trainer_launch.rank import horovod_shim
    shim = os.path.join(folder, "shim")
    horovod_shim.write(shim)
    sys.path.append(shim)
    sys.argv = [script, *json.loads(arguments)]
    runpy.run_path(script, run_name="__main__")
