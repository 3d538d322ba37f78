"""Packaging for hvd_trainer: the core, its MXNet adapter and the hvdrun launcher.

The launcher lives in launch/ but installs as ``hvd_trainer_launch`` so that no generic
top-level ``launch`` module lands in site-packages.
"""
from setuptools import setup

MXNET = ["mxnet==1.9.1", "numpy>=1.17,<1.24"]  # MXNet 1.9.1 fails to import with numpy>=1.24
MPI = ["mpi4py>=4", "mpich"]
EXAMPLES = ["scikit-learn"]

setup(
    name="hvd_trainer",
    version="0.1.0",
    description="Horovod-style ring-allreduce data-parallel training for MXNet Gluon, pip-only",
    python_requires=">=3.9",
    packages=["hvd_trainer", "hvd_trainer.backends", "hvd_trainer.mxnet", "hvd_trainer_launch"],
    package_dir={"hvd_trainer_launch": "launch"},
    install_requires=["numpy"],
    extras_require={
        "mxnet": MXNET,
        "mpi": MPI,
        "examples": MXNET + MPI + EXAMPLES,
        "test": MXNET + MPI + EXAMPLES + ["pytest"],
    },
    entry_points={"console_scripts": ["hvdrun = hvd_trainer_launch.hvdrun:main"]},
)
