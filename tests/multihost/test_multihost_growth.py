"""Elastic hvdrun across hosts, growing and shrinking: a job on h1 and h2
(workers/elastic_hosts.py) whose discovery adds h3 after a few steps, then drops h2.

Under MPICH the growth is in place: the ranks on h1 and h2 keep their processes while Hydra
starts h3's rank through ssh from inside the job; under Open MPI, whose mpirun can give a new
rank its variables only on its own host, every rank restarts. The removal of h2 restarts
every rank under both (in place it is for ranks all on hvdrun's machine: test_elastic.py). Either way the sums are those of every step at its world size, nothing
committed is lost, and the commit folders are gone from every host at the end.
"""
import json
import os
import re
import tempfile
from types import SimpleNamespace

import pytest

from hvd_trainer_launch import mpi
from test_multihost_elastic import (STEPS, committed, discovery, killed_if_left, progress,
                                    start_job, write)

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def job(bed):
    folder = tempfile.mkdtemp(dir=bed.shared)
    hosts, script = discovery(folder, "h1:1\nh2:1\n")
    proc = start_job(bed, folder, ["--min-np", 1, "--max-np", 3, "--host-discovery-script",
                                   script, "--reset-limit", 3])
    with killed_if_left(proc):
        before = progress(folder, 2, 3, proc)
        write(hosts, "h1:1\nh2:1\nh3:1\n")
        after = progress(folder, 3, 0, proc)
        write(hosts, "h1:1\nh3:1\n")
        last = progress(folder, 2, max(entry["step"] for entry in after.values()) + 2, proc)
        out, err = proc.communicate(timeout=300)
    job_dir = re.search(r"FOLDER (\S+)", out)[1]
    left = [host for host in bed.hosts if bed.run(host, ["test", "-e", job_dir]).returncode == 0]
    return SimpleNamespace(code=proc.returncode, out=out, err=err, before=before, after=after,
                           last=last, left=left, folder=folder)


def test_the_job_ends_well_on_h1_and_h3(job):
    assert job.code == 0, job.err
    assert [(size, hosts) for size, _, hosts, _ in committed(job.out)] == \
        [(2, "h1,h2"), (3, "h1,h2,h3"), (2, "h1,h3")], job.out


def test_under_mpich_the_ranks_of_h1_and_h2_keep_their_processes_as_h3_joins(job):
    grown = [job.before[host]["pid"] == job.after[host]["pid"] for host in ("h1", "h2")]
    shrunk = [job.after[host]["pid"] == job.last[host]["pid"] for host in ("h1", "h3")]
    # A removal across hosts restarts every rank under either MPI (resizing.py says why).
    assert shrunk == [False, False], (job.after, job.last)
    if mpi.find_launcher().flavour == mpi.HYDRA:
        assert grown == [True, True], (job.before, job.after)
        assert "the ranks grow the job in place onto h3:1" in job.err
        assert "the job grew in place to h1:1,h2:1,h3:1" in job.err
        assert job.err.count("the ranks restart on them at their next commit") == 1
    else:
        assert grown == [False, False], (job.before, job.after)
        assert job.err.count("the ranks restart on them at their next commit") == 2


def test_each_change_goes_on_from_the_commit_that_took_it(job):
    lives = committed(job.out)
    # The commit that took a change raised HostsUpdatedInterrupt before rank 0 could print
    # it: the next start is one step after the last commit printed.
    for (_, _, _, printed), (_, start, _, _) in zip(lives, lives[1:]):
        assert start == printed + 1, lives
    assert lives[-1][3] == STEPS, lives
    with open(os.path.join(job.folder, "result.json")) as f:
        result = json.load(f)
    ends = [start for _, start, _, _ in lives[1:]] + [STEPS]
    sizes = [size for (size, start, _, _), end in zip(lives, ends) for _ in range(start, end)]
    assert result["sizes"] == sizes
    assert result["total"] == sum(size * (size + 1) / 2 for size in sizes)


def test_the_commit_folders_are_gone_from_every_host(job):
    assert job.left == []
