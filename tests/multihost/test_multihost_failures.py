"""Failures across hosts: a rank killed on a remote host, hosts that cannot be reached, and
hvdrun itself killed. Each ends the job promptly (every launch is bounded in time) with a
non-zero code and a message that names the rank and host, and leaves no process of the job
on any host (workers/waiting_worker.py ranks allreduce until they are killed)."""
import os
import signal
import subprocess
import sys
import tempfile

import pytest

import testbed
from multihost import (environment, hvdrun, hvdrun_command, wait_for_ranks,
                       wait_until_no_job_is_left, worker)

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


def start(bed, args, np):
    """Start hvdrun on h1 with ``args`` running the waiting worker on ``np`` ranks; wait until
    every rank is ready. Returns the hvdrun process (output piped) and per rank its host and
    process id there."""
    folder = tempfile.mkdtemp(dir=bed.shared)
    proc = bed.popen("h1", hvdrun_command([*args, sys.executable, worker("waiting_worker.py"),
                                           folder]),
                     cwd=bed.shared, env=environment(), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    try:
        return proc, wait_for_ranks(folder, np, proc)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise


@pytest.fixture(scope="module")
def remote_kill(bed):
    """-np 4 -H h1:2,h2:2, rank 3 killed with SIGKILL on h2: (exit code, stderr, stdout,
    job processes left)."""
    proc, ranks = start(bed, ["-np", 4, "-H", "h1:2,h2:2"], 4)
    host, pid = ranks[3]
    assert host == "h2", ranks
    bed.run(host, ["kill", "-9", str(pid)], check=True)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err, out, wait_until_no_job_is_left(bed)


def test_remote_kill_ends_the_job_with_137_naming_the_rank_and_host(remote_kill):
    code, err, out, _ = remote_kill
    assert code == 137, err
    assert "hvdrun: rank 3 on h2 exited with code 137 (first failure); ending the job" in err
    assert "#hvdrun-exit" not in out + err


def test_remote_kill_leaves_no_process_of_the_job_on_any_host(remote_kill):
    assert remote_kill[3] == {}


def test_a_host_whose_sshd_is_down_is_named_at_once(bed):
    bed.stop_sshd("h2")
    try:
        proc = hvdrun(bed, ["--start-timeout", 60, "-np", 2, "-H", "h1:1,h2:1", sys.executable,
                            "-c", "print('ran')"], timeout=120)
    finally:
        bed.start_sshd("h2")
    assert proc.returncode not in (0, 1), proc.stderr  # mpiexec's own code, not a timeout's
    # ssh's own "ssh: connect to host h2 port 22: Connection refused" can be lost when mpiexec
    # ends first; hvdrun's line is not.
    assert "hvdrun: host h2 takes no connection on its ssh port 22 (Connection refused)" \
        in proc.stderr
    assert "h1 takes no connection" not in proc.stderr
    assert "started; its messages above say why (e.g. ssh could not reach a host)" in proc.stderr
    assert "ran" not in proc.stdout
    assert wait_until_no_job_is_left(bed) == {}


def test_a_host_name_that_does_not_resolve_is_named(bed):
    proc = hvdrun(bed, ["-np", 2, "-H", "h1:1,nosuchhost:1", sys.executable, "-c", "print('ran')"],
                  timeout=120)
    assert proc.returncode not in (0, 1), proc.stderr
    # ssh's own "Could not resolve hostname" can be lost when mpiexec ends first; hvdrun's is not.
    assert "nosuchhost started; its messages above say why" in proc.stderr
    assert "hvdrun: host nosuchhost does not resolve on this machine (" in proc.stderr
    assert "h1 does not resolve" not in proc.stderr
    assert wait_until_no_job_is_left(bed) == {}


def test_a_hung_host_ends_the_job_at_the_start_timeout_and_leaves_no_ssh(bed):
    # h2's sshd accepts connections but never answers: ssh waits (up to its ConnectTimeout of
    # 10 s on the bed), so only --start-timeout ends the job.
    bed.signal_sshd("h2", signal.SIGSTOP)
    try:
        proc = hvdrun(bed, ["--start-timeout", 2, "-np", 2, "-H", "h1:1,h2:1", sys.executable,
                            "-c", "print('ran')"], timeout=120)
        left = wait_until_no_job_is_left(bed)
    finally:
        bed.signal_sshd("h2", signal.SIGCONT)
    assert proc.returncode == 1, proc.stderr
    assert "h2 did not start within --start-timeout 2 s; ending the job" in proc.stderr
    assert left == {}


def test_hvdrun_killed_on_the_launching_host_leaves_no_rank_on_any_host(bed):
    proc, ranks = start(bed, ["-np", 3, "-H", "h1:1,h2:1,h3:1"], 3)
    assert sorted(host for host, _ in ranks.values()) == ["h1", "h2", "h3"]
    os.kill(testbed.child_of(proc.pid), signal.SIGKILL)  # hvdrun, which nsenter started
    proc.communicate(timeout=60)
    assert wait_until_no_job_is_left(bed) == {}
