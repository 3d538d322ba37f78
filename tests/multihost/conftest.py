"""The multi-host test bed (testbed.py), up once per pytest session, and its Spark cluster."""
import importlib.util
import shutil

import pytest

import spark_bed
import testbed

HOSTS = 3


@pytest.fixture(scope="session")
def bed_possible():
    """Skip, naming what is missing and how to get it, where no test bed can be built (no
    root, no sshd, no network namespaces); every test that builds a bed asks this first."""
    reason = testbed.unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def bed(bed_possible):
    """Three hosts h1..h3 with sshd."""
    built = testbed.up(HOSTS, tied=True)
    try:
        yield built
    finally:
        built.down()
        shutil.rmtree(built.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def spark_master(bed):
    """The bed's Spark cluster (spark_bed.py) for a module's tests; its master's URL."""
    if importlib.util.find_spec("pyspark") is None:
        pytest.skip("pyspark is not installed here; pip install -e '.[test]'")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java 17 or later (apt-get install openjdk-17-jre-headless)")
    with spark_bed.cluster(bed) as master:
        yield master
