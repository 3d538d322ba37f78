"""hvd_trainer.run (horovod.run) called from a plain process on 2 and 3 ranks: results in
rank order against hand-computed values, a collective inside the function, an exception and
an exit on one rank; neither the caller nor the ranks import MXNet or torch."""
import ast
import os
import re
import subprocess
import sys

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


@pytest.mark.parametrize("np_", [2, 3])
def test_results_come_back_in_rank_order(np_):
    assert result(drive("times_ten", np_)) == [10 * rank for rank in range(np_)]


@pytest.mark.parametrize("np_", [2, 3])
def test_the_function_runs_collectives_with_its_arguments(np_):
    # Each rank sends rank + 1.0; the sum over ranks, times scale=2.0, on every rank.
    total = sum(rank + 1.0 for rank in range(np_)) * 2.0
    assert result(drive("allreduce", np_)) == [(total, [])] * np_


@pytest.mark.parametrize("np_", [2, 3])
def test_an_exception_on_one_rank_raises_in_the_caller_naming_the_rank(np_):
    out = drive("raises", np_)
    assert "RAISED RuntimeError: hvd_trainer.run: raises_on_rank_1 raised on rank 1:" in out
    assert "ValueError: rank 1 found a bad batch" in out  # the rank's traceback
    assert "| CAUSE ValueError('rank 1 found a bad batch')" in out


def test_horovod_true_gives_the_function_horovod_and_without_it_there_is_none():
    # 1 + 2 + 3 summed over 3 ranks; hvd_trainer.run is horovod.run inside.
    assert result(drive("horovod", 3)) == [("0.28.1", True, 6.0)] * 3
    out = drive("no_horovod", 3)
    assert "RAISED RuntimeError: hvd_trainer.run: horovod_root raised on rank" in out
    assert "ModuleNotFoundError: No module named 'horovod'" in out


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_exits_without_a_result_is_named(np_):
    out = drive("exits", np_)
    # Rank 2 returns at once, but hvdrun may end it first.
    assert re.search(r"RAISED RuntimeError: hvd_trainer.run: ranks? 1(, 2)? ended without a "
                     r"result; hvdrun exited with code 3", out), out
