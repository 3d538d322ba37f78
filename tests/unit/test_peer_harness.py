"""tests/peer/run_peer_suites.py: which files it exports from a mirror, the horovod shim it
writes, and how it reads each rank's pytest events into results and counts."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "run_peer_suites", os.path.join(REPO, "tests", "peer", "run_peer_suites.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def _events(folder, rank, *events):
    with open(os.path.join(folder, f"rank.{rank}.jsonl"), "w") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def _report(nodeid, when, outcome, text=""):
    return dict(event="report", nodeid=nodeid, when=when, outcome=outcome, text=text)


def test_reports_classify_every_collected_test(tmp_path):
    ids = [f"t.py::T::{n}" for n in ("ok", "bad", "setup", "skip", "hung", "never")]
    ok, bad, setup, skip, hung, never = ids
    _events(tmp_path, 0, dict(event="collected", nodeids=ids),
            dict(event="start", nodeid=ok), _report(ok, "setup", "passed"),
            _report(ok, "call", "passed"), _report(ok, "teardown", "passed"),
            dict(event="start", nodeid=bad), _report(bad, "setup", "passed"),
            _report(bad, "call", "failed", "E   ValueError: wrong\n"),
            _report(bad, "teardown", "failed", "E   later\n"),
            dict(event="start", nodeid=setup), _report(setup, "setup", "failed", "E   boom\n"),
            _report(setup, "teardown", "passed"),
            dict(event="start", nodeid=skip), _report(skip, "setup", "skipped", "no GPU"),
            _report(skip, "teardown", "passed"),
            dict(event="start", nodeid=hung))
    # Rank 1 failed the test rank 0 passed and wrote nothing after it; rank 2 wrote nothing.
    _events(tmp_path, 1, dict(event="collected", nodeids=ids), dict(event="start", nodeid=ok),
            _report(ok, "call", "failed", "E   MismatchError: names\n"))
    ranks = harness.read_reports(str(tmp_path), 3)
    assert {n: r for n, (r, _) in ranks[0].items()} == {
        ok: "passed", bad: "failed", setup: "error", skip: "skipped", hung: "unfinished",
        never: "not run"}
    assert harness.first_error_line(ranks[0][bad][1]) == "ValueError: wrong"
    assert ranks[2] == {}
    summary = harness.summarize(ranks)
    assert summary["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1,
                                 "unfinished": 1, "not run": 1}
    assert summary["rank0_failing"] == [bad, setup, hung]
    assert summary["failing"] == {bad: [0], setup: [0], hung: [0], ok: [1]}


def test_subtests_count_one_by_one_in_place_of_their_test(tmp_path):
    ids = ["t.py::T::modes", "t.py::T::broken"]
    modes, broken = ids
    sub = lambda nodeid, name, outcome, text="": dict(  # noqa: E731
        _report(nodeid, "call", outcome, text), sub=name)
    _events(tmp_path, 0, dict(event="collected", nodeids=ids),
            dict(event="start", nodeid=modes), sub(modes, "graph_mode", "skipped", "TF1"),
            sub(modes, "eager_mode", "failed", "E   ValueError: eager\n"),
            _report(modes, "call", "passed"),  # pytest passes the test whose subtests failed
            dict(event="start", nodeid=broken), sub(broken, "eager_mode", "passed"),
            _report(broken, "call", "failed", "E   after the subtests\n"))
    results = {n: r for n, (r, _) in harness.read_reports(str(tmp_path), 1)[0].items()}
    assert results == {f"{modes} [graph_mode]": "skipped", f"{modes} [eager_mode]": "failed",
                       f"{broken} [eager_mode]": "passed", broken: "failed"}
    assert harness.parent(f"{modes} [eager_mode]") == modes


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   check=True, capture_output=True)


def tagged_mirror(mirror, files, tag="v1"):
    """A git repository at ``mirror`` holding ``files`` (path: text), tagged ``tag``."""
    for path, text in files.items():
        (mirror / path).parent.mkdir(parents=True, exist_ok=True)
        (mirror / path).write_text(text)
    _git(mirror, "init", "-q")
    _git(mirror, "add", ".")
    _git(mirror, "commit", "-q", "-m", "files")
    _git(mirror, "tag", tag)


def test_export_takes_the_suite_and_the_helpers_it_imports_by_bare_name(tmp_path):
    mirror, out = tmp_path / "mirror", tmp_path / "out"
    files = {"test/parallel/test_a.py": "import os\nfrom base_a import *\n",
             "test/parallel/base_a.py": "import sys\n    from common import helper\n",
             "test/utils/common.py": "helper = 1\n",
             "test/parallel/base_b.py": "unused = 1\n"}
    tagged_mirror(mirror, files)
    (mirror / "test/utils/common.py").write_text("helper = 2\n")  # not in the tag's tree

    exported = harness.export_suites(str(mirror), "v1", ["test_a.py"], str(out))
    assert sorted(exported) == ["test/parallel/base_a.py", "test/parallel/test_a.py",
                                "test/utils/common.py"]
    assert (out / "test/utils/common.py").read_text() == "helper = 1\n"
    with pytest.raises(SystemExit, match="no test/parallel/test_missing.py"):
        harness.export_suites(str(mirror), "v1", ["test_missing.py"], str(out))


def _have(*modules):
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.skipif(not _have("torch", "mxnet"), reason="torch and mxnet are not installed "
                    "here; this test runs in the [test] environment (.venv), see the README")
def test_shim_modules_are_the_adapters_names(tmp_path):
    pytest.importorskip("torch", reason="the shim re-exports hvd_trainer.torch: needs torch "
                        "(the [test] environment)")
    pytest.importorskip("mxnet", reason="the shim re-exports hvd_trainer.mxnet: needs MXNet "
                        "(the [test] environment)")
    harness.write_shim(str(tmp_path))
    check = """
