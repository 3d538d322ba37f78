"""The command that adds each optional piece hvd_trainer uses.

Every message that names a missing package (an adapter whose framework is not installed, the
MPI backend without mpi4py, CUDA tensors without CuPy) and ``hvdrun --check-build`` take the
command from here, so each is written once. Standard library only.
"""
import importlib
from types import ModuleType
from typing import NamedTuple


class Piece(NamedTuple):
    """An optional piece: its name as people say it, and the command that adds it."""

    name: str
    command: str


MXNET = Piece("MXNet", 'pip install mxnet==1.9.1 "numpy<1.24" (MXNet 1.9.1 does not import '
                       "with NumPy 1.24 or later, so not beside a TensorFlow that needs NumPy 2)")
PYTORCH = Piece("PyTorch", "pip install torch")
TENSORFLOW = Piece("TensorFlow", "pip install tensorflow-cpu (tensorflow for GPUs); it needs "
                                 "NumPy 2, so give it an environment without MXNet 1.9.1")
KERAS2 = Piece("Keras 2 (tf-keras)", "pip install tf-keras==<TensorFlow's version>, then "
                                     "TF_USE_LEGACY_KERAS=1 selects it")
ML_DTYPES = Piece("ml_dtypes (bfloat16 on NumPy)", "pip install ml_dtypes")
MPI4PY = Piece("mpi4py and an MPI", "pip install mpi4py mpich (or apt-get install mpich, or "
                                    "openmpi-bin libopenmpi-dev, then pip install mpi4py)")
MPICH = Piece("MPICH", "pip install mpi4py mpich (or apt-get install mpich)")
OPENMPI = Piece("Open MPI", "pip install mpi4py openmpi, in an environment of its own (one MPI "
                            "per environment), or apt-get install openmpi-bin libopenmpi-dev")
CUPY = Piece("CuPy", "pip install cupy-cuda12x nvidia-nccl-cu12 (cupy-cuda13x "
                     "nvidia-nccl-cu13 for CUDA 13)")
NCCL = Piece("NCCL", "pip install nvidia-nccl-cu12 (nvidia-nccl-cu13 for CUDA 13)")
PYSPARK = Piece("pyspark", "pip install pyspark")
JAVA = Piece("Java (Spark needs it)", "apt-get install default-jre-headless")
RAY = Piece("Ray", "pip install ray")
SLURM = Piece("Slurm's srun", "apt-get install slurm-client")
SSHD = Piece("sshd (multi-host jobs)", "apt-get install openssh-server")
SSH = Piece("ssh (multi-host jobs)", "apt-get install openssh-client")


def require(module: str, piece: Piece, user: str) -> ModuleType:
    """Import ``module`` for ``user``; an ImportError that says how to add ``piece`` if it
    cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise type(error)(f"{user} needs {piece.name}, which cannot be imported here ({error}); "
                          f"add it with: {piece.command}", name=error.name,
                          path=error.path) from error
