"""Horovod code on the engines, unchanged: a horovod.ray script run with hvd_trainer's horovod
shim importable (what ``hvdrun --horovod`` gives a script), whose driver imports horovod.ray
and whose function imports horovod.torch on the ranks; and a Databricks HorovodRunner-style
``main`` that imports horovod.torch, run by hvd_trainer.spark.run from a driver that never
imported horovod (the ranks get the shim by themselves)."""
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


def test_a_horovodrunner_main_runs_unchanged_on_spark(spark, monkeypatch):
    # Issue 46: every rank failed with "No module named 'horovod'" unless the driver itself
    # had imported horovod from the shim.
    import cloudpickle
    import hvd_trainer.spark
    for name in [n for n in sys.modules if n.split(".")[0] == "horovod"]:
        monkeypatch.delitem(sys.modules, name)  # a driver that never imported horovod
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    results = hvd_trainer.spark.run(_spark_train, args=(2.0,), num_proc=3)
    assert results == [(rank, rank, 12.0) for rank in range(3)]
    assert not engines.job_processes()
