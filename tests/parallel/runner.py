"""Launch a worker script on several ranks for a test, bounded in time; turn the per-case
records of a worker (workers/case_runner.py) into one pytest result per case."""
import ast
import json
import os
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple, Union

from hvd_trainer_launch import mpi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(REPO, "tests", "parallel", "workers")
# Stand-ins put first on the PYTHONPATH of the jobs whose scripts name none of their words
# (see each folder): the real thing costs each rank a second or two of CPU at its start, for
# code those scripts never run. A script that runs an example gets the real ones: the examples
# are user programs.
WITHOUT_SKLEARN = os.path.join(REPO, "tests", "parallel", "without_sklearn")
WITHOUT_SCIPY = os.path.join(REPO, "tests", "parallel", "without_scipy")
WITHOUT_DYNAMO = os.path.join(REPO, "tests", "parallel", "without_dynamo")
STAND_INS = {
    WITHOUT_SKLEARN: ("sklearn", "examples"),
    # (torchmetrics, which Lightning imports, imports scipy.signal.)
    WITHOUT_SCIPY: ("scipy", "sklearn", "lightning", "examples"),
    WITHOUT_DYNAMO: ("compile", "_dynamo", "lightning", "examples"),
}


# A job runs below the session's priority (nice 10). Under `pytest -n 2` the other worker
# often runs the tests of Ray and Spark clusters and of the test bed, whose daemons answer
# heartbeats and whose tests wait on wall-clock deadlines; a job only needs CPU time. At the
# same priority on two cores the jobs slowed the clusters, which then waited longer and spent
# more: CI's first pass took about 1,450 CPU-seconds and 12 min 45 s, and 1,308 and 11 min
# 36 s with the jobs niced (2026-12-07, see docs/getting-started.md#testing).
JOB_NICENESS = 10


def _stand_ins(paths: Sequence[str]) -> List[str]:
    """The stand-in folders for a job of the scripts ``paths`` (those that are files): each
    whose words none of them names."""
    sources = []
    for path in paths:
        if os.path.isfile(path):
            with open(path) as f:
                sources.append(f.read())
    return [folder for folder, words in STAND_INS.items()
            if not any(word in source for word in words for source in sources)]


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
        cmd = [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "-np", str(np), *hvdrun_args,
               *program]
    # One OpenMP thread per rank: three ranks share two cores in CI.
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    stand_ins = _stand_ins([path, *args])
    if stand_ins:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [*stand_ins, *filter(None, [full_env.get("PYTHONPATH")])])
    proc = subprocess.run(["nice", "-n", str(JOB_NICENESS), *cmd], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr}")
    return proc


def case_names(script: str) -> List[str]:
    """The names of ``script``'s cases, read from its source without running it, for the
    tests' parametrized ids: the keys of the dict literal its ``run_cases`` call is given;
    an entry ``**{... for name in TABLE}`` there stands for the keys of the dict literal
    assigned to ``TABLE``."""
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    with open(path) as f:
        tree = ast.parse(f.read())
    tables = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_cases":
            names = []
            for key, value in zip(node.args[0].keys, node.args[0].values):
                if key is not None:
                    names.append(key.value)
                else:  # **{... for name in TABLE}
                    table = tables[value.generators[0].iter.id]
                    names += [k.value for k in table.keys]
            return names
    raise ValueError(f"{script} calls no run_cases({{...}}) with a dict of its cases")


class Cases:
    """The records that one job of a worker printed, by case and rank."""

    def __init__(self, np: int, output: str, ending: str):
        self.np = np
        self.output = output
        self.ending = ending  # how the job ended: its exit code, or its timeout
        self.records: Dict[str, Dict[int, dict]] = {}
        for line in output.splitlines():
            at = line.find("#case ")
            if at >= 0:
                record = json.loads(line[at + len("#case "):])
                self.records.setdefault(record["case"], {})[record["rank"]] = record

    def check(self, case: str) -> None:
        """Fail, naming the case, unless every rank reported ``case`` passed."""
        found = self.records.get(case, {})
        missing = [r for r in range(self.np) if r not in found]
        failed = {r: rec["failures"] for r, rec in sorted(found.items()) if not rec["ok"]}
        if failed:
            detail = "\n".join(f"rank {r}: " + "\n  ".join(f) for r, f in failed.items())
            raise AssertionError(f"case {case!r} failed on ranks {sorted(failed)}:\n{detail}")
        if missing:
            raise AssertionError(f"case {case!r}: no record from ranks {missing}; the job "
                                 f"{self.ending}\n{self.output[-6000:]}")


_jobs: Dict[Tuple, Cases] = {}

# Torch workers that the test files of hvd_trainer.torch share as one 3-rank job
# (workers/case_chain.py): a torch rank takes seconds to start. Those that make float64 the
# default dtype come last, so that each runs with the default it expects.
# (torch_optimizer_equivalence.py has its own job: four of its case names are taken here.)
TORCH_JOB = ("torch_ops_worker.py", "torch_compression_equivalence.py", "torch_step_order.py",
             "torch_training_worker.py", "torch_sparse_optimizer.py")
TORCH_JOB_SECONDS = 900
# The Gluon workers of test_mxnet_ops.py, test_sparse_training.py and test_sparse_weights.py
# likewise share one 3-rank job (mxnet_bad_arguments.py has its own: its case names are taken).
MXNET_JOB = ("mxnet_ops_worker.py", "sparse_equivalence.py", "sparse_weights_equivalence.py")
MXNET_JOB_SECONDS = 420


def case_job(script: Union[str, Tuple[str, ...]], np: int, args: Sequence[str] = (),
             timeout: float = 120, env: dict = None, hvdrun_args: Sequence[str] = ()) -> Cases:
    """Run ``script``'s cases on ``np`` ranks once per set of arguments (later calls reuse the
    job) and return its records; a job that fails or outlives ``timeout`` still gives the
    records it printed. A tuple of scripts (without ``args``) runs them one after another in
    one job (workers/case_chain.py), so that their ranks start once; their case names must
    differ."""
    key = (script, np, tuple(args), timeout, tuple(sorted((env or {}).items())),
           tuple(hvdrun_args))
    if key not in _jobs:
        if isinstance(script, tuple):
            names = [name for one in script for name in case_names(one)]
            assert not args and len(set(names)) == len(names), f"{script}: args, or a name twice"
            script, args = "case_chain.py", [os.path.join(WORKERS, one) for one in script]
        try:
            proc = run_ranks(script, np, args, timeout, env, check=False,
                             hvdrun_args=hvdrun_args)
            output, ending = proc.stdout + proc.stderr, f"exited {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            output = "".join(part.decode() if isinstance(part, bytes) else (part or "")
                             for part in (e.stdout, e.stderr))
            ending = f"ran past its timeout of {timeout} s"
        _jobs[key] = Cases(np, output, ending)
    return _jobs[key]
