"""Horovod scripts for horovod.ray and horovod.spark, unchanged but for running with
hvd_trainer's horovod shim importable (what ``hvdrun --horovod`` gives a script): the driver
imports horovod.ray / horovod.spark, the function imports horovod.torch on the ranks."""
import os
import subprocess
import sys
import textwrap

import pytest

import engines
from hvd_trainer_launch import horovod_shim

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


def _spark_train(scale):
    import torch
    import horovod.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1) * scale]), op=hvd.Sum)
    return hvd.rank(), hvd.local_rank(), float(total)


def test_horovod_spark_script(spark, shim):
    import cloudpickle
    saved_path = list(sys.path)
    sys.path.insert(0, shim)
    try:
        import horovod.spark
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        results = horovod.spark.run(_spark_train, args=(2.0,), num_proc=3)
    finally:
        sys.path[:] = saved_path
        for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
            del sys.modules[name]
    assert results == [(rank, rank, 12.0) for rank in range(3)]
    assert not engines.job_processes()
