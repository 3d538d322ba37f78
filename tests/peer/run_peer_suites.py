"""Run Horovod's own test suites, unmodified, against hvd_trainer's adapters, and count results.

The suites are read at run time from a local Horovod git mirror (nothing of Horovod's lives in
this repository) and exported with the helper modules they import into a temporary folder,
next to the ``horovod`` shim of ``hvdrun --horovod`` (hvd_trainer_launch/rank/horovod_shim.py: its modules
re-export ``hvd_trainer.torch``, ``hvd_trainer.mxnet``, ``hvd_trainer.tensorflow`` and its Keras
modules) with the test-only modules of Horovod's that the suites import added to it. Each suite
runs as one job for the whole file, as Horovod's CI runs it: ``hvdrun --horovod -np N python -m
pytest -v <suite>.py`` (hvdrun finds the harness's shim on PYTHONPATH and uses it). A small pytest plugin, also generated, writes
every rank's results to its own file as they happen, so a job that hangs or dies still says
which tests passed, failed, or were running at the end.

    python tests/peer/run_peer_suites.py [--horovod MIRROR] \
        --suite test_torch.py --np 2 [--only SUBSTRING] [--alone] [--mpi openmpi]

The mirror defaults to ``$HVD_HOROVOD_MIRROR``, else DEFAULT_MIRROR.

TensorFlow's suites (TF_SUITES) run in the TensorFlow environment: ``--venv .venv-tf
--suite test_tensorflow.py --suite test_tensorflow2_keras.py``. The jobs inherit this
process's environment: ``TF_USE_LEGACY_KERAS=1 python tests/peer/run_peer_suites.py ...``
runs them with Keras 2 as ``tf.keras`` (tf-keras installed).

Horovod's Ray suite (ENGINE_SUITES: test/single/test_ray.py) is one pytest process too, whose
tests start Ray clusters and RayExecutor jobs (``--suite test_ray.py``, which also needs
grpcio for Ray's client helpers). It gates its executor tests on ``gloo_built()``, Horovod's
rendezvous for Ray; hvd_trainer's Ray engine needs none, so the harness's test-only
``horovod.common.util.gloo_built`` opens that gate for this suite (and says so);
``hvd_trainer.gloo_built()`` itself stays False. Its fixtures pass ``ray.init`` a keyword
(``_redis_max_memory``) that Ray 2.60 removed; a generated plugin drops it. Horovod's internals that the suite imports
(``Coordinator``, ``MiniSettings``, ``create_placement_group``, ``BaseHorovodWorker``) are
stand-ins that raise NotImplementedError: their tests fail, as they should.

Horovod's Spark suite (ENGINE_SUITES: test/integration/test_spark.py) is one pytest process
whose tests build their own Spark sessions and call ``horovod.spark.run`` (``--suite
test_spark.py``). It imports many of Horovod's Spark and runner internals at its top (stores,
driver and task services, codecs): SPARK_STAND_INS are classes and functions that raise
NotImplementedError when used, so those tests fail, as they should. It gates its MPI tests on
``is_open_mpi()``, since Horovod's Spark mode runs under Open MPI only; hvd_trainer's runs
under MPICH too, so the harness's ``horovod.runner.mpi_run.is_open_mpi`` opens that gate for
this suite (and says so). Its Gloo tests stay skipped (``gloo_built()`` is False).

Horovod's elastic scenarios (ELASTIC_SUITES, test/integration) are single-process pytest files
whose tests each launch a job: they run as ``python -m pytest -v <suite>.py`` (no hvdrun
around pytest), and the shim's ``horovod.runner.launch._run_elastic`` runs each job with
hvdrun in elastic mode (``--suite test_elastic_torch.py``).
"""
import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

from hvd_trainer_launch.rank import horovod_shim

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A local git mirror of github.com/horovod/horovod, and the variable that names another.
MIRROR_VARIABLE = "HVD_HOROVOD_MIRROR"
DEFAULT_MIRROR = "/work/.mirror/horovod+horovod/repo"
DEFAULT_TAG = "v0.28.1"
DEFAULT_SUITES = ("test_torch.py", "test_mxnet1.py", "test_adasum_pytorch.py")
# TensorFlow needs NumPy 2, MXNet NumPy 1: these run in the [test-tensorflow] environment.
TF_SUITES = ("test_tensorflow.py", "test_tensorflow2_keras.py")
# test/integration's elastic scenarios: one pytest process, each test runs hvdrun jobs of the
# training script named here (exported with the suite).
ELASTIC_SUITES = {"test_elastic_torch.py": "test/integration/data/elastic_torch_main.py",
                  "test_elastic_tensorflow2.py":
                      "test/integration/data/elastic_tensorflow2_main.py"}
