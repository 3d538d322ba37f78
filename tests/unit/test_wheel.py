"""The wheel built from this checkout installs into a fresh venv and runs a 2-rank job.

What a user of the published package gets: the wheel (``pip wheel`` of the checkout) holds
every package, the CUDA sources and the license; installed with mpi4py and MPICH's wheel into
an empty venv, its ``hvdrun -np 2`` runs an allreduce whose sum is checked by hand, from a
folder outside the checkout, so that nothing is imported from the source tree. Skipped where
pip cannot reach a package index (or its cache) for mpi4py and mpich.
"""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest

# The same in every environment: CI checks it in its first pass only.
pytestmark = pytest.mark.tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the build reads.
FILES, FOLDERS = ("pyproject.toml", "README.md", "LICENSE"), ("hvd_trainer", "hvd_trainer_launch")
# Bounds for pip's requests: an index that cannot be reached answers within seconds.
PIP_NETWORK = ["--timeout", "10", "--retries", "1", "--disable-pip-version-check"]
UNREACHABLE = ("No matching distribution found", "Could not find a version",
               "NewConnectionError", "Max retries exceeded", "Network is unreachable",
               "Temporary failure in name resolution", "Read timed out")
JOB = """
import os, numpy as np, hvd_trainer as hvd
hvd.init()
assert os.path.dirname(hvd.__file__).startswith({venv!r}), hvd.__file__
x = np.array([1.0, 10.0, 100.0]) * (hvd.rank() + 1)
print("rank", hvd.rank(), "of", hvd.size(), "sum", hvd.allreduce(x, op=hvd.Sum).tolist())
"""


def _pip(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def _check(proc, wanted):
    """Skip where pip could not fetch ``wanted``; fail on any other error of pip's."""
    if proc.returncode:
        out = proc.stdout + proc.stderr
        if any(sign in out for sign in UNREACHABLE):
            pytest.skip(f"pip cannot reach a package index (or its cache) for {wanted}: "
                        + out.strip().splitlines()[-1])
        raise AssertionError(out)


def _source_version():
    with open(os.path.join(REPO, "hvd_trainer", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)[1]


def _packages():
    found = []
    for root in ("hvd_trainer", "hvd_trainer_launch"):
        for folder, _, files in os.walk(os.path.join(REPO, root)):
            if "__init__.py" in files:
                found.append(os.path.relpath(folder, REPO).replace(os.sep, "/"))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of this checkout."""
    base = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the build reads: setuptools would leave build/ in the
    # checkout, whose stale files a later wheel would take in.
    source = base / "source"
    source.mkdir()
    for name in FILES:
        shutil.copy(os.path.join(REPO, name), source / name)
    for name in FOLDERS:
        shutil.copytree(os.path.join(REPO, name), source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    # This environment's setuptools builds it when it is recent enough (no download); else
    # pip fetches one into an isolated build environment.
    try:
        isolated = int(metadata.version("setuptools").split(".")[0]) < 77
    except metadata.PackageNotFoundError:
        isolated = True
    built = _pip("wheel", "--no-deps", "-q", *([] if isolated else ["--no-build-isolation"]),
                 *PIP_NETWORK, "-w", str(base / "dist"), str(source), cwd=base)
    _check(built, "setuptools")
    return next((base / "dist").glob("hvd_trainer-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel):
    """A fresh venv with the wheel, mpi4py and mpich installed."""
    base = wheel.parent.parent
    venv = base / "venv"
    # --without-pip: this pip installs into it (pip --python), which saves its own copy.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # --no-compile: no .pyc files for NumPy's many modules (half of the install's time).
    installed = _pip("--python", python, "install", "-q", "--no-compile", *PIP_NETWORK,
                     str(wheel), "mpi4py>=4", "mpich", cwd=base)
    _check(installed, "mpi4py and mpich")
    return venv


def test_the_wheel_holds_every_package_the_cuda_sources_and_the_license(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for package in _packages():
        assert f"{package}/__init__.py" in names, package
    for kernel in os.listdir(os.path.join(REPO, "hvd_trainer", "cuda")):
        if kernel.endswith(".cu"):
            assert f"hvd_trainer/cuda/{kernel}" in names
    version = _source_version()
    assert wheel.name.startswith(f"hvd_trainer-{version}-")
    assert f"hvd_trainer-{version}.dist-info/licenses/LICENSE" in names


def test_the_installed_hvdrun_runs_a_two_rank_allreduce(venv):
    env_dir = venv
    bin_dir = str(env_dir / "bin")
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1")
    version = subprocess.run([os.path.join(bin_dir, "hvdrun"), "--version"], capture_output=True,
                             text=True, env=env, cwd=str(env_dir), timeout=120)
    assert version.stdout == f"hvdrun (hvd_trainer) {_source_version()}\n", version.stderr
    job = subprocess.run([os.path.join(bin_dir, "hvdrun"), "-np", "2",
                          os.path.join(bin_dir, "python"), "-c", JOB.format(venv=str(env_dir))],
                         capture_output=True, text=True, env=env, cwd=str(env_dir), timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    # Hand-computed: rank r sends (r + 1) * [1, 10, 100]; on 2 ranks the sum is 3 times that.
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 sum [3.0, 30.0, 300.0]" in job.stdout, \
            job.stdout
