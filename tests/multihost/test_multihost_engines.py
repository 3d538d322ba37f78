"""hvd_trainer.ray across the test bed: a Ray head on h1 and a Ray node on h2 and h3, each
started with ``ray start --block`` inside its host and ended by PID (every process whose
environment carries the fixture's marker), never by ``ray stop``, with Ray's token
authentication on (a driver without the token is refused). The driver runs on h1; ranks on
other hosts are started by the agents there, with no ssh. Checked: the layout by host
(local and cross ranks), data across the link against NumPy, a rank on h3 that raises, a
killed agent (Ray's actor, named with Ray's words; Spark's executor) on h3 and Ctrl-C on the
driver, with nothing left on any host. hvd_trainer.spark runs on a Spark standalone master
with a worker per host, set up the same way."""
import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import multihost

HEAD = "10.213.0.1"
PORT = 6379
CPUS = {"h1": 2, "h2": 1, "h3": 1}
# Ray 2.60 authenticates to its GCS with a token: one for the bed's cluster, in every process's
# environment (the hosts' home folders differ, so ~/.ray/auth_token would not be shared).
_TOKEN = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
PAYLOAD = 8 << 20  # bytes in the allreduce: at least that much must cross h2's link

_DRIVER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import ray
    from hvd_trainer.ray import RayExecutor

    def place(size):
        import os, socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        data = np.full(size // 8, float(hvd.rank() + 1))
        total = hvd.allreduce(data, op=hvd.Sum)
        return {"host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
                "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                "env_host": os.environ["HOROVOD_HOSTNAME"], "sum": [float(total.min()),
                float(total.max())]}

    def raise_on_h3():
        import socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        if socket.gethostname() == "h3":
            raise RuntimeError("the rank on h3 fails")
        hvd.allreduce(np.ones(4))

    def sleep_long(folder):
        import os, time
        import hvd_trainer as hvd
        hvd.init()
        open(os.path.join(folder, f"asleep.{hvd.rank()}"), "w").close()
        time.sleep(120)

    def when_asleep(folder, action):  # on a thread, once every rank of sleep_long sleeps
        import glob, os, threading
        for name in glob.glob(os.path.join(folder, "asleep.*")):
            os.remove(name)
        def watch():
            while len(glob.glob(os.path.join(folder, "asleep.*"))) < 3:
                time.sleep(0.2)
            action()
        threading.Thread(target=watch, daemon=True).start()

    ray.init(address=sys.argv[1], log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    settings = RayExecutor.create_settings(timeout_s=60)
    packed = RayExecutor(settings, num_workers=3)
    packed.start()
    print("PACKED", json.dumps(packed.run(place, args=[int(sys.argv[2])])), flush=True)
    packed.shutdown()
    spread = RayExecutor(settings, num_hosts=3, num_workers_per_host=1)
    spread.start()
    try:
        spread.run(raise_on_h3)
    except Exception as error:
        print("RAISED", json.dumps(str(error)), flush=True)
    # A killed agent: h3's actor, while the ranks sleep.
    h3 = [host for host, _ in spread._layout].index("h3")
    when_asleep(sys.argv[3], lambda: ray.kill(spread._agents[h3]))
    try:
        spread.run(sleep_long, args=[sys.argv[3]])
    except Exception as error:
        print("KILLED", json.dumps(str(error)), flush=True)
    spread.shutdown()
    # Ctrl-C on the driver while the ranks sleep: the job ends, the driver with it.
    spread.start()
    import os, signal
    when_asleep(sys.argv[3], lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        spread.run(sleep_long, args=[sys.argv[3]])
    except KeyboardInterrupt:
        print("INTERRUPTED", json.dumps(None), flush=True)
""")


def _stop_daemons(marker: str) -> None:
    """SIGKILL, by PID, every process whose environment carries ``marker`` (the daemons a
    fixture started, and whatever they started: workers, executors, ranks)."""
    wanted = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if wanted not in environ.read().split(b"\0"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def ray_bed(bed):
    """Ray daemons on h1 (head), h2 and h3; stopped by PID at the end."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed here; pip install -e '.[test]'")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    marker = f"HVD_TEST_RAY_BED={secrets.token_hex(8)}"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **_TOKEN,
               HVD_TEST_RAY_BED=marker.split("=", 1)[1])
    daemons = []
    try:
        for host in bed.hosts:
            # Nothing the tests do not use: no dashboard, autoscaler monitor or log monitor
            # (the driver does not print the workers' output).
            role = (["--head", f"--port={PORT}", "--include-dashboard=false", "--no-monitor"]
                    if host == "h1" else [f"--address={HEAD}:{PORT}"])
            log = open(os.path.join(bed.shared, f"ray-{host}.log"), "wb")
            daemons.append(bed.popen(host, [ray_cli, "start", "--block", *role,
                                            f"--node-ip-address={bed.address(host)}",
                                            f"--num-cpus={CPUS[host]}", "--disable-usage-stats",
                                            "--include-log-monitor=false"],
                                     cwd=bed.shared, env=env, stdout=log, stderr=log,
                                     start_new_session=True))
            if host == "h1":  # the head's GCS first: the nodes join it at once
                _wait_for_text(os.path.join(bed.shared, "ray-h1.log"), "Ray runtime started", 90)
        yield f"{HEAD}:{PORT}"
    finally:
        _stop_daemons(marker)
        for daemon in daemons:
            daemon.wait(30)


