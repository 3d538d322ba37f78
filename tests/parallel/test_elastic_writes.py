"""Elastic commits written in the background, through a rank's death in the middle of the
write: the next life restores a whole commit, the newest that some rank finished.

The restored weights are checked against the NumPy values that the commit of that number
held (``arange(N) + step``), and the job's folders for leftovers of the killed writes.
Commits that vanish between two lives end the job unless a fresh start is allowed, and a
folder that another user made at a name derived from the job's does not end it.
"""
import json
import os
import re
import shutil

import numpy as np
import pytest

from runner import run_ranks

N, K = 1 << 20, 3  # as in workers/elastic_commit_writes.py


def run_job(tmp_path, np_, mode):
    proc = run_ranks("elastic_commit_writes.py", np_, [mode, str(tmp_path)], timeout=240,
                     hvdrun_args=["--min-np", str(np_), "--max-np", str(np_)])
    result = json.loads((tmp_path / "restored.json").read_text())
    weights = np.load(tmp_path / "restored.npy")
    return proc, result, weights


@pytest.mark.parametrize("np_", [3])
def test_a_rank_killed_while_every_rank_writes_commit_k_restarts_from_commit_k_minus_1(
        tmp_path, np_):
    proc, result, weights = run_job(tmp_path, np_, "kill")
    written, whole = map(int, re.search(r"KILLED with (\d+) of more than (\d+) bytes",
                                        proc.stdout).groups())
    assert 0 < written < whole  # the rank died in the middle of its write
    assert "rank 1 exited with code 137" in proc.stderr
    assert result["step"] == K - 1
    np.testing.assert_array_equal(weights, np.arange(N) + (K - 1.0))
    assert result["temporaries"] == []  # the killed writes' files are gone


@pytest.mark.parametrize("np_", [3])
def test_a_rank_failing_right_after_a_commit_finishes_its_write_and_the_job_restarts_there(
        tmp_path, np_):
    proc, result, weights = run_job(tmp_path, np_, "raise")
    assert "RuntimeError: rank 1 fails right after commit K (simulated)" in proc.stderr
    assert result["step"] == K
    np.testing.assert_array_equal(weights, np.arange(N) + float(K))
    assert result["temporaries"] == []


@pytest.mark.parametrize("np_", [3])
def test_a_write_that_fails_on_one_rank_is_raised_on_every_rank_naming_it(tmp_path, np_):
    env = {"HVD_ELASTIC_DIR": str(tmp_path / "commits"), "HVD_JOB_SECRET": "a test secret"}
    proc = run_ranks("elastic_commit_writes.py", np_, ["failed-write", str(tmp_path)], env=env)
    raised = re.findall(r"RAISED at=(\d+): (.*)", proc.stdout)
    assert len(raised) == np_ and len(set(raised)) == 1, proc.stdout
    at, message = raised[0]
    assert int(at) > 1  # commit 1's write fails in the background, after commit 1 returned
    assert re.fullmatch(r"rank 1 could not write commit \d to '.*rank1\.0+\d\.commit' "
                        r"\(\[Errno 5\] simulated I/O error\); check that folder's file system "
                        r"\(free space, permissions\)", message)


def test_a_restart_that_finds_no_commit_after_commits_were_written_ends_the_job(tmp_path):
    proc = run_ranks("elastic_lost_commits.py", 3, ["lost"], check=False,
                     hvdrun_args=["--min-np", "3"])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "LIFE restart=0 step=0" in proc.stdout
    assert "LIFE restart=1" not in proc.stdout and "DONE" not in proc.stdout  # no training again
    output = proc.stdout + proc.stderr
    assert re.search(r"restart 1 of the elastic job finds no commit on any rank, though an "
                     r"earlier life wrote commit [3-5]: the job's commit folders \(.*\) were "
                     r"removed or lost\. Ending the job", output), output
    assert "--elastic-allow-fresh-start" in output


def test_a_restart_that_finds_no_commit_trains_anew_when_a_fresh_start_is_allowed(tmp_path):
    proc = run_ranks("elastic_lost_commits.py", 3, ["lost"],
                     hvdrun_args=["--min-np", "3", "--elastic-allow-fresh-start"])
    assert re.findall(r"LIFE restart=(\d) step=(\d)", proc.stdout) == [("0", "0"), ("1", "0")]
    assert "DONE step=5" in proc.stdout
    assert re.search(r"finds no commit on any rank, though an earlier life wrote commit [3-5].*"
                     r"HVD_ELASTIC_ALLOW_FRESH_START is set: training starts again from the "
                     r"initial state", proc.stderr), proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a folder of another user needs root "
                                               "(run the tests as root, e.g. in the CI container)")
def test_a_folder_another_user_made_at_a_guessable_name_does_not_end_the_job(tmp_path):
    proc = run_ranks("elastic_lost_commits.py", 3, ["planted"], check=False,
                     hvdrun_args=["--min-np", "3"])
    planted = re.search(r"PLANTED (\S+)", proc.stdout)
    if planted:
        shutil.rmtree(planted.group(1), ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert planted and "DONE step=5" in proc.stdout
    assert "belongs to user id" not in proc.stderr
