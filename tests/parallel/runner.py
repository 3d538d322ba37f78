"""Launch a worker script on several ranks for a test, bounded in time."""
import os
import subprocess
import sys
from typing import Sequence

from hvd_trainer_launch import mpi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(REPO, "tests", "parallel", "workers")


def run_ranks(script: str, np: int, args: Sequence[str] = (), timeout: float = 120,
              env: dict = None, check: bool = True,
              plain: bool = False, hvdrun_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``tests/parallel/workers/<script>`` (or a path) on ``np`` ranks through hvdrun.

    ``hvdrun_args`` are further hvdrun flags (e.g. the elastic ones). With ``plain``, through
    the MPI library's own mpiexec instead, as a user without hvdrun would (only the flags this
    machine needs: Open MPI's oversubscribing by-slot mapping and root permission). Returns the completed
    process (stdout and stderr as text). With ``check``, a non-zero exit fails the test with
    the job's whole output, so a failing rank says what went wrong.
    """
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    program = [sys.executable, path, *args]
    if plain:
        cmd = mpi.build_command(mpi.find_launcher(), np, [], [], program, {})
    else:
        cmd = [sys.executable, "-m", "hvd_trainer_launch.hvdrun", "-np", str(np), *hvdrun_args,
               *program]
    # One OpenMP thread per rank: three ranks share two cores in CI.
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr}")
    return proc