@pytest.fixture(scope="module")
def driver(bed, ray_bed):
    """One driver run on h1: its PACKED results, RAISED, KILLED and INTERRUPTED messages, the
    bytes each other host's link carried meanwhile, the job processes left on each host after
    it, and what a driver without the cluster's token, run meanwhile, got."""
    before = {host: bed.link_bytes(host) for host in ("h2", "h3")}
    tokenless = bed.popen("h1", [sys.executable, "-c", f"import ray; ray.init(address={ray_bed!r})"],
                          cwd=bed.shared, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={k: v for k, v in os.environ.items()
                                          if not k.startswith("RAY_AUTH")})
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **_TOKEN)
    done = bed.run("h1", [sys.executable, "-c", _DRIVER, ray_bed, str(PAYLOAD), bed.shared],
                   cwd=bed.shared, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in done.stdout.splitlines()
             if line.startswith(("PACKED ", "RAISED ", "KILLED ", "INTERRUPTED "))}
    moved = {host: bed.link_bytes(host) - count for host, count in before.items()}
    refused = tokenless.communicate(timeout=120)[1], tokenless.returncode
    return lines, moved, multihost.wait_until_no_job_is_left(bed), refused


def test_packed_layout_by_host(driver):
    results = driver[0]["PACKED"]
    hosts = [r["host"] for r in results]
    # Ranks on one host are consecutive; local and cross ranks follow the hosts.
    order = list(dict.fromkeys(hosts))
    assert hosts == sorted(hosts, key=order.index) and len(order) == 2
    for r in results:
        same = [x for x in results if x["host"] == r["host"]]
        assert r["local_size"] == len(same)
        assert r["local_rank"] == [x["rank"] for x in same].index(r["rank"])
        assert r["env_host"] == r["host"] and r["size"] == 3
    # The Sum of 1, 2, 3 in every element (NumPy's answer for the rows the ranks made).
    assert all(r["sum"] == [6.0, 6.0] for r in results)


def test_data_crosses_the_link(driver):
    results, moved = driver[0]["PACKED"], driver[1]
    other = next(r["host"] for r in results if r["host"] != "h1")  # Ray packs h1 and one more
    assert moved[other] >= PAYLOAD


def test_killed_agent_on_h3_is_named_and_leaves_nothing(driver):
    assert "the agent on h3 was lost" in driver[0]["KILLED"]
    assert re.search(r"\nh3: ActorDiedError: .*ray\.kill", driver[0]["KILLED"])  # Ray's words
    assert driver[2] == {}  # no rank, wrapper or proxy on any host (their own ps)


