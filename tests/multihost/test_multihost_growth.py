"""Elastic hvdrun across hosts, growing: a job on h1 and h2 (workers/elastic_hosts.py) whose
discovery adds h3 after a few steps.

Under MPICH the job grows in place: the ranks on h1 and h2 keep their processes and Hydra
starts h3's rank through ssh from inside the job; under Open MPI, whose mpirun can give a new
rank its variables only on its own host, every rank restarts on the three hosts. Either way
the sums are those of every step at its world size, nothing committed is lost, and the commit
folders are gone from every host at the end, h3's included.
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
        out, err = proc.communicate(timeout=300)
    job_dir = re.search(r"FOLDER (\S+)", out)[1]
    left = [host for host in bed.hosts if bed.run(host, ["test", "-e", job_dir]).returncode == 0]
    return SimpleNamespace(code=proc.returncode, out=out, err=err, before=before, after=after,
                           left=left, folder=folder)


def test_the_job_ends_well_on_the_three_hosts(job):
    assert job.code == 0, job.err
    assert [(size, hosts) for size, _, hosts, _ in committed(job.out)] == \
        [(2, "h1,h2"), (3, "h1,h2,h3")], job.out


def test_under_mpich_the_ranks_of_h1_and_h2_keep_their_processes(job):
    kept = [job.before[host]["pid"] == job.after[host]["pid"] for host in ("h1", "h2")]
    if mpi.find_launcher().flavour == mpi.HYDRA:
        assert kept == [True, True], (job.before, job.after)
        assert "the ranks grow the job in place onto h3:1" in job.err
        assert "the job grew in place to h1:1,h2:1,h3:1" in job.err
    else:
        assert kept == [False, False], (job.before, job.after)
        assert "the ranks restart on them at their next commit" in job.err


def test_the_grown_job_goes_on_from_the_commit_it_grew_at(job):
    (small, _, _, printed), (large, grown_at, _, end) = committed(job.out)
    # The commit that took the change raised HostsUpdatedInterrupt before rank 0 could print
    # it: the grown job starts one step after the last commit printed.
    assert grown_at == printed + 1 and end == STEPS
    with open(os.path.join(job.folder, "result.json")) as f:
        result = json.load(f)
    sizes = [small] * grown_at + [large] * (STEPS - grown_at)
    assert result["sizes"] == sizes
    assert result["total"] == sum(size * (size + 1) / 2 for size in sizes)


def test_the_commit_folders_are_gone_from_every_host(job):
    assert job.left == []
