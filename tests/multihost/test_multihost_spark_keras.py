"""Horovod's examples/spark/keras/keras_spark_mnist.py, unmodified, on the test bed's Spark
cluster (a master on h1, a one-core executor on each host; spark_bed.py), from a driver on h1
with hvd_trainer's horovod shim importable. It needs TensorFlow, so it runs in CI's
TensorFlow environment; its MNIST file is written here (nothing is downloaded), and its store
is a folder every host sees."""
import importlib.util
import json
import os

import pytest

import horovod_examples
import multihost
import spark_bed

if importlib.util.find_spec("tensorflow") is None:  # not imported: seconds, and not needed here
    pytest.skip("TensorFlow is not installed here (the Keras example needs it); pip install -e "
                "'.[test-tensorflow]'",
                allow_module_level=True)

_DRIVER = """
import sys
import spark_bed
spark_bed.session(sys.argv[1])  # the example's getOrCreate() finds it, with three executors
spark_bed.run_example(sys.argv[2], sys.argv[3], sys.argv[4])
"""


def test_horovods_keras_spark_mnist_runs_unmodified_across_hosts(bed, spark_master):
    why = horovod_examples.missing()
    if why:
        pytest.skip(why)
    folder = os.path.join(bed.shared, "keras-mnist")
    os.mkdir(folder)
    example = horovod_examples.write_example(horovod_examples.KERAS_MNIST, folder)
    horovod_examples.write_mnist(folder)
    arguments = horovod_examples.arguments(folder, os.path.join(folder, "store"))
    done = bed.run("h1", spark_bed.driver_command(_DRIVER, folder, example,
                                                  json.dumps(arguments)),
                   cwd=folder, env=spark_bed.driver_environment(), capture_output=True,
                   text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    accuracy = horovod_examples.accuracy(done.stdout)
    assert accuracy is not None and 0.0 <= accuracy <= 1.0, done.stdout[-3000:]
    # Keras's epoch line on the driver, from the history every rank agreed.
    assert "Epoch 1/1" in done.stdout, done.stdout[-3000:]
    assert multihost.wait_until_no_job_is_left(bed) == {}
