"""hvd_trainer.run (horovod.run) called from a plain process on 3 ranks (2 for killing the
caller): results in rank order against hand-computed values, a collective inside the
function, an exception and an exit on one rank; neither the caller nor the ranks import MXNet
or torch. A caller killed while the job runs takes the job and its files with it."""
import ast
import os
import re
import signal
import subprocess
import sys
import time
from typing import List

import pytest

from runner import WORKERS


def drive(case: str, ranks: int) -> str:
    proc = subprocess.run([sys.executable, os.path.join(WORKERS, "run_driver.py"), case,
                           str(ranks)], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "IMPORTED []" in proc.stdout, proc.stdout
    return proc.stdout


def result(out: str):
    return ast.literal_eval(out.split("RESULT ", 1)[1].splitlines()[0])


@pytest.mark.parametrize("np_", [3])
def test_results_come_back_in_rank_order(np_):
    assert result(drive("times_ten", np_)) == [10 * rank for rank in range(np_)]


@pytest.mark.parametrize("np_", [3])
def test_the_function_runs_collectives_with_its_arguments(np_):
    # Each rank sends rank + 1.0; the sum over ranks, times scale=2.0, on every rank.
    total = sum(rank + 1.0 for rank in range(np_)) * 2.0
    assert result(drive("allreduce", np_)) == [(total, [])] * np_


@pytest.mark.parametrize("np_", [3])
def test_an_exception_on_one_rank_raises_in_the_caller_naming_the_rank(np_):
    out = drive("raises", np_)
    assert "RAISED EngineError: hvd_trainer.run: raises_on_rank_1 raised on rank 1:" in out
    assert "ValueError: rank 1 found a bad batch" in out  # the rank's traceback
    assert "| CAUSE ValueError('rank 1 found a bad batch')" in out


def test_horovod_true_gives_the_function_horovod_and_without_it_there_is_none():
    # 1 + 2 + 3 summed over 3 ranks; hvd_trainer.run is horovod.run inside.
    assert result(drive("horovod", 3)) == [("0.28.1", True, 6.0)] * 3
    out = drive("no_horovod", 3)
    assert "RAISED EngineError: hvd_trainer.run: horovod_root raised on rank" in out
    assert "ModuleNotFoundError: No module named 'horovod'" in out


@pytest.mark.parametrize("np_", [3])
def test_a_rank_that_exits_without_a_result_is_named(np_):
    out = drive("exits", np_)
    # Rank 2 returns at once, but hvdrun may end it first.
    assert re.search(r"RAISED EngineError: hvd_trainer.run: \w+: ranks? 1(, 2)? ended without a "
                     r"result; hvdrun exited with code 3", out), out


def descendants(pid: int) -> List[int]:
    """``pid``'s children, theirs, and so on, from /proc."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}") else []:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    kids = [int(kid) for kid in children.read().split()]
            except FileNotFoundError:
                continue
            found += kids
            todo += kids
    return found


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("np_", [2])
def test_killing_the_caller_ends_the_job_and_removes_its_files(tmp_path, np_):
    report = tmp_path / "report"
    report.mkdir()
    with open(tmp_path / "caller.log", "w") as log:
        caller = subprocess.Popen([sys.executable, os.path.join(WORKERS, "run_driver.py"),
                                   "sleeps", str(np_)], stdout=log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, OMP_NUM_THREADS="1",
                                           RUN_REPORT=str(report)))
    job: List[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(list(report.glob("rank?"))) < np_:
            assert caller.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "caller.log").read_text()
            time.sleep(0.1)
        notes = [(report / f"rank{rank}").read_text().split() for rank in range(np_)]
        folder = notes[0][1]
        job = descendants(caller.pid)  # hvdrun, mpiexec, the wrappers, the ranks
        assert {int(pid) for pid, _ in notes} <= set(job) and os.path.isdir(folder)
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in job) or os.path.exists(folder):
            assert time.monotonic() < deadline, (
                f"still running: {[pid for pid in job if running(pid)]}; folder "
                f"{folder} {'still there' if os.path.exists(folder) else 'gone'}")
            time.sleep(0.1)
    finally:
        for pid in job:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
