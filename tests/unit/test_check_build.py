"""hvdrun --check-build, run as a user would (a subprocess): the frameworks, MPIs and optional
pieces it finds, with versions read independently (package metadata, the launcher's own
--version), and for each missing one the pip or apt command that adds it; and the adapters'
and the MPI backend's import errors, which name the same commands."""
import importlib.util
import os
import subprocess
import sys
from importlib import metadata

import pytest

from hvd_trainer_launch import installs, mpi


def check_build(tmp_path, missing=(), path=None):
    """hvdrun --check-build's lines by label, with ``missing`` modules made to fail their import
    (a PYTHONPATH folder whose module of that name raises ImportError) and PATH set to ``path``."""
    fakes = tmp_path / "fakes"
    fakes.mkdir(exist_ok=True)
    for name in missing:
        (fakes / f"{name}.py").write_text(f"raise ImportError('simulated: no {name}')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fakes)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    if path is not None:
        env["PATH"] = path
    proc = subprocess.run([sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "--check-build"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip()
            for line in proc.stdout.splitlines()}


def test_found_frameworks_and_mpis_carry_their_versions(tmp_path):
    lines = check_build(tmp_path)
    for label, distribution in (("MXNet", "mxnet"), ("PyTorch", "torch"),
                                ("TensorFlow", "tensorflow"), ("numpy", "numpy")):
        if importlib.util.find_spec(distribution) is None:
            continue
        version = metadata.version(distribution if distribution != "tensorflow"
                                   else "tensorflow-cpu")
        assert lines[label].startswith(version.split("+")[0]), lines[label]
    launcher = mpi.find_launcher()
    label = "MPICH (Hydra)" if launcher.flavour == mpi.HYDRA else "Open MPI"
    assert os.path.realpath(launcher.path) in lines[label]
    version = next(line.split(":", 1)[1].strip() for line in
                   mpi.version_text(launcher.path).splitlines() if "Version:" in line) \
        if launcher.flavour == mpi.HYDRA else mpi.version_text(launcher.path).splitlines()[0]
    assert version in lines[label], lines[label]
    other = "Open MPI" if launcher.flavour == mpi.HYDRA else "MPICH (Hydra)"
    if lines[other].startswith("not found"):
        piece = installs.OPENMPI if other == "Open MPI" else installs.MPICH
        assert lines[other] == f"not found; add it with: {piece.command}"


MISSING = {"PyTorch": ("torch", installs.PYTORCH), "MXNet": ("mxnet", installs.MXNET),
           "TensorFlow": ("tensorflow", installs.TENSORFLOW), "Ray": ("ray", installs.RAY),
           "pyspark": ("pyspark", installs.PYSPARK), "CuPy/NCCL": ("cupy", installs.CUPY),
           "mpi4py": ("mpi4py", installs.MPI4PY)}


MODULES = [module for module, _ in MISSING.values()]


@pytest.fixture(scope="module")
def all_missing(tmp_path_factory):
    """One --check-build with every module of MISSING failing its import and an empty PATH."""
    empty = tmp_path_factory.mktemp("empty")
    return check_build(tmp_path_factory.mktemp("missing"), missing=MODULES, path=str(empty))


@pytest.mark.parametrize("label", sorted(MISSING))
def test_a_missing_package_is_named_with_the_command_that_adds_it(all_missing, label):
    module, piece = MISSING[label]
    assert all_missing[label] == (f"not found (simulated: no {module}); add it with: "
                                  f"{piece.command}")


def test_without_mpi4py_the_mpi_library_line_says_how_to_add_it(all_missing):
    assert all_missing["MPI library"] == ("not found (mpi4py or libmpi missing); add it with: "
                                          f"{installs.MPI4PY.command}")


@pytest.mark.parametrize("label, program, piece", [
    ("Slurm srun", "srun", installs.SLURM), ("ssh", "ssh", installs.SSH),
    ("Java", "java", installs.JAVA)])
def test_a_missing_program_is_named_with_the_apt_command(all_missing, label, program, piece):
    assert all_missing[label] == f"not found (no {program} on PATH); add it with: {piece.command}"


def test_a_program_on_path_is_reported_with_its_version(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    srun = tools / "srun"
    srun.write_text("#!/bin/sh\necho slurm 23.02.7\n")
    srun.chmod(0o755)
    lines = check_build(tmp_path, missing=MODULES, path=str(tools))
    assert lines["Slurm srun"] == f"slurm 23.02.7 ({srun})"


@pytest.mark.parametrize("adapter, module, piece", [
    ("hvd_trainer.torch", "torch", installs.PYTORCH),
    ("hvd_trainer.mxnet", "mxnet", installs.MXNET),
    ("hvd_trainer.tensorflow", "tensorflow", installs.TENSORFLOW),
    ("hvd_trainer.keras", "tensorflow", installs.TENSORFLOW)])
def test_an_adapter_without_its_framework_says_how_to_add_it(adapter, module, piece):
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            f"try:\n    import {adapter}\nexcept ImportError as error:\n"
            "    print(type(error).__name__, error.name, '|', error)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    adapter_name = "hvd_trainer.tensorflow" if adapter == "hvd_trainer.keras" else adapter
    assert proc.stdout.startswith(
        f"ModuleNotFoundError {module} | {adapter_name} needs {piece.name}, which cannot be "
        f"imported here (import of {module} halted; None in sys.modules); add it with: "
        f"{piece.command}"), proc.stdout + proc.stderr


def test_the_mpi_backend_without_mpi4py_says_how_to_add_it():
    code = ("import sys; sys.modules['mpi4py'] = None\nimport hvd_trainer\n"
            "try:\n    hvd_trainer.init()\nexcept RuntimeError as error:\n    print(error)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, HVD_BACKEND="mpi"))
    assert "mpi4py cannot be imported" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith(f"add it with: {installs.MPI4PY.command}")