# Engine suites: single-process pytest files whose tests start the clusters, and their folders.
ENGINE_SUITES = {"test_ray.py": "test/single", "test_ray_elastic.py": "test/single",
                 "test_spark.py": "test/integration"}
# The Spark estimator suites (test/integration, one process each) and the stand-ins for the
# Horovod internals they import: tests/peer/estimator_standins.py.
_standins_spec = importlib.util.spec_from_file_location(
    "estimator_standins", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       "estimator_standins.py"))
estimator_standins = importlib.util.module_from_spec(_standins_spec)
_standins_spec.loader.exec_module(estimator_standins)
ESTIMATOR_SUITES = estimator_standins.ESTIMATOR_SUITES
# Single-process suites: pytest alone, no hvdrun around it.
ONE_PROCESS_SUITES = (*ELASTIC_SUITES, *ENGINE_SUITES, *ESTIMATOR_SUITES)
# What the suites' own imports need beyond pytest, by suite (the default: test/utils/common.py's).
SUITE_MODULES = {"test_tensorflow2_keras.py": ("parameterized",),
                 "test_ray.py": ("ray", "torch", "grpc"),
                 "test_ray_elastic.py": ("ray", "torch", "psutil"),
                 "test_spark.py": ("pyspark", "psutil", "torch"),
                 **{suite: ("psutil",) for suite in ELASTIC_SUITES},
                 **estimator_standins.SUITE_MODULES}
# Environment by suite. test_tensorflow.py runs each test in a TF1 graph too, where one
# session.run starts up to 21 independent collectives; hvd_trainer's block a session thread
# each while they wait for the other ranks, so the session needs that many threads (the
# TensorFlow limitations in docs/limitations.md), more than this machine's cores give by default.
# More pytest plugins (from the shim folder) by suite.
SUITE_PLUGINS = {"test_ray.py": ("peer_ray_compat",)}
SUITE_ENV = {"test_tensorflow.py": {"TF_NUM_INTEROP_THREADS": "32"},
             "test_ray.py": {"PEER_OPEN_GLOO_GATE": "1"},
             "test_ray_elastic.py": {"PEER_OPEN_GLOO_GATE": "1"},
             "test_spark.py": {"PEER_OPEN_MPI_GATE": "1"}}
HELPER_MODULES = ("cloudpickle", "mock", "packaging")
# Folders of Horovod's tree whose modules the suites import by bare name (sys.path additions).
HELPER_FOLDERS = ("test/parallel", "test/integration", "test/utils")
# Horovod's own modules that the shim takes as they are, read from the mirror at run time.
HOROVOD_MODULES = ("horovod/runner/elastic/constants.py",)

