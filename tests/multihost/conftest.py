"""The multi-host test bed (testbed.py), up once per pytest session."""
import shutil

import pytest

import testbed

HOSTS = 3


@pytest.fixture(scope="session")
def bed():
    """Three hosts h1..h3 with sshd; skipped, with the reason, where namespaces cannot be made."""
    reason = testbed.unavailable()
    if reason:
        pytest.skip(reason)
    built = testbed.up(HOSTS, tied=True)
    try:
        yield built
    finally:
        built.down()
        shutil.rmtree(built.folder, ignore_errors=True)
