"""Helpers of the engine tests: the clusters' sizes, and the processes a job left behind."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

RAY_CPUS = 3
# Names the head also answers to (Ray's node:<name> resources, as Horovod's tests give theirs),
# so that an elastic job's discovery can report three hosts on one machine.
RAY_FAKE_HOSTS = ("host-a", "host-b", "host-c")
# Every Spark JVM (driver, executors, a bed's master and workers) starts with the client
# compiler only and the serial collector: on two cores, a JVM's start and Spark's class loading
# are several times faster, and the tests' jobs are too short for C2 to pay back.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"
# How many times ray_head starts a head that exits before it is up, each on a new port.
HEAD_TRIES = 3


def ray_head(temp: str, marker: str, cpus: int = RAY_CPUS, gpus: int = 0,
             env: Optional[Dict[str, str]] = None) -> str:
    """Start ``ray start --head --block`` with ``cpus`` CPUs and ``gpus`` GPUs (declared: Ray
    places by them, nothing here uses a device) and nothing the tests do not use (no
    dashboard, autoscaler monitor or log monitor: drivers do not print workers' output), its
    files (and the address file ray.init() would find) in ``temp``; every process of it
    carries ``marker`` in its environment, and ``env``. Return its address once up.

    Ray needs the head's port number before it binds it, so the port is probed free and
    then handed over, and another job may take it in between: a head that exits before it
    is up is ended (every process with ``marker``) and started again on a new port, at most
    :data:`HEAD_TRIES` times."""
    for attempt in range(1, HEAD_TRIES + 1):
        address = _start_head(temp, marker, cpus, gpus, env, attempt)
        if address is not None:
            return address
        stop_processes_with(marker)
    with open(os.path.join(temp, f"head.{HEAD_TRIES}.log"), errors="replace") as log:
        last = log.read()[-3000:]  # the fixtures remove ``temp`` as they end
    raise RuntimeError(f"ray start --head exited before it was up, {HEAD_TRIES} times, each "
                       f"on a new port; the last one said:\n{last}")


def _start_head(temp: str, marker: str, cpus: int, gpus: int, env: Optional[Dict[str, str]],
                attempt: int) -> Optional[str]:
    """One try of :func:`ray_head`: the head's address once up, None if it exited first."""
    log_path = os.path.join(temp, f"head.{attempt}.log")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open(log_path, "wb") as log:
        head = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}",
             f"--num-gpus={gpus}", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}",
             "--resources=" + json.dumps({f"node:{host}": 1 for host in RAY_FAKE_HOSTS}),
             "--include-dashboard=false",
             "--no-monitor", "--include-log-monitor=false", "--disable-usage-stats"],
            # Token authentication off, as for the instance ray.init() starts: the tests'
            # drivers (this process included) have no token.
            env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                     **(env or {}), **{marker: "1"}), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        with open(log_path, errors="replace") as log:
            if "Ray runtime started" in log.read():
                return f"127.0.0.1:{port}"
        if head.poll() is not None:
            return None
        if time.monotonic() > deadline:
            raise RuntimeError(f"ray start --head was not up after 120 s; its output is in "
                               f"{log_path}")
        time.sleep(0.1)


def stop_processes_with(variable: str) -> None:
    """SIGKILL, by PID, every process whose environment sets ``variable`` (a daemon a fixture
    started and everything it started)."""
    for pid in processes_with(variable):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# The GPU addresses that the Spark session's discovery script declares: one per slot.
SPARK_GPUS = ["0", "1", "2"]
# The session's limit on a job's results, low so that a test can pass it cheaply.
SPARK_MAX_RESULT_SIZE = "16m"


def gpu_discovery_script(folder: str) -> str:
    """Write, in ``folder``, a Spark resource discovery script that declares SPARK_GPUS
    (fake addresses: nothing uses a device), and return its path."""
    path = os.path.join(folder, "gpus.sh")
    found = json.dumps({"name": "gpu", "addresses": SPARK_GPUS})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
    with os.fdopen(fd, "w") as script:
        script.write(f"#!/bin/sh\necho '{found}'\n")
    return path


def spark_session(folder: str):
    """A SparkSession on one executor with three slots and a fake GPU per slot (declared by a
    discovery script written in ``folder``), each task getting one: a barrier job short of
    slots fails in seconds (the check's interval and failures lowered), not ten minutes. The
    Python workers talk to their executor over Unix sockets, as docs/security.md recommends."""
    from pyspark.sql import SparkSession
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this one
    gpus = str(len(SPARK_GPUS))
    session = (SparkSession.builder.master("local-cluster[1,3,1024]")
            .config("spark.worker.resource.gpu.discoveryScript", gpu_discovery_script(folder))
            .config("spark.worker.resource.gpu.amount", gpus)
            .config("spark.executor.resource.gpu.amount", gpus)
            .config("spark.task.resource.gpu.amount", "1")
            .config("spark.python.unix.domain.socket.enabled", "true")
            .config("spark.driver.maxResultSize", SPARK_MAX_RESULT_SIZE)
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


# Set in the test session's environment (conftest), which its Spark executors, hvdrun and every
# rank inherit: a check for processes left behind counts this session's, not those of another
# session on the same machine.
SESSION_VARIABLE = "HVD_TEST_SESSION"


def job_processes() -> List[int]:
    """The PIDs of this test session's engine job processes (proxies, wrappers, ranks: those
    with HVD_ENGINE_FOLDER in their environment and this session's SESSION_VARIABLE)."""
    mine = set(processes_with(SESSION_VARIABLE, os.environ[SESSION_VARIABLE]))
    return [pid for pid in processes_with("HVD_ENGINE_FOLDER") if pid in mine]


def agent_folders() -> List[str]:
    """The agent folders of this session's running engine jobs (their ranks' environment names
    them: protocol.ENGINE_FOLDER_VARIABLE)."""
    wanted = b"HVD_ENGINE_FOLDER="
    found = set()
    for pid in job_processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                items = environ.read().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        found.update(item[len(wanted):].decode() for item in items if item.startswith(wanted))
    return sorted(found)


def processes_with(variable: str, value: Optional[str] = None) -> List[int]:
    """The PIDs of this session's processes whose environment sets ``variable`` (to ``value``,
    when given; an engine job's proxies, wrappers and ranks all have
    protocol.ENGINE_FOLDER_VARIABLE): those of this user in this process's mount namespace,
    which under root is the session's own (tests/session_shm.py)."""
    wanted = f"{variable}=".encode()
    whole = None if value is None else wanted + value.encode()
    found = []
    ours = os.stat("/proc/self/ns/mnt").st_ino
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/mnt").st_ino != ours:
                continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                items = environ.read().split(b"\0")
        except OSError:
            continue
        if any(item == whole if whole is not None else item.startswith(wanted)
               for item in items):
            found.append(int(entry))
    return found
