"""The multi-host test bed (testbed.py), up once per pytest session."""
import shutil

import pytest

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
