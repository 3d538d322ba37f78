"""What every GPU test module starts with: skip on machines without CuPy and a CUDA GPU."""
import pytest

from hvd_trainer.runtime import runtime

REASON = ("needs CuPy and a CUDA GPU (pip install '.[gpu]'); benchmarks/gpu_check.sh runs "
          "these tests on a GPU machine")


def require_gpu() -> None:
    """Skip the calling test module, with the reason, where the GPU path cannot run."""
    if not runtime.cuda_built():
        pytest.skip(REASON, allow_module_level=True)
