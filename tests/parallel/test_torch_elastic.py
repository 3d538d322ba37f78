"""Elastic hvdrun with PyTorch: TorchState, DistributedOptimizer and the torch ElasticSampler
through a killed rank and a growing host list.

Each run's final weights are checked against a single-process torch replay of the same
global batches with the same world sizes, and each epoch's processed samples against
range(num_samples).
"""
import json
import re
import sys

import numpy as np

from elastic_training import reference_weights
from runner import WORKERS, run_ranks
from test_elastic import assert_each_sample_once_per_epoch, discovery, lives, pids

sys.path.insert(0, WORKERS)


def check_result(path, sizes):
    from elastic_model import EPOCHS, NUM_SAMPLES
    result = json.loads(path.read_text())
    history = result["history"]
    assert len(history) == result["steps"]
    assert [size for _, size, _ in history] == sizes
    assert_each_sample_once_per_epoch(history, NUM_SAMPLES, EPOCHS)
    for got, want in zip(result["weights"], reference_weights(history)):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


def run_job(tmp_path, np, slots, mode):
    """elastic_torch.py on ``np`` ranks, discovery reporting ``slots`` at the start."""
    script = discovery(tmp_path, f"localhost:{slots}")
    return run_ranks("elastic_torch.py", np,
                     [str(tmp_path / "hosts"), str(tmp_path / "out.json"), mode],
                     hvdrun_args=["--min-np", "2", "--max-np", "3",
                                  "--host-discovery-script", script])


def test_killed_rank_torch_job_goes_on_from_last_commit_with_the_weights_of_a_replay(tmp_path):
    proc = run_job(tmp_path, 3, 3, "--kill")
    assert "rank 1 exited with code 137; ending this life of the job" in proc.stderr
    # Killed at step 10 of the first life, after committing step 8 (2 batches into epoch 1):
    # the second life, on the two slots left, starts from step 8 and spreads the 24 samples
    # left of epoch 1 over 2 ranks (6 steps).
    first_life = proc.stdout[:proc.stdout.index("LIFE size=2")]
    assert re.findall(r"COMMITTED step=(\d+)", first_life) == ["4", "8"]
    assert lives(proc.stdout) == [(3, 0), (2, 8)]
    check_result(tmp_path / "out.json", [3] * 8 + [2] * 6)


def test_discovery_grows_the_torch_job_in_place_at_a_commit_mid_epoch(tmp_path):
    proc = run_job(tmp_path, 2, 2, "--grow")
    # Grown after step 3 of epoch 0 (12 of 36 samples): 24 left over 3 ranks (4 steps), then
    # epoch 1 on 3 ranks (6 steps). In place: rank 0 is the same process in both.
    assert lives(proc.stdout) == [(2, 0), (3, 3)]
    assert len(set(pids(proc.stdout))) == 1
    assert "the job grew in place to localhost:2,localhost:1" in proc.stderr
    check_result(tmp_path / "out.json", [2] * 3 + [3] * 10)


def test_any_rank_s_commit_restores_every_rank_s_compression_residuals(tmp_path):
    proc = run_ranks("elastic_torch_residuals.py", 2, [str(tmp_path)])
    assert "RESIDUALS OK" in proc.stdout and "POWERSGD OK" in proc.stdout
