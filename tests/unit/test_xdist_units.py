"""tests/conftest.py's units of work under pytest-xdist (the README runs ``-n 2``), read
against the test modules' own sources: the modules of one shared job are one unit, every
module that starts clusters, engine agents or the multi-host test bed is in the one unit
that runs them one after another, and any other module is a unit of its own."""
import ast
import os
import re

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _unit_of(config):
    """tests/conftest.py's unit_of, from the conftest pytest loaded (importing it again would
    run its module code twice)."""
    path = os.path.join(TESTS, "conftest.py")
    found = [plugin for plugin in config.pluginmanager.get_plugins()
             if getattr(plugin, "__file__", None) == path]
    assert len(found) == 1, found
    return found[0].unit_of


def _modules():
    """Each test module's id (as in a test's node id) and source."""
    repo = os.path.dirname(TESTS)
    for folder, _, files in os.walk(TESTS):
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, repo).replace(os.sep, "/"), f.read()


def test_the_modules_of_a_shared_job_are_one_unit(pytestconfig):
    unit_of = _unit_of(pytestconfig)
    modules = dict(_modules())
    for job in ("TORCH_JOB", "MXNET_JOB"):
        users = [m for m, source in modules.items()
                 if re.search(rf"^from runner import .*\b{job}\b", source, re.M)]
        assert len(users) >= 2, (job, users)
        assert len({unit_of(f"{m}::test") for m in users}) == 1, (job, users)
    gpu = [m for m, source in modules.items()
           if m.startswith("tests/gpu/") and re.search(r"^import gpu\b|^from gpu import", source,
                                                       re.M)]
    assert len(gpu) >= 2 and len({unit_of(f"{m}::test") for m in gpu}) == 1, gpu


def test_clusters_agents_and_the_test_bed_are_one_unit_and_other_modules_their_own(
        pytestconfig):
    unit_of = _unit_of(pytestconfig)
    modules = dict(_modules())
    waiting = [m for m, source in modules.items()
               if m.startswith(("tests/engines/", "tests/multihost/"))
               or (m.startswith("tests/parallel/") and "hvd_trainer_launch.engines" in source)]
    assert len(waiting) > 20
    assert {unit_of(f"{m}::test[x]") for m in waiting} == {"clusters"}
    plain = "tests/unit/test_readme.py"
    assert unit_of(f"{plain}::test_readme_stays_short") == plain
    assert unit_of("tests/parallel/test_join.py::test_join[3]") == "tests/parallel/test_join.py"


def test_tf_keras_jobs_are_one_unit_apart_from_the_module_s_other_jobs(pytestconfig):
    unit_of = _unit_of(pytestconfig)
    with open(os.path.join(TESTS, "parallel", "test_tf.py")) as f:
        source = f.read()
    tree = ast.parse(source)
    bodies = {node.name: ast.get_source_segment(source, node) for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    keras = [name for name, body in bodies.items()
             if re.search(r"KERAS[23]_JOB|tf_keras2_worker\.py", body)]
    others = [name for name in bodies if name not in keras]
    assert len(keras) >= 4 and len(others) >= 3, (keras, others)
    units = lambda names: {unit_of(f"tests/parallel/test_tf.py::{n}[3-x]") for n in names}  # noqa: E731
    assert len(units(keras)) == 1 and len(units(others)) == 1, (keras, others)
    assert units(keras) != units(others)
