"""Databricks' HorovodRunner: rank 0's value from the executors (np > 0; a ``main`` that
imports horovod.torch among them, from a driver that never imported horovod: the ranks get
the shim by themselves) and from ranks on the driver's machine with no Spark at all (np < 0,
in a process that never imports pyspark), and the refusals (np = 0, not an int, an unknown
driver_log_verbosity)."""
import json
import os
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

import engines
from hvd_trainer.spark import HorovodRunner

RANKS = 3
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _main(scale, tag):
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    print(f"{tag} from rank {hvd.rank()}", flush=True)
    total = hvd.allreduce(np.array([float(hvd.rank() + 1) * scale]), op=hvd.Sum)
    return hvd.rank(), hvd.size(), float(total[0])


def _torch_main(scale, tag):
    """_main as a Databricks user writes it, with horovod.torch."""
    import torch
    import horovod.torch as hvd
    hvd.init()
    print(f"{tag} from rank {hvd.rank()}", flush=True)
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1) * scale]), op=hvd.Sum)
    return hvd.rank(), hvd.size(), float(total[0])


def test_executors_give_rank_zeros_value(spark, capsys, monkeypatch):
    # Against the arithmetic: 1 + 2 + 3 ranks' values, times the scale.
    assert HorovodRunner(np=RANKS, driver_log_verbosity="all").run(
        _main, scale=2.0, tag="shown") == (0, RANKS, 12.0)
    assert "shown from rank 2" in capsys.readouterr().out
    # Issue 46: a main that imports horovod.torch failed on every rank ("No module named
    # 'horovod'") unless the driver itself had imported horovod from the shim.
    for name in [n for n in sys.modules if n.split(".")[0] == "horovod"]:
        monkeypatch.delitem(sys.modules, name)  # a driver that never imported horovod
    assert HorovodRunner(np=RANKS).run(_torch_main, scale=1.0, tag="quiet") == (0, RANKS, 6.0)
    assert "quiet from rank" not in capsys.readouterr().out  # log_callback_only: Databricks'
    assert not engines.job_processes()


_DRIVER_ONLY = textwrap.dedent("""
    import json, sys
    import numpy as np
    from hvd_trainer.spark import HorovodRunner

    def main(scale):
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        return hvd.rank(), hvd.size(), float(hvd.allreduce(np.array([scale]), op=hvd.Sum)[0])

    value = HorovodRunner(np=-3).run(main, scale=0.5)
    print("RESULT", json.dumps([value, "pyspark" in sys.modules]))
""")


def test_negative_np_runs_on_the_driver_without_spark():
    done = subprocess.run([sys.executable, "-c", _DRIVER_ONLY], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    value, imported_pyspark = json.loads(done.stdout.split("RESULT", 1)[1])
    assert value == [0, 3, 1.5] and not imported_pyspark


@pytest.mark.parametrize("np, why", [(0, "np=0 is refused: it meant 'every task slot"),
                                     (2.0, "np=2.0: give an int"),
                                     (True, "np=True: give an int")])
def test_refusals(np, why):
    with pytest.raises(ValueError, match=why):
        HorovodRunner(np=np)
    with pytest.raises(TypeError):  # keyword-only, as Databricks'
        HorovodRunner(2)
    with pytest.raises(ValueError, match="driver_log_verbosity='some': give one of 'all', "
                                         "'log_callback_only'"):
        HorovodRunner(np=2, driver_log_verbosity="some")
