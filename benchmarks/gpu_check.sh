#!/usr/bin/env bash
# The GPU check: install, run the GPU tests, print the GPU figures. Needs one CUDA GPU and
# finishes in a few minutes. Usage: bash benchmarks/gpu_check.sh   (PYTHON=... to pick one)
#
# It installs with pip only what is missing (CuPy for CUDA 12 with its NCCL, mpi4py and MPICH,
# pytest, PyTorch), so a GPU image with CuPy already in it keeps its own. hvd_trainer itself is
# installed from this checkout where pip can build it, and otherwise runs from the source.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

echo "== install"
missing=()
$PY -c "import cupy" 2>/dev/null || missing+=(cupy-cuda12x nvidia-nccl-cu12)
$PY -c "import mpi4py.MPI" 2>/dev/null || missing+=(mpi4py mpich)
$PY -c "import pytest" 2>/dev/null || missing+=(pytest)
if ((${#missing[@]})); then
    $PY -m pip install -q "${missing[@]}" || exit 1
fi
# PyTorch with CUDA, for tests/gpu/test_torch_cuda.py (a GPU image usually has it; a CUDA
# wheel is several GB, so a failed install only skips those tests).
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch \
    || echo "gpu_check: no PyTorch here; the torch CUDA tests will be skipped"
$PY -c "import ml_dtypes" 2>/dev/null || $PY -m pip install -q "ml_dtypes>=0.5,<0.6" \
    || echo "gpu_check: no ml_dtypes (hvd_trainer.torch needs it); the torch CUDA tests will fail"
if ! $PY -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
        && ! $PY -m pip install -q --no-deps -e . 2>/dev/null; then
    echo "gpu_check: pip cannot build hvd_trainer here; running it from the source"
    src=$(mktemp -d)
    ln -s "$PWD/launch" "$src/hvd_trainer_launch"
    export PYTHONPATH="$PWD:$src${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi -L || true
$PY - <<'PY' || exit 1
import cupy, numpy, sys
import hvd_trainer as hvd
from hvd_trainer.backends import nccl
print(f"Python {sys.version.split()[0]}, NumPy {numpy.__version__}, CuPy {cupy.__version__}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
print(f"cuda_built={hvd.cuda_built()} nccl_built={hvd.nccl_built()}", end="")
print(f" NCCL {nccl.nccl.get_version()}" if nccl.available() else " (no NCCL: host-staged only)")
if not hvd.cuda_built():
    sys.exit("gpu_check: CuPy sees no CUDA GPU here; run this on a machine with one")
try:
    import torch
    print(f"PyTorch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
except ImportError:
    print("PyTorch: not installed")
PY

echo "== GPU tests (tests/gpu, the torch CUDA ones included)"
timeout 420 $PY -m pytest tests/gpu -q -rs -p no:cacheprovider || status=1

echo "== GPU figures, one process"
timeout 150 $PY benchmarks/gpu.py || status=1

echo "== host-staged allreduce, 2 ranks on the one GPU"
one_gpu=${CUDA_VISIBLE_DEVICES:-0}  # both ranks see only the first GPU, so they share it
CUDA_VISIBLE_DEVICES=${one_gpu%%,*} timeout 100 $PY -m hvd_trainer_launch.hvdrun -np 2 \
    $PY benchmarks/gpu.py --staged || status=1

echo "== gpu_check exit status $status"
exit $status