import threading
import horovod.torch as hvd, hvd_trainer.torch as ours
from horovod.torch.mpi_ops import synchronize
import horovod.mxnet as mxhvd, hvd_trainer.mxnet as mxours
from horovod.runner.util.threads import in_thread
assert hvd.allreduce is ours.allreduce and hvd.DistributedOptimizer is ours.DistributedOptimizer
assert synchronize is ours.synchronize and mxhvd.DistributedTrainer is mxours.DistributedTrainer
done = threading.Event()
assert in_thread(target=done.set).daemon and done.wait(30)
print("shim ok")
"""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "shim ok", proc.stderr


@pytest.mark.skipif(not _have("tensorflow"), reason="tensorflow is not installed here; this "
                    "test runs in the [test-tensorflow] environment (.venv-tf), see the README")
def test_tensorflow_shim_modules_are_the_adapter_s_names(tmp_path):
    harness.write_shim(str(tmp_path))
    check = """
import horovod.tensorflow as hvd, hvd_trainer.tensorflow as ours, tensorflow as tf
import horovod.tensorflow.keras as hvd_keras, hvd_trainer.tensorflow.keras as keras_ours
import horovod.keras as plain_keras
from horovod.tensorflow.util import _executing_eagerly
from horovod.common.util import is_version_greater_equal_than as at_least
assert hvd.allreduce is ours.allreduce and hvd.DistributedGradientTape is ours.DistributedGradientTape
assert hvd_keras.DistributedOptimizer is keras_ours.DistributedOptimizer
assert plain_keras.callbacks.MetricAverageCallback is keras_ours.MetricAverageCallback
assert hvd._executing_eagerly() and _executing_eagerly()
assert not tf.function(lambda: tf.constant(_executing_eagerly()))()
assert at_least("2.21.0", "2.6.0") and not at_least("2.5.3", "2.6.0")
print("shim ok")
"""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.strip() == "shim ok", proc.stderr


def test_the_harness_shim_is_hvdrun_s_with_the_test_only_modules_added(tmp_path):
    harness.write_shim(str(tmp_path))
    # The estimator suites' stand-ins replace a few generated modules with ones that carry
    # the same hvd_trainer module's names plus stand-ins for Horovod's internals.
    layered = harness.estimator_standins.STANDIN_MODULES
    for path, text in harness.horovod_shim.sources().items():
        if path in layered:
            target = text.split("import ", 1)[1].split(" ", 1)[0]
            assert f"import {target} as _target" in (tmp_path / path).read_text()
        else:
            assert (tmp_path / path).read_text() == text
    for path in harness.SHIM_MODULES:
        assert path not in harness.horovod_shim.sources()
        assert (tmp_path / path).exists()
    # hvdrun --horovod finds it on PYTHONPATH as its own shim, and uses it.
    assert harness.horovod_shim.check([str(tmp_path)]) == str(tmp_path)
