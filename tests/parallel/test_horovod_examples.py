"""Horovod's own example scripts run unmodified under ``hvdrun --horovod`` on 2 ranks.

Each script is read from a Horovod git mirror when the test runs (``$HVD_HOROVOD_MIRROR``,
else tests/peer/run_peer_suites.py's default; the tag the peer suites read) and written to a
temporary folder: nothing of Horovod's is in this repository. Arguments are the scripts' own,
set small (one tiny batch, a small model). Both TensorFlow benchmarks are Keras 2 scripts
(``opt.variables()``, ``compile(experimental_run_tf_function=False)``), so they run with tf-keras
and ``TF_USE_LEGACY_KERAS=1``: the [test-tensorflow] environment (.venv-tf) has both.
"""
import importlib.util
import os
import subprocess
import sys
from typing import NamedTuple, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "run_peer_suites", os.path.join(REPO, "tests", "peer", "run_peer_suites.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

MIRROR = os.environ.get(harness.MIRROR_VARIABLE, harness.DEFAULT_MIRROR)
SMALL = ("--no-cuda", "--model", "MobileNetV3Small", "--batch-size", "2",
         "--num-batches-per-iter", "1")


class Example(NamedTuple):
    """A script of Horovod's examples/ folder, its arguments and what it needs installed."""

    path: str
    arguments: Tuple[str, ...]
    needs: Tuple[Tuple[str, str], ...]  # (module, how to add it)


KERAS2 = (("tensorflow", "this test runs in the [test-tensorflow] environment (.venv-tf), "
                         "see the README"),
          ("tf_keras", "pip install tf-keras==2.21.0 (Keras 2, which this script is written "
                       "for) in .venv-tf"))
EXAMPLES = {
    "tensorflow2_synthetic_benchmark": Example(
        "examples/tensorflow2/tensorflow2_synthetic_benchmark.py",
        SMALL + ("--num-warmup-batches", "1", "--num-iters", "1"), KERAS2),
    # Its timing skips the first epoch: two epochs give it one to report.
    "tensorflow2_keras_synthetic_benchmark": Example(
        "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
        SMALL + ("--num-iters", "2"), KERAS2),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_horovod_example_runs_unmodified(name, tmp_path):
    example = EXAMPLES[name]
    for module, how in example.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed here; {how}")
    if not os.path.isdir(MIRROR):
        pytest.skip(f"no Horovod git mirror at {MIRROR}: set {harness.MIRROR_VARIABLE} to a clone "
                    "of https://github.com/horovod/horovod")
    source = harness.git_show(MIRROR, harness.DEFAULT_TAG, example.path)
    if source is None:
        pytest.skip(f"{MIRROR} has no {example.path} at {harness.DEFAULT_TAG}")
    script = tmp_path / os.path.basename(example.path)
    script.write_bytes(source)
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "--horovod", "-np", "2",
         sys.executable, str(script), *example.arguments],
        capture_output=True, text=True, timeout=900,
        env=dict(os.environ, TF_USE_LEGACY_KERAS="1", OMP_NUM_THREADS="1",
                 TF_CPP_MIN_LOG_LEVEL="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "[0]<stdout>:Number of CPUs: 2" in out, out[-6000:]
    assert "[0]<stdout>:Total img/sec on 2 CPU(s): " in out, out[-6000:]
