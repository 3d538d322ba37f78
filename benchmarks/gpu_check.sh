#!/usr/bin/env bash
# The GPU check: install, run the GPU tests, print the GPU figures. Needs one CUDA GPU and
# finishes in a few minutes. Usage: bash benchmarks/gpu_check.sh   (PYTHON=... to pick one)
#
# Where pip can reach the package index it installs hvd_trainer with the gpu extra (CuPy for
# CUDA 12, its NCCL, mpi4py and MPICH). Where CuPy, mpi4py and pytest are installed already
# (a GPU image without internet, say) it installs hvd_trainer alone on top of them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

echo "== install"
if $PY -c "import cupy, mpi4py.MPI, pytest" 2>/dev/null; then
    $PY -m pip install -q --no-deps --no-build-isolation -e . \
        || $PY -m pip install -q --no-deps --no-build-isolation . || exit 1
else
    $PY -m pip install -q -e ".[gpu]" pytest || exit 1
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
PY

echo "== GPU tests"
timeout 300 $PY -m pytest tests/gpu -q -rs -p no:cacheprovider || status=1

echo "== GPU figures, one process"
timeout 150 $PY benchmarks/gpu.py || status=1

echo "== host-staged allreduce, 2 ranks on the one GPU"
timeout 100 $PY -m hvd_trainer_launch.hvdrun -np 2 $PY benchmarks/gpu.py --staged || status=1

echo "== gpu_check exit status $status"
exit $status
