"""Horovod's ``examples/ray/pytorch_ray_elastic.py``, unmodified (read from the local Horovod
mirror at run time), run as its own driver with the ``horovod`` shim importable, on a Ray head
of its own on this machine: 4 CPUs and 2 GPUs declared, so that the example's
``ElasticRayExecutor(settings, use_gpu=True, cpus_per_slot=2)`` finds 2 slots (Ray places by
the GPUs declared; there is no device, so the example's own ``torch.cuda.is_available()`` is
False and it trains on the CPU). Its ``ray.init(address="auto")`` finds the head through
``RAY_ADDRESS``.

What its MNIST download would fetch is written by the test (four idx files of synthetic
images, one bright block per digit: horovod_examples.write_mnist_idx), and torchvision is the
test-only stand-in in tests/standins (pip's torchvision for torch 2.13 is a CUDA build whose
operators do not load beside the CPU torch): nothing is downloaded. Two epochs of batches of
16 on 2 ranks, a log line per batch. Checked: it exits 0, logs both epochs with a lower mean
loss in the second, prints its test line (rank 0's) with an accuracy above chance, and no
process of the job is left."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import engines
import horovod_examples
from hvd_trainer_launch.rank import horovod_shim

STANDINS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "standins")
ARGUMENTS = ["--epochs", "2", "--batch-size", "16", "--log-interval", "1", "--lr", "0.05"]


def test_pytorch_ray_elastic_example_trains_on_two_slots(tmp_path):
    why = horovod_examples.missing()
    if why:
        pytest.skip(why)
    pytest.importorskip("ray")
    pytest.importorskip("torch")
    data, home = tmp_path / "data", tmp_path / "home"
    home.mkdir()  # the example's FileLock("~/.horovod_lock") lands here, on every rank
    horovod_examples.write_mnist_idx(str(data))
    shim = str(tmp_path / "shim")
    horovod_shim.write(shim)
    script = horovod_examples.write_example(horovod_examples.PYTORCH_RAY_ELASTIC, str(tmp_path))
    temp = tempfile.mkdtemp(prefix="hvdray-")  # short: Ray's sockets live under it
    marker = f"HVD_TEST_RAY_EXAMPLE_{os.getpid()}"
    # The ranks' environment is their actor's: the head's, with HOME and the path to the
    # stand-in; the driver's sys.path folders (the shim) reach them through the executor.
    env = {"HOME": str(home), "PYTHONPATH": STANDINS, "OMP_NUM_THREADS": "1"}
    try:
        address = engines.ray_head(temp, marker, cpus=4, gpus=2, env=env)
        done = subprocess.run(
            [sys.executable, script, *ARGUMENTS, "--data-dir", str(data)], cwd=tmp_path,
            env=dict(os.environ, **dict(env, PYTHONPATH=os.pathsep.join([shim, STANDINS])),
                     RAY_ADDRESS=address, RAY_AUTH_MODE="disabled"),
            capture_output=True, text=True, timeout=240)
        left = engines.job_processes()
    finally:
        engines.stop_processes_with(marker)
        shutil.rmtree(temp, ignore_errors=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    losses = {}
    for epoch, loss in re.findall(r"Train Epoch: (\d+) \[.*\]\tLoss: ([0-9.]+)", out):
        losses.setdefault(int(epoch), []).append(float(loss))
    assert sorted(losses) == [1, 2], out[-4000:]
    # 256 images on 2 ranks in batches of 16: 8 batches per rank and epoch, a line each.
    assert [len(losses[epoch]) for epoch in (1, 2)] == [16, 16], out[-4000:]
    mean = {epoch: sum(values) / len(values) for epoch, values in losses.items()}
    assert mean[2] < mean[1], mean
    accuracy = re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", out)
    assert len(accuracy) == 1 and float(accuracy[0]) > 20, out[-4000:]  # rank 0's
    assert "starting 2 ranks" in out, out[-4000:]
    assert left == []
