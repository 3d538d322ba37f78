"""Elastic hvdrun: a killed rank, a growing and shrinking host list, and the limits.

Each run's result is checked against an independent reference: the Gluon weights against a
single-process replay of the same global batches, the sums against NumPy, and the processed
samples of each epoch against range(num_samples).
"""
import json
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from hvd_trainer_launch import mpi
from runner import WORKERS, run_ranks

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi

sys.path.insert(0, WORKERS)


def discovery(tmp_path, hosts: str) -> str:
    """A discovery script that prints the hosts file (which the workers rewrite)."""
    (tmp_path / "hosts").write_text(hosts + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    return str(script)


def lives(stdout: str):
    """(size, step) at the start of each life, as rank 0 printed them."""
    found = re.findall(r"LIFE size=(\d+) step=(\d+)", stdout)
    return [(int(size), int(step)) for size, step in found]


def pids(stdout: str):
    """Rank 0's process at the start of each life (LIFE lines with pid=)."""
    return [int(pid) for pid in re.findall(r"LIFE size=\d+ step=\d+ pid=(\d+)", stdout)]


def assert_each_sample_once_per_epoch(history, num_samples, epochs):
    for epoch in range(epochs):
        seen = [i for e, _, batches in history if e == epoch for batch in batches for i in batch]
        assert sorted(seen) == list(range(num_samples)), f"epoch {epoch}: {sorted(seen)}"


def reference_weights(history):
    """Replay the global batches in one process with a plain gluon.Trainer: each step's
    gradient is the sum over the global batch divided by the number of ranks, as the
    DistributedTrainer's step(1) makes it."""
    import mxnet as mx
    from elastic_model import data, make_net
    X, Y = data()
    net = make_net()
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd",
                               {"learning_rate": 0.05, "momentum": 0.9})
    for _, size, batches in history:
        batch = [i for part in batches for i in part]
        with mx.autograd.record():
            loss = ((net(mx.nd.array(X[batch])) - mx.nd.array(Y[batch])) ** 2).sum()
        loss.backward()
        trainer.step(size)
    return [p.data().asnumpy() for p in net.collect_params().values()]


def test_killed_rank_job_goes_on_from_last_commit_with_the_weights_of_a_replay(tmp_path):
    from elastic_model import EPOCHS, NUM_SAMPLES
    script = discovery(tmp_path, "localhost:3")
    proc = run_ranks("elastic_gluon.py", 3, [str(tmp_path / "hosts"), str(tmp_path / "out.json")],
                     hvdrun_args=["--min-np", "2", "--max-np", "3",
                                  "--host-discovery-script", script])
    assert "rank 1 exited with code 137; ending this life of the job" in proc.stderr
    first_life = proc.stdout[:proc.stdout.index("LIFE size=2")]
    last_commit = max(int(k) for k in re.findall(r"COMMITTED step=(\d+)", first_life))
    # Killed at step 10 of the first life, after committing step 8: the second life, on the
    # two slots left, starts from step 8 exactly.
    assert lives(proc.stdout) == [(3, 0), (2, 8)] and last_commit == 8
    result = json.loads((tmp_path / "out.json").read_text())
    history = result["history"]
    assert len(history) == result["steps"]
    assert [size for _, size, _ in history] == [3] * 8 + [2] * (len(history) - 8)
    assert_each_sample_once_per_epoch(history, NUM_SAMPLES, EPOCHS)
    for got, want in zip(result["weights"], reference_weights(history)):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


