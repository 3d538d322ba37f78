"""Whether an MPI launcher started this process, and the check that refuses a world of 1
where the launcher started several processes (each would otherwise train alone).
"""
import os
from typing import Optional

from ..backends import Communicator
from .config import env

# Variables that MPI launchers and Slurm set in every rank's environment.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                  "MPI_LOCALNRANKS", "HVD_LAUNCHED")
# Where launchers state how many processes they started: Hydra, Open MPI, Slurm (within a
# task, where SLURM_PROCID is set) and Gloo-style launchers such as horovodrun --gloo.
_JOB_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "HOROVOD_SIZE")
# Launchers that may state a rank but no size (PMIx puts none in the environment): a rank
# above 0 means the job has more than one process.
_JOB_RANK_VARS = ("PMIX_RANK", "HOROVOD_RANK")


def launched_by_mpi() -> bool:
    """Whether a launcher started this process as part of an MPI job (HVD_BACKEND decides
    where it is set)."""
    if env("BACKEND") == "mpi":
        return True
    if env("BACKEND") == "local":
        return False
    if any(v in os.environ for v in _LAUNCHER_VARS):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def launcher_claim() -> Optional[str]:
    """What the launcher's environment says of a job of more than one process, or None."""
    def number(name: str) -> int:
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else 0

    for name in _JOB_SIZE_VARS:
        if number(name) > 1 and (name != "SLURM_NTASKS" or "SLURM_PROCID" in os.environ):
            return f"{name}={number(name)} says the job has {number(name)} processes"
    for name in _JOB_RANK_VARS:
        if number(name) > 0:
            return f"{name}={number(name)} says this process is rank {number(name)} of a larger job"
    return None


def check_launcher(world: Communicator, backend: str) -> None:
    """Refuse a world of 1 where the launcher started several processes: each would train alone.

    It happens when the mpiexec belongs to another MPI than the one mpi4py loaded, or when a
    launcher that is not MPI's (horovodrun --gloo) sets HOROVOD_SIZE.
    """
    if world.size > 1 or env("BACKEND") == "local":
        return
    claim = launcher_claim()
    if claim is None:
        return
    alone = "set HVD_BACKEND=local to run this process alone on purpose"
    if backend == "mpi":
        from ..backends import mpi
        # Open MPI ends its version text with a NUL.
        library = " ".join(mpi.library_version().replace("\0", "").split())
        raise RuntimeError(
            f"{claim}, but MPI gives this process a world of 1: the launcher does not belong to "
            f"the MPI library that mpi4py loaded ({library}). Start the job with "
            "that library's mpiexec, or with `hvdrun -np N ...`, which finds it (`hvdrun "
            f"--check-build` prints both); {alone}")
    raise RuntimeError(
        f"{claim}, but this process was not started by an MPI launcher, so it would train "
        "alone in a world of 1: hvd_trainer joins other processes only through MPI. Start the "
        "job with `hvdrun -np N ...` or with the mpiexec of the MPI library that mpi4py loads "
        f"(`hvdrun --check-build` names both); {alone}")
