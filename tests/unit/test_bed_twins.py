"""tests/bed_twins.py: a single-machine test skipped for its twin on the multi-host test bed
only where that twin runs, and every twin named exists."""
import ast
import os
import types

import pytest

import bed_twins

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _named_twins():
    """Each (module, twin) where a test module calls skip_if_the_bed_runs with a literal
    twin (this module's own calls name made-up twins)."""
    for folder, _, files in os.walk(TESTS):
        for name in sorted(files):
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == \
                        "skip_if_the_bed_runs" and isinstance(node.args[1], ast.Constant):
                    yield path, node.args[1].value


def test_every_twin_named_is_a_test_on_the_bed():
    twins = list(_named_twins())
    assert len(twins) >= 2, twins  # the Horovod Spark examples, torch and Keras
    repo = os.path.dirname(TESTS)
    for caller, twin in twins:
        module, _, function = twin.partition("::")
        assert module.startswith("tests/multihost/"), (caller, twin)
        with open(os.path.join(repo, module)) as f:
            assert f"\ndef {function}(" in f.read(), (caller, twin)


def _request(*nodeids):
    return types.SimpleNamespace(session=types.SimpleNamespace(
        items=[types.SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]))


TWIN = "tests/multihost/test_multihost_x.py::test_across_hosts"


def test_skipped_where_the_twin_is_in_the_session_and_the_bed_can_be_built(monkeypatch):
    monkeypatch.setattr(bed_twins, "_bed_unavailable", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="test_across_hosts runs this across"):
        bed_twins.skip_if_the_bed_runs(_request("tests/a.py::t", TWIN), TWIN)


def test_runs_where_the_twin_is_not_selected(monkeypatch):
    monkeypatch.setattr(bed_twins, "_bed_unavailable", lambda: None)
    bed_twins.skip_if_the_bed_runs(_request("tests/a.py::t"), TWIN)


def test_runs_where_no_bed_can_be_built(monkeypatch):
    monkeypatch.setattr(bed_twins, "_bed_unavailable", lambda: "the test bed needs root")
    bed_twins.skip_if_the_bed_runs(_request("tests/a.py::t", TWIN), TWIN)
