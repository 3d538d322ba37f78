"""The CPU stand-in for CuPy and NCCL fails where a GPU program's ordering or arguments are
wrong (workers/standin_worker.py): a check of the stand-in itself, so it runs on it alone."""
import os
import subprocess
import sys

import pytest

from gpu import KINDS, STANDIN, names, one_rank_job


@pytest.mark.parametrize("case", names("standin_worker.py"))
def test_the_standin_fails_where_a_gpu_program_is_wrong(case):
    if "standin" not in KINDS:
        pytest.skip("HVD_TEST_GPU_KINDS leaves the stand-in out")
    one_rank_job("standin").check(case)


# A cycle that holds a Memory waits for the collector; each threshold sets the collection off
# at another allocation of the next call, some of them under the pool's lock.
_GC_UNDER_THE_LOCK = """
import gc
import numpy as np
from cupy.cuda import memory
host = np.zeros(64, np.uint8)
memory.pin(host)
for threshold in range(1, 40):
    for call in (lambda: memory.Memory(512, 0, 0), lambda: memory.is_pinned(host)):
        gc.disable()
        gc.collect()
        cycle = [memory.Memory(512, 0, 0)]
        cycle.append(cycle)
        del cycle
        gc.set_threshold(threshold)
        gc.enable()
        call()
print("done")
"""


def test_a_collection_under_the_pools_lock_does_not_deadlock_it():
    # A cycle's Memory.__del__ ran in a collection that an allocation under the pool's lock
    # (is_pinned's generator, an allocation's key) set off, on the same thread: with a plain
    # Lock the rank hung (CI lost a 3-rank GPU job to it once the jobs' imports changed when
    # collections came).
    done = subprocess.run([sys.executable, "-c", _GC_UNDER_THE_LOCK], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=STANDIN))
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
