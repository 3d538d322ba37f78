"""Hierarchical allreduce and allgather across the test bed's hosts, against NumPy.

One job per layout (workers/hierarchical_worker.py runs every case), each case of each
layout its own result:
- ``2x2``: ``-H h1:2,h2:2``, hierarchical;
- ``2+1``: ``-H h1:2,h2:1``, hosts of different sizes, hierarchical; asked for through
  Horovod's ``HOROVOD_HIERARCHICAL_*`` variables instead of the flags;
- ``3x1``: one rank per host, which stays flat with no error;
- ``1x3``: one host, which stays flat with no error.
Each rank's cases print one line each (``case NAME ok``); a case passes when every rank's says ok.
"""
import sys
from types import SimpleNamespace

import pytest

from multihost import hvdrun, worker

FLAGS = ["--hierarchical-allreduce", "--hierarchical-allgather"]
VARIABLES = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
# layout: (hvdrun arguments, extra variables, whether it runs hierarchically)
LAYOUTS = {
    "2x2": (["-np", 4, "-H", "h1:2,h2:2", *FLAGS], {}, True),
    "2+1": (["-np", 3, "-H", "h1:2,h2:1"], VARIABLES, True),
    "3x1": (["-np", 3, "-H", "h1:1,h2:1,h3:1", *FLAGS], {}, False),
    "1x3": (["-np", 3, "-H", "h1:3", *FLAGS], {}, False),
}
CASES = ["sum_float32", "average_float64", "sum_int32_wraps", "min_float32_nan",
         "max_float32_nan", "product_float64", "sum_float16", "sum_bool", "grouped_mixed",
         "allgather_rows", "allgather_float32", "process_set_sum", "identical_on_every_rank"]


# The subject depends on the MPI (its shared-memory split, Gather, Gatherv, Bcast): CI runs
# the layouts that run hierarchically under Open MPI as well (-m mpi); the two that fall back
# to the flat ring (one rank per host, one host) under MPICH only, to keep that pass short.
PARAMS = [pytest.param(name, marks=pytest.mark.mpi if LAYOUTS[name][2] else ())
          for name in LAYOUTS]


@pytest.fixture(scope="module", params=PARAMS)
def job(request, bed):
    """One launch of the worker on a layout: its name, size, expected mode and output."""
    args, env, hierarchical = LAYOUTS[request.param]
    proc = hvdrun(bed, [*args, sys.executable, worker("hierarchical_worker.py")], env=env)
    return SimpleNamespace(layout=request.param, size=args[1], hierarchical=hierarchical,
                           proc=proc)


def lines(job, text):
    """The ranks that printed ``text`` (after their rank prefix)."""
    return [rank for rank in range(job.size) if f"[{rank}]<stdout>:{text}\n" in job.proc.stdout]


def test_the_job_ends_well(job):
    assert job.proc.returncode == 0, f"{job.layout}: {job.proc.stdout}\n{job.proc.stderr}"


def test_hierarchical_where_it_can_pay_and_flat_elsewhere(job):
    mode = "on" if job.hierarchical else "off"
    assert lines(job, f"hierarchical {mode}") == list(range(job.size)), job.proc.stdout


@pytest.mark.parametrize("case", CASES)
def test_case_matches_numpy_on_every_rank(job, case):
    assert lines(job, f"case {case} ok") == list(range(job.size)), \
        "\n".join(line for line in job.proc.stdout.splitlines() if f"case {case} " in line) \
        or job.proc.stdout + job.proc.stderr
