"""Real single-machine Ray and Spark clusters, one per test session, for the engine tests.

Each is skipped with the reason and the install command where its engine (or Java, for Spark)
is missing. Every daemon a fixture starts is stopped by its own handle or PID, never by name.
"""
import importlib.util
import os
import shutil
import tempfile
import uuid

import pytest

import engines

INSTALL = "pip install -e '.[test]' (which brings ray and pyspark)"
os.environ.setdefault(engines.SESSION_VARIABLE, uuid.uuid4().hex)


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray head with engines.RAY_CPUS CPUs (engines.ray_head) this process joins; its
    processes are stopped by PID at the end, never by ``ray stop``."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip(f"ray is not installed here; {INSTALL}")
    import ray
    marker = f"HVD_TEST_RAY_HEAD_{os.getpid()}"
    temp = tempfile.mkdtemp(prefix="hvdray-")  # short: Ray's sockets live under it
    try:
        address = engines.ray_head(temp, marker)
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        yield ray
    finally:
        ray.shutdown()
        engines.stop_processes_with(marker)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def spark():
    """A SparkSession on local-cluster[HOSTS, SLOTS, MB]: real executor processes
    (engines.spark_session)."""
    if importlib.util.find_spec("pyspark") is None:
        pytest.skip(f"pyspark is not installed here; {INSTALL}")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java 17 or later and none is on PATH (apt-get install "
                    "openjdk-17-jre-headless, or set JAVA_HOME)")
    folder = tempfile.mkdtemp(prefix="hvdspark-")  # its GPU discovery script
    try:
        session = engines.spark_session(folder)
        try:
            yield session
        finally:
            session.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
