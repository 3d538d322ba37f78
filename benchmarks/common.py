"""Shared plumbing for the benchmarks that compare one process with 2 ranks."""
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional


def launch(script: str, ranks: int, args: List[str], threads: int = 1,
           env: Optional[Dict[str, str]] = None) -> dict:
    """Run ``script --worker ...`` on ``ranks`` fresh processes; return the RESULT rank 0 prints.

    ``ranks`` 1 runs plain python (no launcher, no MPI); more go through hvdrun. ``env`` adds
    variables (e.g. HVD_OVERLAP) to the workers' environment; a PYTHONPATH there is a tree
    (:func:`extract_tree`) whose own hvdrun runs the job.
    """
    worker = [sys.executable, os.path.abspath(script), *args]
    tree = (env or {}).get("PYTHONPATH")
    cmd = (hvdrun(tree) + ["-np", str(ranks), "--no-prefix"]
           + worker if ranks > 1 else worker)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
    # In the tree, if one is given: `python -m` puts its working folder first on the path.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tree)
    found = re.search(r"RESULT (\{.*\})", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return json.loads(found.group(1))


def launch_tree(tree: str, script: str, args: List[str], ranks: int = 2) -> dict:
    """Run ``script`` (with ``args``) on ``ranks`` processes under hvdrun, importing
    hvd_trainer from ``tree`` (a checkout, through PYTHONPATH); return the RESULT rank 0
    prints, after checking that the workers imported that tree."""
    cmd = hvdrun(tree) + ["-np", str(ranks), "--no-prefix", sys.executable,
                          os.path.abspath(script), *args]
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    # Run in the tree: `python -m` puts its working folder first on the path, before PYTHONPATH.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tree)
    found = re.search(r"RESULT (\{.*\})", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    result = json.loads(found.group(1))
    if not result["file"].startswith(tree):
        raise RuntimeError(f"the worker imported {result['file']}, not the tree {tree}")
    return result


def hvdrun(tree: Optional[str] = None) -> List[str]:
    """The command that starts hvdrun, from checkout ``tree`` when given: its module is
    ``hvd_trainer_launch.cli.hvdrun`` since the launcher was grouped by concern (issue 47),
    ``hvd_trainer_launch.hvdrun`` in the commits before, such as b87c4df."""
    grouped = tree is None or os.path.isdir(os.path.join(tree, "hvd_trainer_launch", "cli"))
    return [sys.executable, "-m",
            "hvd_trainer_launch.cli.hvdrun" if grouped else "hvd_trainer_launch.hvdrun"]


def name_old_launcher(tree: str) -> None:
    """Before issue 47 the launcher lived in launch/ and was installed as hvd_trainer_launch:
    in such a tree, link that name to launch/, so that the tree on PYTHONPATH imports its own
    launcher (its hvd_trainer imports it) rather than the installed, regrouped one."""
    old, named = os.path.join(tree, "launch"), os.path.join(tree, "hvd_trainer_launch")
    if os.path.isdir(old) and not os.path.exists(named):
        os.symlink("launch", named)


def extract_tree(rev: str, folder: str) -> None:
    """Commit ``rev``'s hvd_trainer and launcher, unpacked into ``folder`` (``git archive``),
    to be imported through PYTHONPATH."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    listed = subprocess.run(["git", "-C", repo, "ls-tree", "--name-only", rev], check=True,
                            capture_output=True, text=True).stdout.split()
    paths = [p for p in ("hvd_trainer", "hvd_trainer_launch", "launch") if p in listed]
    archive = subprocess.run(["git", "-C", repo, "archive", rev, *paths], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    name_old_launcher(folder)


@contextlib.contextmanager
def detached_tree(rev: str) -> Iterator[str]:
    """A detached worktree of commit ``rev`` of this checkout, removed afterwards."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, rev)
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-f", path, rev],
                       check=True, capture_output=True)
        name_old_launcher(path)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path],
                           capture_output=True)


class Polled:
    """An mpi4py request behind the backends' Request protocol (``test()``), to poll a raw
    request as the agreement polls its own."""

    def __init__(self, request) -> None:
        self.test = request.Test


def slowest_rank(value: float, distributed: bool) -> float:
    """The largest ``value`` over the ranks (a collective when ``distributed``)."""
    if not distributed:
        return value
    import hvd_trainer
    import numpy as np
    return float(hvd_trainer.allreduce(np.array([value]), op=hvd_trainer.Max)[0])


def seconds_per_step(step: Callable[[], None], steps: int, repetitions: int, warmup: int,
                     distributed: bool) -> float:
    """Best seconds per ``step()`` over the repetitions; the slowest rank sets the pace.

    ``step`` queues MXNet work; each repetition ends with ``waitall()``, so it is included.
    """
    import mxnet as mx
    for _ in range(warmup):
        step()
    mx.nd.waitall()
    best = float("inf")
    for _ in range(repetitions):
        if distributed:
            import hvd_trainer
            hvd_trainer.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        mx.nd.waitall()
        best = min(best, slowest_rank((time.perf_counter() - start) / steps, distributed))
    return best


def peak_rss_mb(distributed: bool) -> float:
    """This process's peak resident set size in MB (the largest over the ranks)."""
    return slowest_rank(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, distributed)


def header(title: str, details: str = "") -> str:
    """The first line of a results table: what, when, on which machine."""
    return (f"# {title}: {datetime.date.today()}, {os.cpu_count()} cores ({cpu_model()})"
            + (f", {details}" if details else ""))


def commit() -> str:
    """The short hash of the checkout's HEAD, for the header of a results table."""
    return subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse",
                           "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def report(results: dict) -> None:
    """Print the line the parent process parses (rank 0 only, by the caller's choice)."""
    print("RESULT " + json.dumps(results), flush=True)


def cpu_model() -> str:
    """The processor's model name, for the header of a results table."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dense_mlp(layers: int = 8, width: int = 2048):
    """The MLP of the compression figures: ``layers`` Dense(width, relu) on ``width`` inputs
    and a Dense(10) head, Xavier-initialised after mx.random.seed(0), hybridized."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    for _ in range(layers):
        net.add(gluon.nn.Dense(width, activation="relu", in_units=width))
    net.add(gluon.nn.Dense(10, in_units=width))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def training_step(net, trainer, x, y) -> Callable[[], None]:
    """One forward, backward and ``trainer.step`` on a fixed batch: what the benchmarks time."""
    from mxnet import autograd, gluon
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def step() -> None:
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
    return step


def bed_spark_session(master: str, driver_host: str, jvm_options: str, name: str):
    """From a driver on the multi-host test bed's h1: a SparkSession on the bed's standalone
    ``master``, its driver reached at ``driver_host``, every JVM started with
    ``jvm_options``, no UI."""
    from pyspark.sql import SparkSession
    return (SparkSession.builder.master(master).appName(name)
            .config("spark.driver.host", driver_host)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.executor.memory", "512m")
            .config("spark.driver.extraJavaOptions", jvm_options)
            .config("spark.executor.extraJavaOptions", jvm_options).getOrCreate())