# Test-only modules of Horovod's that the suites import, layered on hvdrun --horovod's shim
# (hvd_trainer_launch/rank/horovod_shim.py, which holds the public modules a user's script imports).
SHIM_MODULES = {
    "horovod/common/__init__.py": "",
    # test_tensorflow2_keras.py compares TensorFlow versions with this helper.
    "horovod/common/util.py": '''"""Generated shim: the helpers the TensorFlow and Ray suites import."""
import os

from packaging import version


def is_version_greater_equal_than(ver, target):
    """Whether version string ``ver`` is ``target`` or later."""
    return version.parse(ver) >= version.parse(target)


def gloo_built():
    """hvd_trainer's answer, except where the harness opens the Ray suite's gate (Horovod's
    Ray tests need Gloo for its rendezvous, which hvd_trainer's Ray engine does not use)."""
    import hvd_trainer
    return os.environ.get("PEER_OPEN_GLOO_GATE") == "1" or hvd_trainer.gloo_built()


def mpi_built():
    """hvd_trainer's answer (the Spark suites import it)."""
    import hvd_trainer
    return hvd_trainer.mpi_built()
''',
    # test_ray.py imports Horovod's internals beside RayExecutor: stand-ins that say so.
    "horovod/ray/runner.py": '''"""Generated shim: RayExecutor, and stand-ins for Horovod's internals."""
from hvd_trainer.ray import RayExecutor  # noqa: F401


class _Internal:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is Horovod's internal class; "
                                  "hvd_trainer's RayExecutor has none")


class Coordinator(_Internal):
    pass


class MiniSettings(_Internal):
    pass
''',
    "horovod/ray/strategy.py": '''"""Generated shim: a stand-in for Horovod's internal helper."""


def create_placement_group(*args, **kwargs):
    raise NotImplementedError("create_placement_group is Horovod's internal helper; "
                              "hvd_trainer's RayExecutor has none")
''',
    "horovod/ray/worker.py": '''"""Generated shim: a stand-in for Horovod's internal worker class."""


class BaseHorovodWorker:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("BaseHorovodWorker is Horovod's internal class; "
                                  "hvd_trainer's Ray agents are not user classes")
''',
    # test_ray.py's fixtures pass ray.init a keyword that Ray 2.60 no longer takes.
    "peer_ray_compat.py": '''"""Generated pytest plugin: ray.init without _redis_max_memory (gone in Ray 2.60)."""
import ray

_init = ray.init


def _init_without_redis(*args, _redis_max_memory=None, **kwargs):
    return _init(*args, **kwargs)


ray.init = _init_without_redis
''',
    # test_spark.py gates its MPI tests on Open MPI, which Horovod's Spark mode needs.
    "horovod/runner/mpi_run.py": '''"""Generated shim: the gate of test_spark.py's MPI tests."""
import os


def is_open_mpi(*args, **kwargs):
    """Horovod runs Spark's MPI mode under Open MPI only (mpirun's rsh agent); hvd_trainer's
    Spark engine runs under MPICH too, so the harness opens the gate for test_spark.py
    (PEER_OPEN_MPI_GATE); otherwise whether hvd_trainer's MPI is Open MPI."""
    if os.environ.get("PEER_OPEN_MPI_GATE") == "1":
        return True
    from hvd_trainer_launch import mpi
    return mpi.find_launcher().flavour == mpi.OPENMPI
''',
    "horovod/runner/util/__init__.py": "",
    # test/utils/common.py imports in_thread at module level (for its delay() helper).
    "horovod/runner/util/threads.py": '''"""Generated shim: the thread helper test/utils/common.py imports."""
import threading


def in_thread(target, args=(), name=None, daemon=True):
    """Start ``target(*args)`` in a new thread and return the thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
''',
    # The elastic scenarios (test/integration/elastic_common.py) build a horovodrun command
    # line, parse it, and run it with _run_elastic: here hvdrun runs it.
    "horovod/runner/launch.py": '''"""Generated shim: horovodrun's parse_args and _run_elastic, over hvdrun."""
import subprocess
import sys

from hvd_trainer_launch.cli import hvdrun

from horovod.common.util import gloo_built, mpi_built  # noqa: F401 (test_spark.py patches them)
from horovod.runner.elastic import constants, driver

# What Horovod's suites match when a job fails; hvdrun's own messages say which rank and why.
FAILED = ("Horovod detected that one or more processes exited with non-zero status "
          "(hvdrun exited with code {code}; its messages above name the rank)")
# hvdrun's message when --reset-limit ends the job.
OVER_LIMIT = b"hvdrun: elastic: the job needs restart "


def parse_args():
    """sys.argv[1:], a horovodrun command line, parsed by hvdrun (which takes its flags)."""
    args = hvdrun.parse_arguments(hvdrun.build_parser(), sys.argv[1:])
    args.argv = sys.argv[1:]
    return args


def _run_elastic(args):
    """Run the job with hvdrun; RuntimeError when it fails (Horovod's reset-limit message
    when hvdrun says --reset-limit ended it). Without --elastic-timeout, hvdrun gets
    driver.ELASTIC_TIMEOUT_SECS (which the suites patch), as Horovod's driver uses it."""
    argv = ["--horovod"] + list(args.argv)
    if args.elastic_timeout is None:
        argv = ["--elastic-timeout", str(driver.ELASTIC_TIMEOUT_SECS)] + argv
    proc = subprocess.Popen([sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", *argv],
                            stderr=subprocess.PIPE)
    over_limit = False
    for line in proc.stderr:
        over_limit = over_limit or line.startswith(OVER_LIMIT)
        sys.stderr.write(line.decode(errors="replace"))
    code = proc.wait()
    if code and over_limit:
        raise RuntimeError(constants.RESET_LIMIT_EXCEEDED_MESSAGE.format(args.reset_limit))
    if code:
        raise RuntimeError(FAILED.format(code=code))
''',
    "horovod/runner/elastic/__init__.py": "",
    # Patched by the suites. hvdrun runs discovery every second (no flag changes that), and
    # reads the elastic timeout from --elastic-timeout, which launch._run_elastic passes. The
    # discovery's pace, patched, is ElasticRayExecutor's (its DISCOVERY_SECONDS), as Horovod's
    # elastic Ray driver takes it from this module.
    "horovod/runner/elastic/driver.py": '''"""Generated shim: the driver settings the suites patch."""
import sys
import types

from hvd_trainer_launch.elastic.driver import DEFAULT_ELASTIC_TIMEOUT
from hvd_trainer_launch.engines import ray_elastic

ELASTIC_TIMEOUT_SECS = DEFAULT_ELASTIC_TIMEOUT
_PACE = ray_elastic.DISCOVERY_SECONDS


class _Driver(types.ModuleType):
    """This module, whose DISCOVER_HOSTS_FREQUENCY_SECS is ElasticRayExecutor's pace (mock's
    patch deletes it at the end: the pace is then the default again)."""

    @property
    def DISCOVER_HOSTS_FREQUENCY_SECS(self):
        return ray_elastic.DISCOVERY_SECONDS

    @DISCOVER_HOSTS_FREQUENCY_SECS.setter
    def DISCOVER_HOSTS_FREQUENCY_SECS(self, seconds):
        ray_elastic.DISCOVERY_SECONDS = seconds

    @DISCOVER_HOSTS_FREQUENCY_SECS.deleter
    def DISCOVER_HOSTS_FREQUENCY_SECS(self):
        ray_elastic.DISCOVERY_SECONDS = _PACE


sys.modules[__name__].__class__ = _Driver
''',
    # test_ray_elastic.py's discovery subclasses Horovod's interface, and the suite patches
    # the driver's address helper (hvdrun finds its own).
    "horovod/runner/elastic/discovery.py": '''"""Generated shim: Horovod's host discovery interface."""


class HostDiscovery:
    """What ElasticRayExecutor's settings.discovery offers: the hosts and their slots now."""

    def find_available_hosts_and_slots(self):
        raise NotImplementedError("a discovery returns {host: slots}")
''',
    "horovod/runner/util/network.py": '''"""Generated shim: the name test_ray_elastic.py patches."""


def get_driver_ip(nics=None):
    """Horovod's driver address for its rendezvous, which hvd_trainer does not use (hvdrun
    picks the address its ranks reach); the suite patches it all the same."""
    raise NotImplementedError("hvdrun picks the driver's address itself")
''',
    "horovod/runner/gloo_run.py": '''"""Generated shim: the name the suites patch."""


def _get_min_start_hosts(settings):
    """Horovod's count of hosts its first start waits for; hvdrun's first life waits for -np
    slots instead, so nothing calls this (the suites patch it all the same)."""
    raise NotImplementedError("hvdrun waits for -np slots, not for a number of hosts")
''',
    "horovod/runner/common/__init__.py": "",
    "horovod/runner/common/util/__init__.py": "",
    "horovod/runner/common/util/config_parser.py":
        '''"""Generated shim: the ranks' variables that horovodrun's flags set."""
from hvd_trainer_launch import mpi
from hvd_trainer_launch.job import flags


def set_env_from_args(env, args):
    """Put into ``env`` the variables that hvdrun sets for the ranks from ``args``."""
    env.update(flags.rank_variables(args, mpi.find_launcher(args.mpiexec).flavour))
    return env
''',
}

