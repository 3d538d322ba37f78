"""hvd_trainer.tensorflow's eager GPU tensors reach the core through DLPack without a host
copy, and results come back as GPU tensors (workers/tf_gpu_worker.py). Runs in the
TensorFlow environment (.venv-tf); TensorFlow's CPU build makes no GPU tensors, so there a
stand-in GPU tensor over CuPy device memory takes their place."""
import importlib.util

import pytest

from gpu import KINDS, job, names

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed here; these tests run in the [test-tensorflow] "
                "environment (.venv-tf), see the README", allow_module_level=True)


@pytest.mark.parametrize("case", names("tf_gpu_worker.py"))
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "standin-early"])
def test_tensorflow_gpu_tensors_reach_the_core_through_dlpack(kind, case):
    job(kind, ("tf_gpu_worker.py",), 1, timeout=600).check(case)
