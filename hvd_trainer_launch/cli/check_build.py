"""``hvdrun --check-build``: report the MPI, launcher, frameworks and optional pieces this
installation would use, and the command that adds each one that is missing.

Each line is best effort: a missing or broken optional library is reported, never raised.
The commands come from hvd_trainer_launch.installs, which the ranks' own error messages use too.
"""
import importlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import List, NamedTuple, Optional

from hvd_trainer_launch import installs, mpi

# Where distributions put sshd when /usr/sbin is not on PATH (a non-root user's PATH).
_SSHD_FOLDERS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class Line(NamedTuple):
    """One line of the report: what was looked for, what was found (None: nothing usable) and
    why it is missing when it is."""

    label: str
    found: Optional[str]
    piece: Optional[installs.Piece] = None
    why: str = ""


def _module_version(module_name: str) -> Line:
    """A module's version; or, when it does not import, why not (an ImportError: missing)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        return Line(module_name, None, why=str(error))
    except Exception as error:  # e.g. MXNet failing to load its shared library
        return Line(module_name, f"installed but fails to import ({type(error).__name__}: "
                                 f"{error})")
    return Line(module_name, getattr(module, "__version__", "unknown version"))


def _framework(label: str, module_name: str, piece: installs.Piece) -> Line:
    """The line of a Python package: its version, or why it is missing and how to add it."""
    found = _module_version(module_name)
    return found._replace(label=label, piece=piece)


def _distribution(name: str) -> Optional[str]:
    """The installed version of distribution ``name`` (read without importing it), or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _keras() -> Line:
    """Which Keras TensorFlow's tf.keras would give: Keras 3, or Keras 2 from tf-keras."""
    keras3, keras2 = _distribution("keras"), _distribution("tf-keras")
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    parts = []
    if keras3:
        parts.append(f"Keras {keras3}{' (tf.keras unless TF_USE_LEGACY_KERAS=1)' if keras2 else ''}")
    if keras2:
        parts.append(f"tf-keras {keras2} (Keras 2; tf.keras when TF_USE_LEGACY_KERAS=1, "
                     f"{'set' if legacy else 'not set'} here)")
    if not parts:
        return Line("Keras", None, installs.TENSORFLOW, "comes with TensorFlow")
    if not keras2:
        # Horovod scripts written for Keras 2 (e.g. opt.variables()) need it.
        return Line("Keras", "; ".join(parts), installs.KERAS2, "for Keras 2 scripts")
    return Line("Keras", "; ".join(parts))


def _run_first_line(command: List[str]) -> Optional[str]:
    """The first non-empty line ``command`` prints, or None when it cannot run."""
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in result.stdout.decode(errors="replace").splitlines()
             if line.strip()]
    return lines[0] if lines else ""


def _launchers() -> List[Line]:
    """Each MPI's launchers found next to mpi4py's library, in this environment and on PATH,
    with the version each prints; a line for an MPI none of them belongs to."""
    _, library_folders = mpi.mpi_library()
    found = {mpi.HYDRA: [], mpi.OPENMPI: []}
    for folder in mpi.candidate_folders(library_folders):
        for name in ("mpiexec", "mpirun"):
            path = os.path.realpath(os.path.join(folder, name))
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                continue
            text = mpi.version_text(path)
            flavour = mpi.flavour_in(text)
            if flavour is not None and path not in [p for p, _ in found[flavour]]:
                found[flavour].append((path, _version_of(text)))
    lines = []
    for flavour, label, piece in ((mpi.HYDRA, "MPICH (Hydra)", installs.MPICH),
                                  (mpi.OPENMPI, "Open MPI", installs.OPENMPI)):
        paths = found[flavour]
        lines.append(Line(label, "; ".join(f"{version} ({path})" for path, version in paths)
                          if paths else None, piece))
    return lines


def _version_of(text: str) -> str:
    """The version in an mpiexec's --version text: Hydra's 'Version:' line, Open MPI's first."""
    for line in text.splitlines():
        if line.strip().startswith("Version:"):
            return "version " + line.split(":", 1)[1].strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first or "unknown version"