def test_discovery_grows_the_job_at_a_commit_and_shrinks_it_at_a_check(tmp_path):
    script = discovery(tmp_path, "localhost:2")
    proc = run_ranks("elastic_resize.py", 2, [str(tmp_path / "hosts"), str(tmp_path / "out.json")],
                     hvdrun_args=["--min-np", "2", "--max-np", "3",
                                  "--host-discovery-script", script])
    # Each start of the training function is at the step where the hosts file changed:
    # nothing committed is lost. Both changes are in place (the ranks keep their processes)
    # under MPICH; under Open MPI, whose MPI_Finalize would hold a leaving rank until the
    # others end, the shrink restarts every rank.
    changed_at = [int(k) for k in re.findall(r"HOSTS localhost:\d step=(\d+)", proc.stdout)]
    assert lives(proc.stdout) == [(2, 0), (3, changed_at[0]), (2, changed_at[1])]
    first, grown, shrunk = pids(proc.stdout)
    assert proc.stderr.count("hosts changed to") == 2
    assert "the ranks grow the job in place onto localhost:1" in proc.stderr
    if mpi.find_launcher().flavour == mpi.HYDRA:
        assert grown == first == shrunk
        assert "at their next commit rank 2 leave the job, the others go on in place" \
            in proc.stderr
        assert "rank 0: shrank the job in place from 3 to 2 ranks" in proc.stderr
    else:
        assert grown == first != shrunk
    result = json.loads((tmp_path / "out.json").read_text())
    data = np.arange(30) + 1.0
    assert result["total"] == 2 * data.sum()
    # The gradients summed through the ArrayReducer, row-sparse kind agreed before the growth:
    # every sample twice, its value in both columns, the sparse one in row i % 5.
    want = np.zeros((6, 2))
    want[0] = 2 * data.sum()
    np.add.at(want[1:], np.arange(30) % 5, 2 * np.stack([data, data], 1))
    np.testing.assert_allclose(result["reduced"], want)
    assert_each_sample_once_per_epoch(result["history"], 30, 2)


def test_fewer_slots_than_min_np_for_the_elastic_timeout_ends_the_job(tmp_path):
    script = discovery(tmp_path, "localhost:1")
    proc = run_ranks("elastic_failing.py", 2, check=False, timeout=60,
                     hvdrun_args=["--min-np", "2", "--host-discovery-script", script,
                                  "--elastic-timeout", "1"])
    assert proc.returncode == 1
    # run_ranks passes -np 2: the first life waits for that many slots.
    assert ("only 1 usable slots (localhost:1) for --elastic-timeout 1 s, fewer than -np 2; "
            "ending the job") in proc.stderr
    assert "LIFE" not in proc.stdout


@pytest.mark.parametrize("flags, ending", [
    (["--reset-limit", "1"], ["the job needs restart 2, over --reset-limit 1; ending the job"]),
    (["--elastic-timeout", "600"],  # every host left out: no point in waiting
     ["host localhost failed in 2 lives in a row; leaving it out",
      "every discovered host is left out: localhost (its ranks failed in 2 lives in a row; "
      "out for the rest of the job); ending the job"]),
])
def test_a_rank_that_keeps_failing_ends_the_job_after_two_lives(flags, ending):
    proc = run_ranks("elastic_failing.py", 2, check=False, timeout=60,
                     hvdrun_args=["--min-np", "2", *flags])
    assert proc.returncode == 1
    assert re.findall(r"LIFE restart=(\d+)", proc.stdout) == ["0", "1"]
    assert "HorovodInternalError: rank 1 lost its peer (simulated)" in proc.stderr
    for line in ending:
        assert line in proc.stderr


def test_sigterm_while_waiting_for_slots_ends_hvdrun_with_128_plus_15(tmp_path):
    script = discovery(tmp_path, "localhost:1")
    hvdrun = subprocess.Popen(
        [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "--min-np", "2",
         "--host-discovery-script", script, sys.executable, "-c", "pass"],
        stderr=subprocess.PIPE, text=True)
    # Once it says it waits for a second slot (should it hang silent, at 60 s: the asserts
    # below then say what it did not say).
    fallback = threading.Timer(60, hvdrun.send_signal, [signal.SIGTERM])
    fallback.start()
    said = ""
    for line in hvdrun.stderr:
        said += line
        if "waiting up to" in line:
            break
    fallback.cancel()
    hvdrun.send_signal(signal.SIGTERM)
    _, rest = hvdrun.communicate(timeout=30)
    err = said + rest
    assert hvdrun.returncode == 128 + signal.SIGTERM, err
    assert "waiting up to 600 s for more" in err
    assert "received SIGTERM between two lives; ending the job" in err


