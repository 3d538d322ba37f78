"""One rank gives an NDArray collective a bad argument; every rank must raise the same error
(an MXNetError that is also the ValueError or TypeError), and the next collective must work.

Each case names the collective, what the last rank passes, what the others pass, and the
error. After each case a correct allreduce checks that the ranks are still in step (its result
is compared with NumPy). Each is a case of its own (case_runner.py).
"""
import functools

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError

import hvd_trainer.mxnet as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
LAST = SIZE - 1
good = mx.nd.ones((SIZE * 2, 3))
sparse = mx.nd.ones((SIZE * 2, 3)).tostype("row_sparse")


def mine(bad, fine):
    """The last rank's argument is ``bad``, every other rank's ``fine``."""
    return bad if RANK == LAST else fine


CASES = {
    "allreduce": (lambda: hvd.allreduce(mine(sparse, good), name="c1"), TypeError, "storage type"),
    "allreduce_": (lambda: hvd.allreduce_(mine(np.ones(3), good), name="c2"), TypeError,
     "mxnet NDArray"),
    "allreduce op": (lambda: hvd.allreduce(good, op=mine(7, hvd.Sum), name="c3"), ValueError,
     "op=7"),
    "allreduce average and op": (lambda: hvd.allreduce(
        good, average=mine(True, None), op=hvd.Sum, name="c4"), ValueError, "either op="),
    "grouped_allreduce": (lambda: hvd.grouped_allreduce(mine(good, [good]), name="c5"),
     TypeError, "list of NDArrays"),
    "grouped_allreduce_ empty": (lambda: hvd.grouped_allreduce_(mine([sparse], []), name="c6"),
     TypeError, "storage type"),
    "allgather": (lambda: hvd.allgather(mine(mx.nd.array(1.0).reshape(()), good), name="c7"),
     ValueError, "at least one dimension"),
    "broadcast root": (lambda: hvd.broadcast(good, root_rank=mine(SIZE, 0), name="c8"),
     ValueError, f"root_rank={SIZE}"),
    "broadcast_": (lambda: hvd.broadcast_(mine(sparse, good), 0, name="c9"), TypeError,
     "storage type"),
    "alltoall indivisible": (lambda: hvd.alltoall(mine(mx.nd.ones((SIZE * 2 + 1, 3)), good),
                                                  name="c10"), ValueError, "not divisible"),
    "alltoall splits sum": (lambda: hvd.alltoall(good, splits=mine([1] * SIZE, [2] * SIZE),
                                                 name="c11"), ValueError, "summing"),
    "alltoall float splits": (lambda: hvd.alltoall(good, splits=mine([2.0] * SIZE, [2] * SIZE),
                                                   name="c12"), TypeError, "integers"),
    "reducescatter": (lambda: hvd.reducescatter(mine(sparse, good), name="c13"), TypeError,
     "storage type"),
    "grouped_allgather": (lambda: hvd.grouped_allgather(mine([good, sparse], [good, good]),
                                                        name="c14"), TypeError, "storage type"),
}


def bad_argument(what):
    call, kind, words = CASES[what]
    i = list(CASES).index(what)
    try:
        call()
    except MXNetError as e:
        assert isinstance(e, kind), f"{what}: {type(e).__mro__} is not a {kind.__name__}"
        assert words in str(e) and f"on rank {LAST}" in str(e), f"{what}: {e}"
    else:
        raise AssertionError(f"{what}: rank {RANK} did not raise")
    after = hvd.allreduce(mx.nd.full((2,), RANK + i), op=hvd.Sum, name=f"after.{i}")
    want = sum(r + i for r in range(SIZE))
    assert after.asnumpy().tolist() == [want, want], f"after {what}: {after.asnumpy()}"


run_cases({**{what: functools.partial(bad_argument, what) for what in CASES}}, rank=RANK)
