"""Slurm on the test bed (Debian's slurm-wlm: slurmctld on h1, slurmd on h1..h3, munge):
``srun -N 2 -n 4 python train.py`` and ``sbatch`` with hvdrun inside the allocation. Nothing
is set by hand but SLURM_CONF, which stands for the cluster's /etc/slurm/slurm.conf; the
ranks' places are checked against Slurm's by-node layout (2 tasks on each of 2 nodes).
"""
import glob
import json
import os
import sys
import tempfile
import time

import pytest

import testbed
from multihost import environment, expected_layout, hvdrun_command, worker

LAYOUT = expected_layout([("h1", 2), ("h2", 2)])
KEYS = ("host", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


@pytest.fixture(scope="module")
def slurm(bed):
    """Slurm's variables for the bed, and how many seconds it took to start."""
    reason = testbed.slurm_unavailable()
    if reason:
        pytest.skip(reason)
    start = time.monotonic()
    env = bed.start_slurm()
    return env, time.monotonic() - start


def reports(text):
    """The layout worker's reports, by rank."""
    found = {}
    for line in text.splitlines():
        if "layout " in line:
            report = json.loads(line.split("layout ", 1)[1])
            found[report["rank"]] = report
    return [found[rank] for rank in sorted(found)]


def test_srun_starts_the_ranks_on_the_nodes_of_the_allocation(bed, slurm):
    # MPICH speaks PMI-2 (the bed's default), Open MPI 5 PMIx, which Slurm's plugin finds in
    # libpmix-dev.
    from mpi4py import MPI
    pmi = "pmix" if "Open MPI" in MPI.Get_library_version() else "pmi2"
    if pmi == "pmix" and not glob.glob("/usr/lib/*/libpmix.so"):
        pytest.skip("srun --mpi=pmix needs libpmix.so for Slurm's PMIx plugin "
                    "(apt-get install libpmix-dev)")
    env, _ = slurm
    proc = bed.run("h1", ["srun", f"--mpi={pmi}", "-N", "2", "-n", "4", sys.executable,
                          worker("layout_worker.py")], cwd=bed.shared,
                   env=environment(env), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [{key: r[key] for key in KEYS} for r in reports(proc.stdout)] == LAYOUT
    assert proc.stdout.count("collectives match NumPy") == 4


def test_hvdrun_inside_sbatch_places_the_ranks_and_sets_horovods_variables(bed, slurm):
    env, _ = slurm
    out = os.path.join(tempfile.mkdtemp(dir=bed.shared), "job.out")
    script = " ".join(hvdrun_command(["-np", 4, sys.executable, worker("layout_worker.py")]))
    proc = bed.run("h1", ["sbatch", "--wait", "-N", "2", "-n", "4", "-o", out, "--wrap", script],
                   cwd=bed.shared, env=environment(env), capture_output=True, text=True,
                   timeout=180)
    with open(out) as f:
        text = f.read()
    assert proc.returncode == 0, proc.stderr + text
    got = reports(text)
    assert [{key: r[key] for key in KEYS} for r in got] == LAYOUT
    assert [r["env"]["HOROVOD_LOCAL_RANK"] for r in got] == ["0", "1", "0", "1"]
    assert [r["env"]["HOROVOD_CROSS_RANK"] for r in got] == ["0", "0", "1", "1"]
    assert "warning" not in text and text.count("collectives match NumPy") == 4


def test_slurm_starts_within_a_minute(slurm):
    # Why it runs in CI at all (the rule); the figure goes to the report.
    _, seconds = slurm
    print(f"Slurm started in {seconds:.1f} s")
    assert seconds < 60
