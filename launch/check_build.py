"""``hvdrun --check-build``: report the MPI, launcher and libraries this installation would use.

Each line is best effort: a missing or broken optional library is reported, never raised.
"""
import importlib
import platform
import sys
from importlib import metadata
from typing import Optional

from hvd_trainer_launch import mpi


def _version(module_name: str) -> str:
    """The version of an importable module, or why it cannot be used."""
    try:
        return getattr(importlib.import_module(module_name), "__version__", "unknown version")
    except ImportError:
        return "not installed"
    except Exception as error:  # e.g. MXNet failing to load its shared library
        return f"installed but fails to import ({type(error).__name__}: {error})"


def _nccl() -> str:
    """CuPy's version and NCCL's, which the GPU backend uses."""
    cupy = _version("cupy")
    if not cupy[:1].isdigit():
        return f"CuPy {cupy}"
    try:
        from cupy.cuda import nccl
        return f"CuPy {cupy}, NCCL {nccl.get_version()}"
    except Exception as error:  # CuPy without NCCL, or no CUDA driver
        return f"CuPy {cupy}, NCCL not available ({type(error).__name__}: {error})"


def check_build(requested_mpiexec: Optional[str] = None) -> int:
    """Print the report; return 0 if an MPI launcher was found, else 1."""
    try:
        hvd_version = metadata.version("hvd_trainer")
    except metadata.PackageNotFoundError:
        hvd_version = "not installed as a package (running from a source tree)"
    library, _ = mpi.mpi_library()
    if library:  # Open MPI ends its version text with a NUL
        library_line = " ".join(library.replace("\0", "").splitlines()[0].split())
    else:
        library_line = "not found (mpi4py or libmpi missing)"
    try:
        launcher = mpi.find_launcher(requested_mpiexec)
        launcher_line = f"{launcher.path} ({mpi.FLAVOUR_NAMES[launcher.flavour]})"
    except mpi.MPIError as error:
        launcher, launcher_line = None, f"not found: {error}"
    print(f"hvd_trainer:  {hvd_version}")
    print(f"Python:       {platform.python_version()} ({sys.executable})")
    print(f"MPI library:  {library_line}")
    print(f"mpi4py:       {_version('mpi4py')}")
    print(f"mpiexec:      {launcher_line}")
    print(f"NCCL:         {_nccl()}")
    print(f"MXNet:        {_version('mxnet')}")
    print(f"numpy:        {_version('numpy')}")
    return 0 if launcher is not None else 1
