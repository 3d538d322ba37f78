"""Tests with a twin on the multi-host test bed: the same user program checked the same way,
once on a single-machine cluster and once across the bed's hosts. Where the bed can be built
and the twin is in the session, the bed's run stands for both and the single-machine one is
skipped, naming its twin; elsewhere (no root, no namespaces, the twin not selected) the
single-machine one runs. CI's two cores spend a minute on each such pair."""
import functools
from typing import Optional

import pytest


@functools.lru_cache(maxsize=None)
def _bed_unavailable() -> Optional[str]:
    """tests/multihost/testbed.py's reason why no bed can be built here, or None. (A twin in
    the session means tests/multihost/conftest.py was loaded, which put testbed on the path.)"""
    import testbed
    return testbed.unavailable()


def skip_if_the_bed_runs(request: pytest.FixtureRequest, twin: str) -> None:
    """Skip the calling test when ``twin`` (a node id under tests/multihost) is in this
    session and the bed can be built."""
    if twin not in {item.nodeid for item in request.session.items}:
        return
    if _bed_unavailable() is None:
        pytest.skip(f"{twin} runs this across the test bed's hosts in this session")
