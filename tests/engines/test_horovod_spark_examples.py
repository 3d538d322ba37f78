"""Horovod's Spark estimator examples, unmodified (read from the local Horovod mirror at run
time), with the ``horovod`` shim importable, on the session's Spark local-cluster:
``examples/spark/pytorch/pytorch_spark_mnist.py`` here and ``keras_spark_mnist.py`` in the
TensorFlow environment. Their MNIST download is replaced by the file it would fetch, written
here: random 28x28 images in LIBSVM format, bz2-compressed (nothing is downloaded).

Each runs in this process (``runpy``) so that it finds the session: its ``getOrCreate()``
returns it, and its closing ``spark.stop()`` is held back for the tests after it. Where the
multi-host test bed runs the same example across its hosts in this session (tests/multihost's
test_multihost_spark.py and test_multihost_spark_keras.py), that run stands for this one
(tests/bed_twins.py)."""
import runpy
import sys

import pytest

import bed_twins
import horovod_examples
from hvd_trainer_launch.rank import horovod_shim

pytest.importorskip("pyarrow")


@pytest.fixture
def horovod_example(tmp_path, monkeypatch, spark):
    """Run a Horovod example script by its path in the mirror, with the shim importable and
    the session kept; returns what it printed."""
    why = horovod_examples.missing()
    if why:
        pytest.skip(why)
    shim = str(tmp_path / "shim")
    horovod_shim.write(shim)
    monkeypatch.syspath_prepend(shim)
    from pyspark.sql import SparkSession
    monkeypatch.setattr(SparkSession, "stop", lambda self: None)
    horovod_examples.write_mnist(str(tmp_path))

    def run(path, capsys):
        script = horovod_examples.write_example(path, str(tmp_path))
        monkeypatch.setattr(sys, "argv", [script, *horovod_examples.arguments(
            str(tmp_path), str(tmp_path / "store"))])
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
                del sys.modules[name]
        return capsys.readouterr().out
    return run


def test_pytorch_spark_mnist(request, horovod_example, capsys):
    pytest.importorskip("torch")
    bed_twins.skip_if_the_bed_runs(request, "tests/multihost/test_multihost_spark.py::"
                                   "test_horovods_pytorch_spark_mnist_runs_unmodified_across_hosts")
    out = horovod_example(horovod_examples.PYTORCH_MNIST, capsys)
    accuracy = horovod_examples.accuracy(out)
    assert accuracy is not None and 0.0 <= accuracy <= 1.0, out[-3000:]
    assert "Epoch 1/1 - loss: " in out


def test_keras_spark_mnist(request, horovod_example, capsys):
    pytest.importorskip("tensorflow")
    bed_twins.skip_if_the_bed_runs(request, "tests/multihost/test_multihost_spark_keras.py::"
                                   "test_horovods_keras_spark_mnist_runs_unmodified_across_hosts")
    out = horovod_example(horovod_examples.KERAS_MNIST, capsys)
    accuracy = horovod_examples.accuracy(out)
    assert accuracy is not None and 0.0 <= accuracy <= 1.0, out[-3000:]