# test_spark.py imports these internals of Horovod's at its top (with its helpers): by module,
# the classes and functions it names; each raises NotImplementedError when used.
SPARK_STAND_INS = {
    "horovod/spark/driver/host_discovery.py": (("SparkDriverHostDiscovery",), ()),
    "horovod/spark/driver/rsh.py": ((), ("rsh",)),
    "horovod/spark/runner.py": ((), ("_task_fn",)),
    "horovod/spark/task/gloo_exec_fn.py": ((), ()),
    "horovod/spark/task/mpirun_exec_fn.py": ((), ()),
    **{f"horovod/runner/common/util/{name}.py": ((), ())
       for name in ("codec", "safe_shell_exec", "timeout", "settings")},
}


def stand_in(classes: Sequence[str], functions: Sequence[str]) -> str:
    """The text of a generated module whose ``classes`` and ``functions`` raise
    NotImplementedError when used."""
    text = '"""Generated shim: stand-ins for Horovod\'s internals, which hvd_trainer has not."""\n'
    for name in classes:
        text += (f"\n\nclass {name}:\n    def __init__(self, *args, **kwargs):\n"
                 f"        raise NotImplementedError(\"{name} is Horovod's internal class; "
                 f"hvd_trainer has none\")\n")
    for name in functions:
        text += (f"\n\ndef {name}(*args, **kwargs):\n"
                 f"    raise NotImplementedError(\"{name} is Horovod's internal function; "
                 f"hvd_trainer has none\")\n")
    return text


