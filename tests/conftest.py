"""Skip, with the reason, the tests whose framework is not installed in this environment.

MXNet 1.9.1 needs NumPy 1, TensorFlow 2.21 NumPy 2: they live in different environments (see
the README), and ``python -m pytest tests`` in either skips the other's tests. A test module
that imports a framework (or hvd_trainer's adapter for it) is skipped whole; a multi-rank
test is skipped when the worker scripts it names (in its function, or else in its module)
import one.
"""
import importlib.util
import inspect
import os
import re
import sys

import pytest

import session_shm
from hvd_trainer_launch.files import open_mpi_sessions

# Under pytest-xdist (the README runs ``-n 2``) this conftest is loaded by the controlling
# process and by each worker it starts; the workers are its children, so they share the /dev/shm
# it makes private, and it checks the session's leftovers once all of them have ended.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# Before pytest starts a thread: this session's own /dev/shm (None once made), checked at the end.
_SHM_NOT_PRIVATE = (session_shm.make_private() if _XDIST_WORKER is None
                    else "checked by the controlling process")

# The README installs with pip's --no-compile (byte-compiling all of torch, MXNet, Ray and
# TensorFlow took about a minute per environment on 2 cores), so modules are compiled as
# they are first imported, and the compiled code must be kept: with PYTHONDONTWRITEBYTECODE
# set (as in many containers) this process and every rank would compile torch anew, seconds
# each. So this process writes it, and so do the jobs it starts.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

_FRAMEWORKS = ("mxnet", "torch", "tensorflow", "keras")
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:hvd_trainer\.)?(mxnet|torch|tensorflow|keras)\b",
                     re.M)
_WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel", "workers")
_WORKER = re.compile(r"[\"']([A-Za-z0-9_]+\.py)[\"']")
_ENVIRONMENT = {"tensorflow": "the [test-tensorflow] environment (.venv-tf)",
                "keras": "the [test-tensorflow] environment (.venv-tf)"}


def _missing(source: str) -> list:
    needed = sorted(set(_IMPORT.findall(source)))
    return [name for name in needed if importlib.util.find_spec(name) is None]


def _reason(missing: list) -> str:
    where = _ENVIRONMENT.get(missing[0], "the [test] environment (.venv)")
    return f"{', '.join(missing)} not installed here; these tests run in {where}, see the README"


class _SkippedModule(pytest.Module):
    """A test module whose framework is missing: collected as one skip."""

    reason = ""

    def collect(self):
        pytest.skip(self.reason, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if not module_path.name.startswith("test_"):
        return None
    missing = _missing(module_path.read_text())
    if not missing:
        return None
    module = _SkippedModule.from_parent(parent, path=module_path)
    module.reason = _reason(missing)
    return module


def _worker_sources(text: str) -> str:
    paths = [os.path.join(_WORKERS, n) for n in _WORKER.findall(text)]
    return "".join(open(p).read() for p in paths if os.path.isfile(p))


_FOLDER_MARKS = {"parallel": pytest.mark.parallel, "gpu": pytest.mark.gpu,
                 "multihost": pytest.mark.multihost, "engines": pytest.mark.engines}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark each test by its folder (markers registered in pyproject.toml), so ``-m`` selects them:
    ``-m "not parallel and not multihost and not engines"`` runs the one-process tests alone."""
    for item in items:
        mark = _FOLDER_MARKS.get(item.path.parent.name)
        if mark is not None:
            item.add_marker(mark)
        if not hasattr(item, "function") or "parallel" not in str(item.path):
            continue
        workers = _worker_sources(inspect.getsource(item.function))
        missing = _missing(workers or _worker_sources(item.path.read_text()))
        if missing:
            item.add_marker(pytest.mark.skip(reason=_reason(missing)))


# pytest-xdist's units of work (the README runs ``-n 2``), by the start of a test's id: the tests
# that start Ray or Spark clusters, engine agents or the multi-host test bed mostly wait on them
# and share them, so they run one after another in one worker while the others take the
# CPU-bound multi-rank jobs; the modules of one shared job (tests/parallel/runner.py's TORCH_JOB
# and MXNET_JOB, tests/gpu/gpu.py's jobs) are one unit; any other module is one unit, its cases
# sharing its jobs, but for test_tf.py: its Keras training jobs (the tests that share
# KERAS3_JOB and KERAS2_JOB, and the Keras 2 one the script imports) are a unit apart from its
# collectives, stall and example jobs, since the module alone (177 s on 2026-12-07) was the
# TensorFlow pass's longest unit.
_UNITS = {
    "tests/engines/": "clusters", "tests/multihost/": "clusters",
    "tests/parallel/test_engine_agents.py": "clusters",
    "tests/parallel/test_elastic_engine_job.py": "clusters",
    "tests/gpu/": "gpu",
    **dict.fromkeys(("tests/parallel/test_tf.py::test_training_matches",
                     "tests/parallel/test_tf.py::test_sync_batch_normalization",
                     "tests/parallel/test_tf.py::test_keras2_"), "tf keras jobs"),
    **dict.fromkeys(("tests/parallel/test_torch_ops.py", "tests/parallel/test_torch_optimizer.py",
                     "tests/parallel/test_torch_sparse_optimizer.py"), "torch job"),
    **dict.fromkeys(("tests/parallel/test_mxnet_ops.py", "tests/parallel/test_sparse_training.py",
                     "tests/parallel/test_sparse_weights.py"), "mxnet job"),
}


def unit_of(nodeid: str) -> str:
    """The unit of work of the test ``nodeid`` under pytest-xdist."""
    return next((unit for start, unit in _UNITS.items() if nodeid.startswith(start)),
                nodeid.split("::")[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``-n`` and no ``--dist``, schedule by :func:`unit_of` (xdist's own schedulers by
    scope group by a scope they read from the id; this one by the unit)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Units(config, log)


@pytest.fixture(autouse=True)
def no_stale_open_mpi_sessions():
    """Before each test, the session folders of Open MPI launchers that were killed earlier
    are removed (hvdrun does so before it launches, but tests start mpirun themselves too): a
    launcher that gets a dead one's PID fails on them."""
    open_mpi_sessions.sweep()


_shm_left: list = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the session when its runs left anything in its own /dev/shm (tests/session_shm.py).
    A worker's own MPI singleton (a test imported mpi4py) is finalized first: pytest-xdist ends
    its workers without the exit handlers that would remove its segment."""
    mpi = sys.modules.get("mpi4py.MPI")
    if _XDIST_WORKER is not None and mpi is not None and mpi.Is_initialized() \
            and not mpi.Is_finalized():
        mpi.Finalize()
    if _SHM_NOT_PRIVATE is None:
        _shm_left.extend(session_shm.leftovers())
        if _shm_left:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _XDIST_WORKER is not None:
        return
    if _SHM_NOT_PRIVATE is not None:
        terminalreporter.write_line(f"/dev/shm left behind: not checked ({_SHM_NOT_PRIVATE})")
    elif _shm_left:
        terminalreporter.write_line(f"FAILED: the session's runs left {len(_shm_left)} entries "
                                    f"in /dev/shm: {', '.join(_shm_left)}", red=True)
