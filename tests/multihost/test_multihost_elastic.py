"""Elastic hvdrun across hosts: one job (workers/elastic_hosts.py, --min-np 1) that loses two
of its three hosts and finishes on the launching host from its last commits.

- Life 1 on h1, h2, h3: at step 3 h3 leaves the discovery script's list and its rank is
  killed with SIGKILL; the job goes on on h1 and h2 from the last commit.
- Life 2: a few steps later h2 crashes for good (its rank killed, its sshd down) while the
  discovery script still lists it. The next launch cannot reach h2; hvdrun must blame h2,
  leave it out and go on on h1 alone, rather than relaunch on h2 without end.
- Once h2 is out its sshd comes back, and at the end the job's commit folder must be gone
  from every host that held one (their /tmp is their own).
"""
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest

from multihost import environment, hvdrun_command, worker

STEPS = 24  # workers/elastic_hosts.py's


def write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def progress(folder, size, step, proc, seconds=120):
    """Wait until the ``size`` ranks of a life of that size have all committed ``step``;
    their progress (host, pid, step, size) per host."""
    deadline = time.monotonic() + seconds
    while True:
        entries = []
        for name in os.listdir(folder):
            if name.startswith("progress.") and not name.endswith(".tmp"):
                with open(os.path.join(folder, name)) as f:
                    entries.append(json.load(f))
        mine = [entry for entry in entries if entry["size"] == size]
        if len(mine) == size and all(entry["step"] >= step for entry in mine):
            return {entry["host"]: entry for entry in mine}
        assert proc.poll() is None, f"the job ended (code {proc.returncode}) before that"
        assert time.monotonic() < deadline, f"no life of {size} ranks reached step {step}"
        time.sleep(0.1)


def committed(stdout):
    """Per life (as rank 0 printed them): (size, first step, hosts, last step committed)."""
    lives = []
    for line in stdout.splitlines():
        life = re.search(r"LIFE size=(\d+) step=(\d+) hosts=(\S+)", line)
        if life:
            lives.append([int(life[1]), int(life[2]), life[3], int(life[2])])
        done = re.search(r"COMMITTED step=(\d+)", line)
        if done and lives:
            lives[-1][3] = int(done[1])
    return [tuple(life) for life in lives]


def discovery(folder, hosts_text):
    """A discovery script in ``folder`` that prints its hosts file, written with
    ``hosts_text`` first: (the file's path, the script's)."""
    hosts, script = os.path.join(folder, "hosts"), os.path.join(folder, "discover.sh")
    write(hosts, hosts_text)
    write(script, f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(script, 0o755)
    return hosts, script


def start_job(bed, folder, args):
    """hvdrun on h1 with ``args`` running workers/elastic_hosts.py ``folder``, its output kept."""
    command = hvdrun_command([*args, sys.executable, worker("elastic_hosts.py"), folder])
    return bed.popen("h1", command, cwd=bed.shared, env=environment(),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def killed_if_left(proc):
    """Kill the job if the test leaves the block before it has ended."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def job(bed):
    folder = tempfile.mkdtemp(dir=bed.shared)
    hosts, script = discovery(folder, "h1:1\nh2:1\nh3:1\n")
    # --reset-limit bounds what a launcher that never gives up on h2 would do.
    proc = start_job(bed, folder, ["--min-np", 1, "--host-discovery-script", script,
                                   "--reset-limit", 8])
    sshd_down = False
    try:
        ranks = progress(folder, 3, 3, proc)
        write(hosts, "h1:1\nh2:1\n")
        bed.run("h3", ["kill", "-9", str(ranks["h3"]["pid"])], check=True)
        first = min(entry["step"] for entry in progress(folder, 2, 0, proc).values())
        ranks = progress(folder, 2, first + 3, proc)
        bed.stop_sshd("h2")
        sshd_down = True
        bed.run("h2", ["kill", "-9", str(ranks["h2"]["pid"])], check=True)
        progress(folder, 1, 0, proc)
        bed.start_sshd("h2")
        sshd_down = False
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if sshd_down:
            bed.start_sshd("h2")
    with open(os.path.join(folder, "result.json")) as f:
        result = json.load(f)
    job_dir = re.search(r"FOLDER (\S+)", out)[1]
    left = [host for host in bed.hosts if bed.run(host, ["test", "-e", job_dir]).returncode == 0]
    return SimpleNamespace(code=proc.returncode, out=out, err=err, result=result, left=left)


def test_the_job_ends_well_on_the_host_left(job):
    assert job.code == 0, job.err


def test_each_life_goes_on_from_the_last_commit_on_the_hosts_left(job):
    lives = committed(job.out)
    assert [(size, hosts) for size, _, hosts, _ in lives] == \
        [(3, "h1,h2,h3"), (2, "h1,h2"), (1, "h1")], job.out
    for before, after in zip(lives, lives[1:]):
        assert after[1] == before[3], lives  # starts at the previous life's last commit
    assert lives[-1][3] == STEPS
    sizes = [size for size, start, _, end in lives for _ in range(start, end)]
    assert job.result["sizes"] == sizes
    assert job.result["total"] == sum(size * (size + 1) / 2 for size in sizes)


def test_the_crashed_hosts_are_named_and_h2_is_left_out(job):
    assert "rank 2 on h3 exited with code 137; ending this life" in job.err
    assert "rank 1 on h2 exited with code 137; ending this life" in job.err
    # hvdrun's own line: ssh's can be lost when mpiexec ends first (job/unreached.py).
    assert "hvdrun: host h2 takes no connection on its ssh port 22 (Connection refused)" \
        in job.err
    assert "host h2 failed in 2 lives in a row; leaving it out for the rest of the job" in job.err


def test_the_commit_folders_are_gone_from_every_host(job):
    assert job.left == []
