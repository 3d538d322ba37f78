"""Horovod's Spark estimator examples, unmodified (read from the local Horovod mirror at run
time), with the ``horovod`` shim importable, on the session's Spark local-cluster:
``examples/spark/pytorch/pytorch_spark_mnist.py`` here and ``keras_spark_mnist.py`` in the
TensorFlow environment. Their MNIST download is replaced by the file it would fetch, written
here: random 28x28 images in LIBSVM format, bz2-compressed (nothing is downloaded).

Each runs in this process (``runpy``) so that it finds the session: its ``getOrCreate()``
returns it, and its closing ``spark.stop()`` is held back for the tests after it."""
import bz2
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest

from hvd_trainer_launch import horovod_shim

pytest.importorskip("pyarrow")
MIRROR = os.environ.get("HVD_HOROVOD_MIRROR", "/work/.mirror/horovod+horovod/repo")
TAG = "v0.28.1"


def _example(path):
    shown = subprocess.run(["git", "-C", MIRROR, "show", f"{TAG}:{path}"], capture_output=True)
    if shown.returncode != 0:
        pytest.skip(f"Horovod's {path} is read from a local Horovod mirror, and {MIRROR} has "
                    "none (set HVD_HOROVOD_MIRROR)")
    return shown.stdout


def _mnist_file(folder, rows=120):
    """What the examples' download fetches: LIBSVM lines ``label index:value...`` of 784
    pixels, bz2-compressed; every digit appears."""
    rng = np.random.default_rng(0)
    lines = []
    for row in range(rows):
        pixels = rng.random(784)
        kept = np.flatnonzero(pixels > 0.7)
        values = " ".join(f"{i + 1}:{pixels[i]:.3f}" for i in kept)
        lines.append(f"{row % 10} {values}")
    with open(os.path.join(folder, "mnist.bz2"), "wb") as f:
        f.write(bz2.compress(("\n".join(lines) + "\n").encode()))


@pytest.fixture
def horovod_example(tmp_path, monkeypatch, spark):
    """Run a Horovod example script by its path in the mirror, with the shim importable and
    the session kept; returns what it printed."""
    shim = str(tmp_path / "shim")
    horovod_shim.write(shim)
    monkeypatch.syspath_prepend(shim)
    from pyspark.sql import SparkSession
    monkeypatch.setattr(SparkSession, "stop", lambda self: None)
    _mnist_file(str(tmp_path))

    def run(path, capsys):
        script = tmp_path / os.path.basename(path)
        script.write_bytes(_example(path))
        monkeypatch.setattr(sys, "argv", [str(script), "--num-proc", "3", "--epochs", "1",
                                          "--batch-size", "8", "--work-dir",
                                          str(tmp_path / "store"), "--data-dir", str(tmp_path)])
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
                del sys.modules[name]
        return capsys.readouterr().out
    return run


def test_pytorch_spark_mnist(horovod_example, capsys):
    pytest.importorskip("torch")
    out = horovod_example("examples/spark/pytorch/pytorch_spark_mnist.py", capsys)
    accuracy = [line for line in out.splitlines() if line.startswith("Test accuracy:")]
    assert len(accuracy) == 1 and 0.0 <= float(accuracy[0].split()[-1]) <= 1.0, out[-3000:]
    assert "Epoch 1/1 - loss: " in out


def test_keras_spark_mnist(horovod_example, capsys):
    pytest.importorskip("tensorflow")
    out = horovod_example("examples/spark/keras/keras_spark_mnist.py", capsys)
    accuracy = [line for line in out.splitlines() if line.startswith("Test accuracy:")]
    assert len(accuracy) == 1 and 0.0 <= float(accuracy[0].split()[-1]) <= 1.0, out[-3000:]
