"""init refuses a world of 1 when the launcher's environment says the job has more processes.

Each case starts ``python -c`` with the variables a launcher would set; mpi4py's MPI (MPICH
here) then really starts a world of 1, as it does under another MPI's mpiexec.
"""
import os
import subprocess
import sys

import pytest

from hvd_trainer.runtime import launcher_check

INIT = "import hvd_trainer; hvd_trainer.init(); print('size', hvd_trainer.size())"


def _without_launcher():
    """This environment without any launcher's or hvd_trainer's variables."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI", "OMPI", "PMIX", "SLURM", "HVD_", "HOROVOD_", "MPI_"))}


def _init(**variables):
    env = dict(_without_launcher(), **variables)
    return subprocess.run([sys.executable, "-c", INIT], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("variables, claim", [
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "PMI_SIZE=2 says the job has 2 processes"),
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"},
     "OMPI_COMM_WORLD_SIZE=3 says the job has 3 processes"),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, "SLURM_NTASKS=4 says the job has 4 processes"),
])
def test_another_mpis_launcher_is_refused_naming_the_variable_sizes_and_library(variables, claim):
    result = _init(**variables)
    assert result.returncode != 0 and "size" not in result.stdout
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"RuntimeError: {claim}, but MPI gives this process a world of 1"), \
        error
    assert "mpi4py loaded (MPICH" in error  # the library whose mpiexec to use
    assert "hvdrun -np N" in error and "HVD_BACKEND=local" in error


@pytest.mark.parametrize("variables, claim", [
    ({"HOROVOD_SIZE": "2", "HOROVOD_RANK": "0"}, "HOROVOD_SIZE=2 says the job has 2 processes"),
    ({"HOROVOD_RANK": "1"}, "HOROVOD_RANK=1 says this process is rank 1 of a larger job"),
])
def test_a_gloo_style_launcher_is_refused(variables, claim):
    result = _init(**variables)
    assert result.returncode != 0 and "size" not in result.stdout
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"RuntimeError: {claim}, but this process was not started by an "
                            "MPI launcher, so it would train alone in a world of 1"), error
    assert "hvdrun -np N" in error


@pytest.mark.parametrize("variables", [
    {},
    {"PMI_SIZE": "1", "PMI_RANK": "0"},
    {"SLURM_NTASKS": "4"},  # an allocation's batch script, outside any task
    {"HOROVOD_SIZE": "2", "HOROVOD_RANK": "1", "HVD_BACKEND": "local"},
])
def test_a_single_process_job_or_a_deliberate_local_run_starts(variables):
    result = _init(**variables)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["size", "1"]


def test_pmix_states_a_rank_but_no_size(monkeypatch):
    # A PMIx launcher (prterun, srun --mpi=pmix) puts no size in the environment, and MPICH
    # cannot start under a fake PMIx rank, so the claim is checked on its own.
    kept = _without_launcher()
    for name in list(os.environ):
        if name not in kept:
            monkeypatch.delenv(name)
    monkeypatch.setenv("PMIX_RANK", "0")
    assert launcher_check.launcher_claim() is None
    monkeypatch.setenv("PMIX_RANK", "5")
    assert launcher_check.launcher_claim() == "PMIX_RANK=5 says this process is rank 5 of a larger job"


def test_the_mpi_backend_starts_mpi_after_the_launcher_module_read_its_version():
    # hvdrun's launcher module imports mpi4py with rc.initialize off (hvd_trainer.run's driver
    # imports it; so did CI's pytest process, through tests that read the launcher): MPI was
    # never started, and the first call on a communicator aborted the process.
    script = ("from hvd_trainer_launch import mpi; mpi.mpi_library()\n"
              "import numpy as np\n"
              "from hvd_trainer.backends.mpi import MPI, MPICommunicator\n"
              "comm = MPICommunicator(MPI.COMM_SELF)\n"
              "print('objects', comm.allgather_object('x'))\n"
              "comm.free()")
    proc = subprocess.run([sys.executable, "-c", script], env=_without_launcher(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "objects ['x']" in proc.stdout
