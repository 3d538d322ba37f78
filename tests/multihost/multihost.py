"""How the multi-host tests launch jobs on the test bed, and the layout they expect."""
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

import testbed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(REPO, "tests", "multihost", "workers")
# The tests' shared modules (torch_loops, estimator_data, horovod_examples), which the engine
# tests' drivers import (their functions travel to the ranks by value).
TESTS = os.path.join(REPO, "tests")
HEAD = "10.213.0.1"  # h1 on lan0, where the engine tests' Ray head and Spark master run


def environment(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Our environment for a job: one OpenMP thread per rank (ranks share 2 cores in CI), and
    Open MPI without its libfabric and UCX probes (about 1 s a start; TCP serves between hosts)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.setdefault("OMPI_MCA_btl", "^ofi,uct")
    env.update(extra or {})
    return env


def hvdrun_command(args: Sequence[str]) -> List[str]:
    """hvdrun with ``args``, run by this interpreter (the venv every host shares)."""
    return [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", *map(str, args)]


def hvdrun(bed: testbed.TestBed, args: Sequence[str], timeout: float = 180,
           env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run hvdrun with ``args`` on h1 (the launching host) to its end, in the folder every
    host sees; the output as text."""
    return bed.run("h1", hvdrun_command(args), cwd=bed.shared, env=environment(env),
                   capture_output=True, text=True, timeout=timeout)


def worker(name: str) -> str:
    """The path of tests/multihost/workers/``name``."""
    return os.path.join(WORKERS, name)


def expected_layout(hosts: Sequence[Tuple[str, int]]) -> List[Dict[str, object]]:
    """Per rank, where Horovod's by-slot placement puts it on ``hosts`` ((name, slots) in
    order): its host, local rank and size, cross rank and size."""
    placed = [host for host, slots in hosts for _ in range(slots)]
    layout = []
    for rank, host in enumerate(placed):
        local_rank = placed[:rank].count(host)
        peers = [r for r in range(len(placed)) if placed[:r].count(placed[r]) == local_rank]
        layout.append({"host": host, "rank": rank, "size": len(placed),
                       "local_rank": local_rank, "local_size": placed.count(host),
                       "cross_rank": peers.index(rank), "cross_size": len(peers)})
    return layout


# What a job leaves running if it leaves anything: ranks and their wrappers, Hydra's proxies,
# Open MPI's daemons, and the ssh that started them.
JOB_PROCESSES = ("hvd_trainer_launch", WORKERS, "hydra_pmi_proxy", "prted", "ssh ")


def job_processes(bed: testbed.TestBed) -> Dict[str, List[str]]:
    """Per host, the live processes that belong to a job (as ``ps`` shows them)."""
    found = {}
    for host in bed.hosts:
        ps = bed.run(host, ["ps", "-eo", "stat=,args="], capture_output=True, text=True,
                     timeout=60).stdout.splitlines()
        found[host] = [line for line in ps if not line.startswith("Z")
                       and any(name in line for name in JOB_PROCESSES)]
    return found


def wait_until_no_job_is_left(bed: testbed.TestBed, seconds: float = 30) -> Dict[str, List[str]]:
    """Poll the hosts until no job process is left, for at most ``seconds``; what is left."""
    deadline = time.monotonic() + seconds
    while True:
        left = job_processes(bed)
        if not any(left.values()) or time.monotonic() > deadline:
            return {host: lines for host, lines in left.items() if lines}
        time.sleep(0.5)


def wait_for_ranks(folder: str, np: int, proc: subprocess.Popen,
                   seconds: float = 120) -> Dict[int, Tuple[str, int]]:
    """Wait until workers/waiting_worker.py's ``np`` ranks have written folder/ready.RANK;
    per rank, its host and its process id there. AssertionError if the job ends first."""
    deadline = time.monotonic() + seconds
    while True:
        ready = {}
        for rank in range(np):
            path = os.path.join(folder, f"ready.{rank}")
            if os.path.exists(path):
                host, pid = open(path).read().split()
                ready[rank] = (host, int(pid))
        if len(ready) == np:
            return ready
        assert proc.poll() is None, f"the job ended (code {proc.returncode}) before its ranks were ready"
        assert time.monotonic() < deadline, f"only ranks {sorted(ready)} were ready after {seconds} s"
        time.sleep(0.2)


def stop_processes_with(marker: str) -> None:
    """SIGKILL, by PID, every process whose environment carries ``marker`` (the daemons a
    fixture started, and whatever they started: workers, executors, ranks)."""
    wanted = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if wanted not in environ.read().split(b"\0"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass


def wait_for_text(path: str, text: str, seconds: float) -> None:
    """Wait until the file at ``path`` (a daemon's log) holds ``text``; AssertionError after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        with open(path, errors="replace") as log:
            if text in log.read():
                return
        assert time.monotonic() < deadline, f"{path} did not say {text!r}"
        time.sleep(0.1)


def driver_said(stdout: str, *kinds: str) -> Dict[str, object]:
    """An engine test driver's lines ``KIND json``, by kind."""
    return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
            for line in stdout.splitlines() if line.split(" ", 1)[0] in kinds}


def assert_weights_close(got: Sequence, want: Sequence) -> None:
    """Each array of ``got`` (a rank's weights) equals ``want``'s to float32 rounding."""
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


class RayDaemons(NamedTuple):
    """What a test's Ray daemons on the bed share: the ``ray`` command, the marker in their
    environment (multihost.stop_processes_with ends them by it), and that environment."""

    ray_cli: str
    marker: str
    env: Dict[str, str]


def ray_daemons(name: str, token: Dict[str, str]) -> RayDaemons:
    """The ``ray`` command and environment of a test's Ray daemons, marked with the variable
    ``name`` (a fresh value), with the cluster's ``token`` variables; skips without Ray."""
    import importlib.util
    import secrets

    import pytest
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed here; pip install -e '.[test]'")
    value = secrets.token_hex(8)
    return RayDaemons(os.path.join(os.path.dirname(sys.executable), "ray"), f"{name}={value}",
                      dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                           **token, **{name: value}))