# Loaded into each rank's pytest with -p: one JSON line per event, flushed at once.
REPORT_PLUGIN = '''"""Generated by run_peer_suites.py: writes this rank's pytest events to PEER_REPORT_DIR."""
import json
import os

_rank = next((os.environ[v] for v in ("HOROVOD_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
              if v in os.environ), "0")
_out = open(os.path.join(os.environ["PEER_REPORT_DIR"], "rank.%s.jsonl" % _rank), "a",
            buffering=1)


def _write(**event):
    _out.write(json.dumps(event) + "\\n")


def pytest_collection_finish(session):
    _write(event="collected", nodeids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    _write(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    # A subtest's report (TensorFlow's suites run each test in graph and in eager mode as
    # subtests) carries its context: "sub" names it.
    context = getattr(report, "context", None)
    _write(event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
           text=report.longreprtext[-4000:] if report.outcome == "failed" else
           (str(report.longrepr[2]) if report.skipped and isinstance(report.longrepr, tuple)
            else ""), sub=None if context is None else str(context.msg or context.kwargs))
'''

_IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_]\w*)\s+import|import\s+([A-Za-z_]\w*))", re.M)


def git_show(mirror: str, tag: str, path: str) -> Optional[bytes]:
    """The bytes of ``path`` at ``tag`` in the mirror, or None when the tag has no such file."""
    proc = subprocess.run(["git", "-C", mirror, "show", f"{tag}:{path}"], capture_output=True)
    return proc.stdout if proc.returncode == 0 else None


def suite_folder(suite: str) -> str:
    """The folder of Horovod's tree that holds ``suite``."""
    if suite in ENGINE_SUITES:
        return ENGINE_SUITES[suite]
    return "test/integration" if suite in (*ELASTIC_SUITES, *ESTIMATOR_SUITES) \
        else "test/parallel"


def export_suites(mirror: str, tag: str, suites: Sequence[str], root: str) -> List[str]:
    """Write each suite, the training script of an elastic one and, transitively, the helper
    modules they import by bare name into ``root`` (Horovod's folder layout kept, so their
    sys.path additions work). Returns the exported paths."""
    required = [f"{suite_folder(suite)}/{suite}" for suite in suites] + [
        ELASTIC_SUITES[suite] for suite in suites if suite in ELASTIC_SUITES]
    exported, queue = [], required + ["test/conftest.py"]
    seen: Set[str] = set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        data = git_show(mirror, tag, path)
        if data is None:
            if path in required:
                raise SystemExit(f"{tag} of {mirror} has no {path}: check --suite and --tag")
            continue
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
        exported.append(path)
        for match in _IMPORT.finditer(data.decode()):
            name = match[1] or match[2]
            queue.extend(f"{folder}/{name}.py" for folder in HELPER_FOLDERS)
    return exported