def test_the_cluster_runs_with_token_authentication_on(driver):
    # The driver above held the token; one without it was refused (Ray 2.60's default).
    stderr, code = driver[3]
    assert code != 0 and "AuthenticationError" in stderr, stderr[-2000:]


def test_ctrl_c_on_the_driver_ends_the_job(driver):
    assert "INTERRUPTED" in driver[0]


def test_rank_on_h3_raises_named(driver):
    # STRICT_SPREAD's bundles reach the nodes in Ray's order: h3's rank is any of them.
    assert re.search(r"raised on rank \d on host h3", driver[0]["RAISED"])
    assert "the rank on h3 fails" in driver[0]["RAISED"]


# -- Spark: a standalone master on h1, a worker with one core on each host ------------------

SPARK_MASTER = f"spark://{HEAD}:7077"
# Every JVM of the bed (master, workers, driver, executors), as tests/engines' JVM_OPTIONS: the
# client compiler only and the serial collector start a JVM several times faster on two cores.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"

_SPARK_DRIVER = textwrap.dedent("""
    import glob, json, os, signal, sys, threading, time
    from pyspark.sql import SparkSession
    import hvd_trainer.spark

    def place(size):
        import os, socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        total = hvd.allreduce(np.full(size // 8, float(hvd.rank() + 1)), op=hvd.Sum)
        return {"host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
                "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                "sum": [float(total.min()), float(total.max())]}

    def raise_on_h3():
        import socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        if socket.gethostname() == "h3":
            raise RuntimeError("the rank on h3 fails")
        hvd.allreduce(np.ones(4))

    def sleep_long(folder, kill_executor_on_h3):
        # Each rank says it sleeps; with kill_executor_on_h3, h3's rank then SIGKILLs its
        # host's executor JVM (only h3's own processes are in sight there).
        import glob, os, signal, socket, time
        import hvd_trainer as hvd
        hvd.init()
        open(os.path.join(folder, f"asleep.{hvd.rank()}"), "w").close()
        if kill_executor_on_h3 and socket.gethostname() == "h3":
            while len(glob.glob(os.path.join(folder, "asleep.*"))) < hvd.size():
                time.sleep(0.2)
            for entry in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                        if b"CoarseGrainedExecutorBackend" in cmdline.read():
                            os.kill(int(entry), signal.SIGKILL)
                except OSError:  # a process that ended meanwhile
                    pass
        time.sleep(120)

    def forget_sleepers(folder):
        for name in glob.glob(os.path.join(folder, "asleep.*")):
            os.remove(name)

    session = (SparkSession.builder.master(sys.argv[1]).appName("hvd_trainer bed")
               .config("spark.driver.host", sys.argv[3])
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "2")
               .config("spark.executor.memory", "512m")
               .config("spark.driver.extraJavaOptions", sys.argv[4])
               .config("spark.executor.extraJavaOptions", sys.argv[4])
               .getOrCreate())
    def wait_for_three_executors():
        deadline = time.monotonic() + 120
        while session.sparkContext.defaultParallelism < 3:
            assert time.monotonic() < deadline, session.sparkContext.defaultParallelism
            time.sleep(0.1)

    wait_for_three_executors()
    print("SPARK", json.dumps(hvd_trainer.spark.run(place, args=[int(sys.argv[2])],
                                                    num_proc=3)), flush=True)
    try:
        hvd_trainer.spark.run(raise_on_h3, num_proc=3)
    except Exception as error:
        print("RAISED", json.dumps(str(error)), flush=True)
    # A killed executor: h3's, while the ranks sleep.
    forget_sleepers(sys.argv[5])
    started = time.monotonic()
    try:
        hvd_trainer.spark.run(sleep_long, args=[sys.argv[5], True], num_proc=3)
    except Exception as error:
        print("KILLED", json.dumps([str(error), time.monotonic() - started]), flush=True)
    # Ctrl-C on the driver while the ranks sleep, once h3's worker has a new executor.
    wait_for_three_executors()
    forget_sleepers(sys.argv[5])
    def interrupt():
        while len(glob.glob(os.path.join(sys.argv[5], "asleep.*"))) < 3:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    try:
        hvd_trainer.spark.run(sleep_long, args=[sys.argv[5], False], num_proc=3)
    except KeyboardInterrupt:
        print("INTERRUPTED", json.dumps(time.monotonic() - started), flush=True)
    session.stop()
""")


