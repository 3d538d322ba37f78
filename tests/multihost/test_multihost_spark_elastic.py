"""hvd_trainer.spark.run_elastic across the test bed: a Spark standalone master on h1 and a
one-core worker per host (one executor, one slot each), the driver on h1. A torch training
on the three executors; once it has committed, h3's worker and executor are SIGKILLed: the
job goes on from that commit on h1 and h2, and when h3's worker is started again its new
executor's task grows the job back to three. The final weights equal the one-process replay
of the commits, and no rank, wrapper or proxy is left on any host."""
import importlib.util
import json
import os
import secrets
import shutil
import signal
import sys
import textwrap
import time

import pytest

import elastic_training
import multihost
from spark_bed import JVM_OPTIONS, MASTER as SPARK_MASTER

HEAD = multihost.HEAD

DRIVER = textwrap.dedent("""
    import json, sys, time
    from pyspark.sql import SparkSession
    import hvd_trainer.spark
    import elastic_training

    session = (SparkSession.builder.master(sys.argv[1]).appName("hvd_trainer bed elastic")
               .config("spark.driver.host", sys.argv[2])
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executor.memory", "512m")
               .config("spark.driver.extraJavaOptions", sys.argv[3])
               .config("spark.executor.extraJavaOptions", sys.argv[3])
               .getOrCreate())
    results = hvd_trainer.spark.run_elastic(elastic_training.train, args=(sys.argv[4], 3),
                                            num_proc=3, min_num_proc=2, start_timeout=300,
                                            elastic_timeout=300, ulfm=sys.argv[5] == "1")
    print("RESULT", json.dumps(results[0]), flush=True)
    session.stop()
""")


def start_spark(bed, host, marker, log_name):
    """Start the Spark master (on h1, ``host`` None) or a worker on ``host``."""
    import pyspark
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    where = host or "h1"
    env = dict(os.environ, SPARK_LOCAL_IP=bed.address(where), PYSPARK_PYTHON=sys.executable,
               HVD_TEST_SPARK_BED=marker, SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
               SPARK_DAEMON_MEMORY="256m")
    argv = ([spark_class, "org.apache.spark.deploy.master.Master", "--host", HEAD, "--port",
             "7077"] if host is None else
            [spark_class, "org.apache.spark.deploy.worker.Worker", SPARK_MASTER, "--host",
             bed.address(host), "--cores", "1", "--memory", "1g", "--work-dir",
             "/tmp/spark-work"])
    log_path = os.path.join(bed.shared, log_name)
    with open(log_path, "ab") as log:
        bed.popen(where, argv, cwd=bed.shared, env=env, stdout=log, stderr=log,
                  start_new_session=True)
    return log_path


def kill_spark_on(bed, host, marker, program=None):
    """SIGKILL, by PID, the Spark worker and executor of ``host`` (their environment names
    the bed's marker and the host's address) and what they started, or with ``program``
    (e.g. b"java") only the processes that run it."""
    wanted = {f"HVD_TEST_SPARK_BED={marker}".encode(),
              f"SPARK_LOCAL_IP={bed.address(host)}".encode()}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                mine = wanted <= set(environ.read().split(b"\0"))
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                runs = os.path.basename(cmdline.read().split(b"\0")[0])
            if mine and program in (None, runs):
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass


def wait_until(what, seconds, why):
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def start_job(bed, marker, name, signal_path, out_path, ulfm):
    """The Spark master and a worker per host (their logs ``spark-NAME-*.log``), then
    :data:`DRIVER` on h1 (``ulfm``: run_elastic's), its output in ``out_path``; the driver."""
    multihost.wait_for_text(start_spark(bed, None, marker, f"spark-{name}-master.log"),
                            "I have been elected leader", 90)
    for host in bed.hosts:
        start_spark(bed, host, marker, f"spark-{name}-{host}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=HEAD, PYTHONPATH=multihost.TESTS)
    with open(out_path, "w") as out:
        return bed.popen("h1", [sys.executable, "-c", DRIVER, SPARK_MASTER, HEAD, JVM_OPTIONS,
                                signal_path, "1" if ulfm else "0"],
                         cwd=bed.shared, env=env, stdout=out, stderr=out)


def test_spark_run_elastic_survives_a_killed_executor_and_grows_back(bed):
    if importlib.util.find_spec("pyspark") is None or shutil.which("java") is None:
        pytest.skip("Spark needs pyspark and Java 17 or later here")
    marker = secrets.token_hex(8)
    signal_path = os.path.join(bed.shared, "elastic-signal")
    out_path = os.path.join(bed.shared, "elastic-driver.out")
    for path in (signal_path, signal_path + ".taken"):
        if os.path.exists(path):
            os.remove(path)
    driver = None
    try:
        driver = start_job(bed, marker, "elastic", signal_path, out_path, ulfm=False)
        said = lambda: open(out_path, errors="replace").read()  # noqa: E731
        wait_until(lambda: os.path.exists(signal_path) or driver.poll() is not None, 300,
              "the first life did not reach its signal")
        assert driver.poll() is None, said()[-3000:]
        open(signal_path + ".taken", "w").close()
        kill_spark_on(bed, "h3", marker)
        wait_until(lambda: "LIFE size=2" in said() or driver.poll() is not None, 180,
              "the job did not shrink")
        start_spark(bed, "h3", marker, "spark-elastic-h3-again.log")
        driver.wait(300)
        text = said()
        assert driver.returncode == 0, text[-4000:]
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        multihost.stop_processes_with(f"HVD_TEST_SPARK_BED={marker}")
    result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    elastic_training.check_result(result, text, 3)
    assert multihost.wait_until_no_job_is_left(bed) == {}
