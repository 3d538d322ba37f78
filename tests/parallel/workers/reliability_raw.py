"""Fault injection on NumPy collectives; the first argument picks the case.

checks       agreement details that must hold and carry on: flags or-ed in the agreement
             (inline and beyond it), ranks in different kinds of collective, barrier
dtype        rank 1 allreduces float64, the others float32: uncaught MismatchError
root         the last rank broadcasts from another root: uncaught MismatchError
exit CODE    rank 1 calls sys.exit(CODE) while the others enter an allreduce
caught       rank 1 catches its own sys.exit(3) and carries on; the job ends normally
stall        rank 1 sleeps before an allreduce the others already wait in
hang         rank 1 sleeps far longer than the stall shutdown time
"""
import sys
import time

import numpy as np

import hvd_trainer as hvd
from hvd_trainer.coordination import agreement, records
from hvd_trainer.runtime import runtime

case = sys.argv[1]
R, N = hvd.rank(), hvd.size()
last = N - 1
hvd.allreduce(np.ones(2), name="warmup")

if case == "checks":
    comm = runtime.communicator(hvd.global_process_set)
    for count in (10, 64 * records.INLINE_FLAG_WORDS + 100):
        mine = np.zeros(count, bool)
        mine[R::N + 1] = True  # rank r sets flags r, r + N + 1, ...; the last of each N + 1 stays off
        got = agreement.agree(comm, lambda: {"kind": "flags", "name": f"f{count}"}, mine)
        expected = np.zeros(count, bool)
        for r in range(N):
            expected[r::N + 1] = True
        assert np.array_equal(got, expected), (count, np.flatnonzero(got != expected))
    try:
        if R == last:
            hvd.broadcast(np.zeros(3), root_rank=0, name="x")
        else:
            hvd.allreduce(np.zeros(3), name="x")
        raise AssertionError("ranks in different collectives did not raise")
    except hvd.MismatchError as e:
        assert "ranks disagree on kind" in str(e) and f"rank {last}: 'broadcast'" in str(e), e
        print(f"rank {R} caught: {e}")
    hvd.barrier()
    assert hvd.allreduce(np.ones(3), op=hvd.Sum).tolist() == [N] * 3
    print(f"rank {R}: agreement checks passed")
elif case == "dtype":
    hvd.allreduce(np.zeros(4, np.float64 if R == 1 else np.float32), name="grad.7")
elif case == "root":
    hvd.broadcast(np.zeros(3), root_rank=1 if R == last else 0, name="weights")
elif case == "exit":
    if R == 1:
        sys.exit(int(sys.argv[2]))
    hvd.allreduce(np.ones(2), name="after exit")
elif case == "caught":
    if R == 1:
        try:
            sys.exit(3)
        except SystemExit as e:
            print(f"rank {R} caught sys.exit({e.code})")
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [N] * 2
elif case == "stall":
    if R == 1:
        time.sleep(3)
    hvd.allreduce(np.ones(2), name="late")
    print(f"rank {R}: stall over")
elif case == "hang":
    if R == 1:
        time.sleep(120)
    hvd.allreduce(np.ones(2), name="never")
else:
    raise SystemExit(f"unknown case {case!r}")