def exiting(tmp_path, codes: str) -> str:
    """A rank that exits at once with ``codes[rank]`` (a Python expression over ``rank``)."""
    path = tmp_path / "exiting.py"
    path.write_text("import os, sys\n"
                    "rank = int(os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK'])\n"
                    f"sys.exit({codes})\n")
    return str(path)


OPEN_MPI = mpi.library_flavour(mpi.mpi_library()[0]) == mpi.OPENMPI


@pytest.mark.skipif(OPEN_MPI, reason="Open MPI's launcher kills the other ranks at the first "
                    "exit with a code, at times before their wrappers report their own exits (2 "
                    "of 7 jobs here), so a life does not always show every rank failing")
@pytest.mark.parametrize("np_", [2])
def test_a_life_in_which_every_rank_fails_ends_the_job_at_once(tmp_path, np_):
    script = discovery(tmp_path, "localhost:1\n127.0.0.1:1")
    proc = run_ranks(exiting(tmp_path, "3"), np_, check=False, timeout=60,
                     hvdrun_args=["--min-np", "2", "--host-discovery-script", script,
                                  "--elastic-timeout", "20"])
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("starting 2 ranks") == 1
    assert ("every rank failed in this life (rank 0: code 3, rank 1: code 3); ending the job"
            in proc.stderr)


@pytest.mark.parametrize("np_", [4])
def test_the_job_starts_on_every_slot_up_to_max_np_and_ends_when_every_host_is_out(tmp_path,
                                                                                    np_):
    """-np 2 --max-np 4 with 4 slots: all 4 are used (Horovod's meaning). One rank of each
    host fails in every life: each life counts against the host of the earlier exit, the
    other host's row goes on unbroken, so within a few lives both are out and the job ends
    at once, naming them, instead of waiting for other hosts."""
    script = discovery(tmp_path, "localhost:2\n127.0.0.1:2")
    proc = run_ranks(exiting(tmp_path, "rank % 2"), 2, check=False, timeout=60,
                     hvdrun_args=["--min-np", "2", "--max-np", str(np_),
                                  "--host-discovery-script", script, "--elastic-timeout", "20"])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("starting 4 ranks on localhost:2,127.0.0.1:2") in (2, 3)
    reason = "its ranks failed in 2 lives in a row; out for the rest of the job"
    assert (f"every discovered host is left out: localhost ({reason}), 127.0.0.1 ({reason}); "
            "ending the job") in proc.stderr
    assert "waiting up to" not in proc.stderr


@pytest.mark.skipif(OPEN_MPI, reason="under Open MPI the aborting rank's wrapper reports its "
                    "code, so its host is blamed, as in "
                    "test_a_rank_that_keeps_failing_ends_the_job_after_two_lives")
def test_lives_that_fail_with_nobody_to_blame_end_the_job_after_two(tmp_path):
    """Rank 0 calls MPI_Abort itself: MPICH's launcher kills every rank before any reports,
    so no host can be left out; the job restarted every 2 s until the test's timeout."""
    path = tmp_path / "aborting.py"
    path.write_text("import time\nfrom mpi4py import MPI\n"
                    "if MPI.COMM_WORLD.Get_rank() == 0:\n    MPI.COMM_WORLD.Abort(3)\n"
                    "time.sleep(60)\n")
    proc = run_ranks(str(path), 2, check=False, timeout=60, hvdrun_args=["--min-np", "2"])
    assert proc.returncode == 3, proc.stderr
    assert re.findall(r"starting 2 ranks on localhost:2( \(restart 1\))?\n", proc.stderr) == [
        "", " (restart 1)"], proc.stderr
    assert ("2 lives in a row failed without a rank's own failure to blame a host for (the "
            "launcher's code: 3); ending the job") in proc.stderr


def test_a_reset_over_the_reset_limit_exits_with_a_failure_code(tmp_path):
    """Every rank leaves for new hosts (the reset exit code): that restart is one too many."""
    proc = run_ranks(exiting(tmp_path, "75"), 2, check=False, timeout=60,
                     hvdrun_args=["--min-np", "2", "--reset-limit", "0"])
    assert proc.returncode == 1, proc.stderr
    assert "the job needs restart 1, over --reset-limit 0; ending the job" in proc.stderr
