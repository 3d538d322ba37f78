"""hvdrun --horovod on 3 ranks: a script written for Horovod (workers/horovod_style.py)
runs unmodified, its collectives checked against NumPy; ``import horovod`` works only inside
the job, the shim's folder is gone afterwards, and a real Horovod on the path is refused."""
import os
import subprocess
import sys

import pytest

from runner import case_job, case_names

SCRIPT = "horovod_style.py"
NP = 3


def hvdrun(*args, env=None):
    """hvdrun with ``args`` on this interpreter's launcher; the completed process."""
    return subprocess.run([sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def job():
    return case_job(SCRIPT, NP, hvdrun_args=["--horovod"])


@pytest.mark.parametrize("case", case_names(SCRIPT))
def test_horovod_script_runs_unmodified(case):
    job().check(case)


def test_the_shim_is_gone_after_the_job_and_import_horovod_fails_outside_it():
    folders = [line.split(" ", 1)[1] for line in job().output.splitlines()
               if line.startswith("[0]<stdout>:SHIM ")]
    assert len(folders) == 1, job().output[-3000:]
    assert not os.path.exists(folders[0])
    outside = subprocess.run([sys.executable, "-c", "import horovod"], capture_output=True,
                             text=True, timeout=60)
    assert outside.returncode == 1
    assert "No module named 'horovod'" in outside.stderr


def test_without_the_flag_a_rank_cannot_import_horovod():
    proc = hvdrun("-np", "2", sys.executable, "-c", "import horovod")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No module named 'horovod'" in proc.stderr


def test_a_real_horovod_on_the_path_is_refused(tmp_path):
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path)] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    proc = hvdrun("--horovod", "-np", "2", sys.executable, "-c", "print('RAN')", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "RAN" not in proc.stdout
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("hvdrun: error: --horovod: Horovod is installed ("
                              f"{tmp_path / 'horovod' / '__init__.py'})"), message
    assert "pip uninstall horovod" in message and "drop --horovod" in message