def write_shim(shim: str) -> None:
    """Write hvdrun --horovod's shim, the test-only modules on it and the report plugin into
    ``shim``."""
    horovod_shim.write(shim)
    stand_ins = {path: stand_in(*names) for path, names in SPARK_STAND_INS.items()}
    for path, text in {**SHIM_MODULES, **stand_ins, **estimator_standins.STANDIN_MODULES,
                       "peer_report.py": REPORT_PLUGIN}.items():
        target = os.path.join(shim, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(text)


def export_horovod_modules(mirror: str, tag: str, shim: str) -> None:
    """Write HOROVOD_MODULES, as the mirror has them at ``tag``, into the shim package."""
    for path in HOROVOD_MODULES:
        data = git_show(mirror, tag, path)
        if data is None:
            raise SystemExit(f"{tag} of {mirror} has no {path}: check --tag")
        with open(os.path.join(shim, path), "wb") as f:
            f.write(data)


def _pids_with(token: str) -> List[int]:
    """Processes of ours whose environment carries ``token`` (a job's report folder)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def end_job(proc: subprocess.Popen, token: str) -> None:
    """End a job that ran past its time: hvdrun's group first, then any rank still alive."""
    for signum, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in _pids_with(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_job(venv: str, np: int, workdir: str, shim: str, targets: Sequence[str],
            pytest_args: Sequence[str], timeout: float, log: str) -> Tuple[str, float, str]:
    """Run one hvdrun job of pytest on ``targets`` (an elastic suite: pytest alone, whose
    tests run the jobs); returns (how it ended, seconds, report dir)."""
    reports = tempfile.mkdtemp(prefix="reports.", dir=os.path.dirname(log))
    suite = targets[0].split("::")[0]
    # test/integration's suites import test/utils' modules by the path test/conftest.py adds:
    # pytest loads that conftest only when its search for them reaches test/.
    launch, conftest = (([], ["--confcutdir", os.path.dirname(workdir)])
                        if suite in ONE_PROCESS_SUITES
                        else ([os.path.join(venv, "bin", "hvdrun"), "--horovod", "-np", str(np)],
                              []))
    plugins = [arg for name in SUITE_PLUGINS.get(suite, ()) for arg in ("-p", name)]
    cmd = [*launch, os.path.join(venv, "bin", "python"), "-m", "pytest", "-v", "-p", "peer_report",
           *plugins, *conftest, *pytest_args, *targets]
    # The estimator suites' models are classes of the suite's module, which the ranks (Spark
    # tasks' children, with this environment) unpickle by importing it.
    suite_path = [workdir] if suite in ESTIMATOR_SUITES else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [shim] + suite_path + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                               else [])),
        PEER_REPORT_DIR=reports, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
        **SUITE_ENV.get(suite, {}))
    if suite in ONE_PROCESS_SUITES:  # their jobs start "python": this environment's
        env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), os.environ.get("PATH", "")])
    start = time.monotonic()
    with open(log, "wb") as out:
        out.write((" ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
            ended = f"exit {code}"
        except subprocess.TimeoutExpired:
            end_job(proc, reports)
            ended = f"timeout after {timeout:.0f} s"
    return ended, time.monotonic() - start, reports


def read_reports(reports: str, np: int) -> Dict[int, Dict[str, Tuple[str, str]]]:
    """Per rank, each test's result: passed, failed, error (setup or teardown failed),
    skipped, unfinished (started, no result before the job ended) or not run (collected,
    never started); with its text. A test with subtests has a result per subtest instead,
    as ``nodeid [subtest]`` (and its own only when it failed outside them)."""
    ranks = {}
    for rank in range(np):
        results: Dict[str, Tuple[str, str]] = {}
        path = os.path.join(reports, f"rank.{rank}.jsonl")
        events = []
        if os.path.exists(path):
            with open(path) as f:
                events = [json.loads(line) for line in f if line.endswith("\n")]
        with_subtests = set()
        for event in events:
            nodeid = event.get("nodeid")
            if event.get("sub") is not None:
                with_subtests.add(nodeid)
                nodeid = f"{nodeid} [{event['sub']}]"
            if event["event"] == "collected":
                results.update((n, ("not run", "")) for n in event["nodeids"])
            elif event["event"] == "start":
                results[nodeid] = ("unfinished", "")
            elif event["event"] == "report":
                before = results.get(nodeid, ("unfinished", ""))[0]
                if event["outcome"] == "failed" and before not in ("failed", "error"):
                    kind = "failed" if event["when"] == "call" else "error"
                    results[nodeid] = (kind, event["text"])
                elif event["outcome"] == "skipped":
                    results[nodeid] = ("skipped", event["text"])
                elif event["outcome"] == "passed" and event["when"] == "call":
                    results[nodeid] = ("passed", "")
        for nodeid in with_subtests:
            if results.get(nodeid, ("passed", ""))[0] == "passed":
                results.pop(nodeid, None)
        ranks[rank] = results
    return ranks


def short(nodeid: str) -> str:
    """A test's name without its file and class."""
    return nodeid.rsplit("::", 1)[-1]


def parent(nodeid: str) -> str:
    """The pytest node id of a result (a subtest's test)."""
    return nodeid.split(" [", 1)[0]


def summarize(ranks: Dict[int, Dict[str, Tuple[str, str]]]) -> dict:
    """Counts on rank 0 and the failing tests on rank 0 and on any rank."""
    zero = ranks.get(0, {})
    counts = {kind: sum(1 for r, _ in zero.values() if r == kind)
              for kind in ("passed", "failed", "error", "skipped", "unfinished", "not run")}
    bad = ("failed", "error", "unfinished")
    failing: Dict[str, List[int]] = {}
    for rank, results in sorted(ranks.items()):
        for nodeid, (result, _) in results.items():
            if result in bad:
                failing.setdefault(nodeid, []).append(rank)
    return {"counts": counts, "failing": failing,
            "rank0_failing": [n for n, (r, _) in zero.items() if r in bad]}


def first_error_line(text: str) -> str:
    """The last 'E   ' line of a pytest failure: usually the exception and its message."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def run_alone(venv: str, np: int, work: str, shim: str, nodeid: str, timeout: float) -> dict:
    """Run one test as a job of its own; its result on every rank and its first error."""
    log = os.path.join(work, f"alone.{short(parent(nodeid))}.np{np}.log")
    folder = suite_folder(parent(nodeid).split("::")[0])
    ended, seconds, reports = run_job(venv, np, os.path.join(work, folder), shim,
                                      [parent(nodeid)], [], timeout, log)
    ranks = read_reports(reports, np)
    outcome = {r: res.get(nodeid, ("not run", ""))[0] for r, res in ranks.items()}
    text = next((first_error_line(t) for r in ranks.values()
                 for n, (res, t) in r.items() if res in ("failed", "error")), "")
    print(f"  alone {short(nodeid)}: {outcome}; {ended}, {seconds:.0f} s"
          f"{'; ' + text if text else ''}", flush=True)
    return {"ranks": outcome, "ended": ended, "text": text, "log": log}


def run_suite(args: argparse.Namespace, venv: str, work: str, shim: str, suite: str,
              np: int) -> dict:
    """Run one suite as one job on ``np`` ranks, print its counts and failures, and (with
    ``--alone``) rerun each failing test alone."""
    log = os.path.join(work, f"{suite[:-3]}.np{np}.log")
    pytest_args = ["-k", args.only] if args.only else []
    ended, seconds, reports = run_job(venv, np, os.path.join(work, suite_folder(suite)), shim,
                                      [suite], pytest_args, args.timeout, log)
    ranks = read_reports(reports, np)
    summary = summarize(ranks)
    texts = {n: first_error_line(t) for r in ranks.values()
             for n, (res, t) in r.items() if res in ("failed", "error")}
    c = summary["counts"]
    print(f"\n{suite} np={np} {args.mpi}: {c['passed']} passed, {c['failed']} failed, "
          f"{c['error']} errors, {c['skipped']} skipped, {c['unfinished']} unfinished, "
          f"{c['not run']} not run (rank 0); {ended}, {seconds:.0f} s; log {log}", flush=True)
    for nodeid, bad_ranks in summary["failing"].items():
        how = {r: ranks[r][nodeid][0] for r in bad_ranks}
        print(f"  FAIL {short(nodeid)} ranks {how}: {texts.get(nodeid, '')}", flush=True)
    alone = {nodeid: run_alone(venv, np, work, shim, nodeid, args.alone_timeout)
             for nodeid in (summary["failing"] if args.alone else ())}
    return {"suite": suite, "np": np, "mpi": args.mpi, "ended": ended, "seconds": round(seconds),
            "log": log, **summary, "texts": texts, "alone": alone}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Export, run and report; exit status 0 only when every job ended cleanly with no
    failing test."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod", default=os.environ.get(MIRROR_VARIABLE, DEFAULT_MIRROR),
                        help=f"a local Horovod git mirror (default ${MIRROR_VARIABLE}, else "
                             f"{DEFAULT_MIRROR})")
    parser.add_argument("--tag", default=DEFAULT_TAG,
                        help=f"the Horovod tag to read ({DEFAULT_TAG})")
    parser.add_argument("--suite", action="append", help="a file of test/parallel, or an "
                        f"elastic scenario of test/integration ({', '.join(ELASTIC_SUITES)}), "
                        f"repeatable (default: {', '.join(DEFAULT_SUITES)}; with --venv "
                        f".venv-tf: {', '.join(TF_SUITES)})")
    parser.add_argument("--np", type=int, action="append", help="ranks, repeatable (default 2)")
    parser.add_argument("--mpi", choices=("mpich", "openmpi"), default="mpich",
                        help="which venv's hvdrun: mpich the running interpreter's, openmpi "
                             "the repository's .venv-openmpi (or --venv)")
    parser.add_argument("--venv", help="the virtual environment whose hvdrun and python run")
    parser.add_argument("--only", help="run only tests whose name contains this (pytest -k)")
    parser.add_argument("--alone", action="store_true",
                        help="then rerun each failing test alone, one job each")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per suite job")
    parser.add_argument("--alone-timeout", type=float, default=300,
                        help="seconds per job of one test (with --alone)")
    parser.add_argument("--json", help="also write every result, with failure texts, here")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary folder (exported suites, shim, logs)")
    args = parser.parse_args(argv)

    venv = os.path.abspath(args.venv) if args.venv else (
        os.path.join(REPO, ".venv-openmpi") if args.mpi == "openmpi" else sys.prefix)
    if not os.path.exists(os.path.join(venv, "bin", "hvdrun")):
        raise SystemExit(f"{venv} has no bin/hvdrun: install hvd_trainer there or pass --venv")
    suites = args.suite or list(DEFAULT_SUITES)
    for suite in sorted({"test_ray.py", "test_ray_elastic.py"} & set(suites)):
        print(f"{suite}: the harness opens the suite's gloo_built() gate (Horovod's Ray "
              "tests need Gloo for its rendezvous; hvd_trainer's Ray engine needs none)",
              flush=True)
    if "test_spark.py" in suites:
        print("test_spark.py: the harness opens the suite's is_open_mpi() gate (Horovod's "
              "Spark MPI mode needs Open MPI; hvd_trainer's runs under MPICH too)", flush=True)
    needed = sorted(set(HELPER_MODULES).union(*(SUITE_MODULES.get(s, ()) for s in suites)))
    check = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                            f"import {', '.join(needed)}, pytest"], capture_output=True)
    if check.returncode != 0:
        raise SystemExit(f"Horovod's suites and test helpers import {', '.join(needed)}: "
                         f"{venv}/bin/pip install {' '.join(needed)} pytest")

    work = tempfile.mkdtemp(prefix="hvd_peer_suites.")
    try:
        if os.path.commonpath([os.path.realpath(work), REPO]) == REPO:
            raise SystemExit(f"the temporary folder {work} is inside the repository; set TMPDIR")
        shim = os.path.join(work, "shim")
        write_shim(shim)
        export_horovod_modules(args.horovod, args.tag, shim)
        exported = export_suites(args.horovod, args.tag, suites, work)
        print(f"exported from {args.tag}: {', '.join(exported)}; work folder {work}", flush=True)
        # An elastic suite is one process; its jobs choose their own sizes.
        results = [run_suite(args, venv, work, shim, suite, np) for suite in suites
                   for np in ([1] if suite in ONE_PROCESS_SUITES else args.np or [2])]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print("\nsuite                    np  mpi      passed failed errors skipped unfinished not-run")
    for e in results:
        c = e["counts"]
        print(f"{e['suite']:<24} {e['np']:>2}  {e['mpi']:<8} {c['passed']:>6} {c['failed']:>6} "
              f"{c['error']:>6} {c['skipped']:>7} {c['unfinished']:>10} {c['not run']:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(not e["failing"] and e["ended"] == "exit 0" for e in results) else 1


if __name__ == "__main__":
    sys.exit(main())
