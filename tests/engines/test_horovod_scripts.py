"""Horovod code on the engines, unchanged: a horovod.ray script run with hvd_trainer's horovod
shim importable (what ``hvdrun --horovod`` gives a script), whose driver imports horovod.ray
and whose function imports horovod.torch on the ranks. (A Databricks HorovodRunner ``main``
that imports horovod.torch is in test_horovod_runner.py.)"""
import os
import subprocess
import sys
import textwrap

import pytest

from hvd_trainer_launch.rank import horovod_shim

_RAY_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import ray
    from horovod.ray import RayExecutor

    def train(worker):
        import torch
        import horovod.torch as hvd
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
        return hvd.rank(), hvd.local_rank(), hvd.size(), float(total)

    ray.init(address=sys.argv[1], log_to_driver=False)
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=3)
    executor.start()
    print("RESULTS", executor.execute(train))
    executor.shutdown()
""")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("shim") / "horovod_shim")
    horovod_shim.write(folder)
    return folder


def test_horovod_ray_script(ray_cluster, shim):
    address = ray_cluster.get_runtime_context().gcs_address
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [shim] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    done = subprocess.run([sys.executable, "-c", _RAY_SCRIPT, address], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = eval(done.stdout.split("RESULTS", 1)[1])
    # Against the arithmetic: ranks 0..2 on one host, the Sum of 1+2+3.
    assert results == [(rank, rank, 3, 6.0) for rank in range(3)]