@pytest.fixture(scope="module")
def spark_bed(bed):
    """A Spark standalone master on h1 and a one-core worker per host; stopped by PID."""
    if importlib.util.find_spec("pyspark") is None:
        pytest.skip("pyspark is not installed here; pip install -e '.[test]'")
    import shutil
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java 17 or later (apt-get install openjdk-17-jre-headless)")
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
            argv = ([spark_class, "org.apache.spark.deploy.master.Master", "--host", HEAD,
                     "--port", "7077"] if master else
                    [spark_class, "org.apache.spark.deploy.worker.Worker", SPARK_MASTER,
                     "--host", address, "--cores", "1", "--memory", "1g",
                     "--work-dir", "/tmp/spark-work"])
            log_path = os.path.join(bed.shared, f"spark-{'master' if master else host}.log")
            with open(log_path, "wb") as log:
                daemons.append(bed.popen(host, argv, cwd=bed.shared, env=env, stdout=log,
                                         stderr=log, start_new_session=True))
            if master:
                _wait_for_text(log_path, "I have been elected leader", 90)
        yield SPARK_MASTER
    finally:
        _stop_daemons(f"HVD_TEST_SPARK_BED={marker}")
        for daemon in daemons:
            daemon.wait(30)


def _wait_for_text(path: str, text: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with open(path, errors="replace") as log:
            if text in log.read():
                return
        assert time.monotonic() < deadline, f"{path} did not say {text!r}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def spark_driver(bed, spark_bed):
    before = bed.link_bytes("h2")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=HEAD)
    done = bed.run("h1", [sys.executable, "-c", _SPARK_DRIVER, spark_bed, str(PAYLOAD), HEAD,
                          JVM_OPTIONS, bed.shared],
                   cwd=bed.shared, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in done.stdout.splitlines()
             if line.startswith(("SPARK ", "RAISED ", "KILLED ", "INTERRUPTED "))}
    return lines, bed.link_bytes("h2") - before, multihost.wait_until_no_job_is_left(bed)


def test_spark_ranks_one_per_executor_host(spark_driver):
    results, moved = spark_driver[0]["SPARK"], spark_driver[1]
    assert sorted(r["host"] for r in results) == ["h1", "h2", "h3"]
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"]) == (3, 0, 1, 3)
        assert r["cross_rank"] == r["rank"]
        assert r["sum"] == [6.0, 6.0]
    assert moved >= PAYLOAD


def test_spark_rank_on_h3_raises_named(spark_driver):
    text = spark_driver[0]["RAISED"]
    assert "on host h3" in text and "the rank on h3 fails" in text


def test_spark_killed_executor_on_h3_ends_the_job_and_leaves_nothing(spark_driver):
    message, seconds = spark_driver[0]["KILLED"]
    assert "the Spark job failed" in message
    # The host, from the task's registration, and what Spark said (its exit code's meaning).
    assert re.search(r"the executor of task \d on h3 was lost .*Spark says", message), message
    assert seconds < 100  # the ranks sleep 120 s: the job ended because its executor died
    assert spark_driver[2] == {}  # no rank, wrapper or proxy on any host (their own ps)


def test_spark_ctrl_c_on_the_driver_ends_the_job(spark_driver):
    assert spark_driver[0]["INTERRUPTED"] < 100
