"""Helpers of the engine tests: the clusters' sizes, and the processes a job left behind."""
import os
import sys
import time
from typing import List

RAY_CPUS = 3
# Every Spark JVM (driver, executors, a bed's master and workers) starts with the client
# compiler only and the serial collector: on two cores, a JVM's start and Spark's class loading
# are several times faster, and the tests' jobs are too short for C2 to pay back.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"


def spark_session():
    """A SparkSession on one executor with three slots: a barrier job short of slots fails
    in seconds (the check's interval and failures lowered), not ten minutes."""
    from pyspark.sql import SparkSession
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this one
    session = (SparkSession.builder.master("local-cluster[1,3,1024]")
            .appName("hvd_trainer engine tests")
            .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
            .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.task.maxFailures", "1")
            .config("spark.pyspark.python", sys.executable)
            .config("spark.executorEnv.PATH", os.environ.get("PATH", ""))
            .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
            .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
            .getOrCreate())
    deadline = time.monotonic() + 60  # the executor registers after the session is up
    while session.sparkContext.defaultParallelism < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    return session


def processes_with(variable: str) -> List[int]:
    """The PIDs of this user's processes whose environment sets ``variable`` (an engine job's
    proxies, wrappers and ranks all have protocol.ENGINE_FOLDER_VARIABLE)."""
    wanted = f"{variable}=".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if any(item.startswith(wanted) for item in environ.read().split(b"\0")):
                    found.append(int(entry))
        except OSError:
            pass
    return found
