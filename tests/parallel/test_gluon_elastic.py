"""Elastic hvdrun with Gluon's 2-bit compression: the error-feedback residuals a restart
restores. What a life keeps does not depend on the MPI, so unlike test_elastic.py (the
launches, which CI runs under Open MPI too) it runs under MPICH alone.
"""
import json

import numpy as np

from runner import run_ranks
from test_elastic import discovery, lives


def test_restart_on_as_many_ranks_restores_the_compression_residuals_exactly(tmp_path):
    """2-bit compression with error feedback: killed and restarted on 3 ranks, the job ends
    with the weights of the same job run without the kill (same batches, as the sampler
    splits what is left the same way on as many ranks)."""
    script = discovery(tmp_path, "localhost:3")
    flags = ["--min-np", "2", "--max-np", "3", "--host-discovery-script", script]
    results = {}
    for run in ("--keep-slot", "--no-kill"):
        out = tmp_path / f"{run}.json"
        proc = run_ranks("elastic_gluon.py", 3, [str(tmp_path / "hosts"), str(out), "--2bit", run],
                         hvdrun_args=flags)
        results[run] = json.loads(out.read_text())
        assert len(lives(proc.stdout)) == (2 if run == "--keep-slot" else 1)
    killed, whole = results["--keep-slot"], results["--no-kill"]
    assert killed["history"] == whole["history"]
    for got, want in zip(killed["weights"], whole["weights"]):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-7)