def _nccl() -> Line:
    """CuPy's version and NCCL's, which the GPU backend uses."""
    cupy = _module_version("cupy")
    if cupy.found is None or not cupy.found[:1].isdigit():
        return cupy._replace(label="CuPy/NCCL", piece=installs.CUPY, found=cupy.found and
                             f"CuPy {cupy.found}")
    try:
        from cupy.cuda import nccl
        return Line("CuPy/NCCL", f"CuPy {cupy.found}, NCCL {nccl.get_version()}")
    except Exception as error:  # CuPy without NCCL, or no CUDA driver
        return Line("CuPy/NCCL", None, installs.NCCL,
                    f"CuPy {cupy.found} is, NCCL is not usable: {type(error).__name__}: {error}")


def _program(label: str, name: str, piece: installs.Piece, version_flag: str = "--version",
             folders: tuple = ()) -> Line:
    """A program on PATH (or in ``folders``) and the first line of its version text."""
    path = shutil.which(name) or next(
        (os.path.join(f, name) for f in folders if os.access(os.path.join(f, name), os.X_OK)),
        None)
    if path is None:
        return Line(label, None, piece, f"no {name} on PATH")
    version = _run_first_line([path, version_flag])
    return Line(label, f"{version} ({path})" if version else path)


def _spark() -> List[Line]:
    """pyspark, and the Java it runs on."""
    return [_framework("pyspark", "pyspark", installs.PYSPARK),
            _program("Java", "java", installs.JAVA, "-version")]


def report_lines(requested_mpiexec: Optional[str] = None) -> List[Line]:
    """Every line of the report, in order."""
    hvd_version = _distribution("hvd_trainer") or "not installed as a package (a source tree)"
    library, _ = mpi.mpi_library()
    if library:  # Open MPI ends its version text with a NUL
        library_line = Line("MPI library", " ".join(
            library.replace("\0", "").splitlines()[0].split()))
    else:
        library_line = Line("MPI library", None, installs.MPI4PY, "mpi4py or libmpi missing")
    try:
        launcher = mpi.find_launcher(requested_mpiexec)
        launcher_line = Line("mpiexec", f"{launcher.path} ({mpi.FLAVOUR_NAMES[launcher.flavour]})")
    except mpi.MPIError as error:
        launcher_line = Line("mpiexec", None, why=f"{error}")
    mpi4py = _framework("mpi4py", "mpi4py", installs.MPI4PY)
    return [Line("hvd_trainer", hvd_version),
            Line("Python", f"{platform.python_version()} ({sys.executable})"),
            library_line, mpi4py, launcher_line, *_launchers(),
            _framework("numpy", "numpy", installs.Piece("numpy", "pip install numpy")),
            _framework("MXNet", "mxnet", installs.MXNET),
            _framework("PyTorch", "torch", installs.PYTORCH),
            _framework("TensorFlow", "tensorflow", installs.TENSORFLOW), _keras(),
            _nccl(), *_spark(), _framework("Ray", "ray", installs.RAY),
            _program("Slurm srun", "srun", installs.SLURM),
            _program("sshd", "sshd", installs.SSHD, "-V", _SSHD_FOLDERS),
            _program("ssh", "ssh", installs.SSH, "-V")]


def format_line(line: Line) -> str:
    """``label: what was found``, or ``label: not found (why); add it with: command``; a found
    line with a missing piece beside it (e.g. Keras 3 without Keras 2) names that piece too."""
    head = f"{line.label + ':':<16}"
    if line.found is not None:
        if line.piece is None or not line.why:
            return head + line.found
        return f"{head}{line.found}; {line.why}, add {line.piece.name} with: {line.piece.command}"
    why = f" ({line.why})" if line.why else ""
    fix = f"; add it with: {line.piece.command}" if line.piece is not None else ""
    return f"{head}not found{why}{fix}"


def check_build(requested_mpiexec: Optional[str] = None) -> int:
    """Print the report; return 0 if an MPI launcher was found, else 1."""
    lines = report_lines(requested_mpiexec)
    for line in lines:
        print(format_line(line))
    return 0 if next(line for line in lines if line.label == "mpiexec").found else 1
