"""The hierarchical allreduce and allgather (backends/hierarchical.py) on hosts made up here,
on one machine: 3 ranks as two "hosts", {0, 2} and {1}, so that a host's ranks are not
consecutive world ranks (a launcher placing ranks round-robin) and the hosts differ in size.
hvdrun always places ranks by slot, so the multi-host bed (tests/multihost) never sees this.

The local communicators are split from the world by those hosts, the cross ones by local
rank, as MPI's shared-memory split would make them on real hosts. Exact ops (integers, bool,
Min/Max with NaN) must equal the flat ring's bits and NumPy's; float sums stay within float
tolerance of NumPy; allgathers must come back in world rank order. Each a case of its own.
"""
import ml_dtypes
import numpy as np

import hvd_trainer as hvd
from case_runner import run_cases
from hvd_trainer.runtime import runtime
from hvd_trainer.backends.hierarchical import HierarchicalCommunicator, hosts_of

hvd.init()
R, N = hvd.rank(), hvd.size()
WORLD = runtime.communicator(hvd.global_process_set)
HOSTS = [[0, 2], [1]]


def member_of(groups):
    """This rank's communicator among ``groups`` (a collective of the world per group)."""
    made = [WORLD.split(ranks) for ranks in groups]
    return next(comm for comm in made if comm is not None)


LOCAL = member_of(HOSTS)
CROSS = member_of([[0, 1], [2]])  # the hosts' first ranks; the second ranks
FIRSTS = [ranks[0] for r in range(N) for ranks in HOSTS if r in ranks]
COMM = HierarchicalCommunicator(WORLD, LOCAL, CROSS, hosts_of(FIRSTS), allreduce=True,
                                allgather=True)
failures = []


def data(rank, count, dtype):
    rng = np.random.default_rng([rank, count])
    kind = np.dtype(dtype).kind
    if kind in "iu":  # the whole range, so that sums and products wrap
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    if kind == "b":
        return rng.random(count) < 0.2
    x = rng.standard_normal(count) * 1e3
    x[rank::5] = np.nan  # NaN on one rank at some places, on several at others
    return x.astype(dtype)


def check_exact(dtype, op, reduce):
    for count in (1, 1000, 300_000):  # one element, a gather in one piece, in several
        mine = data(R, count, dtype)
        got, flat = np.empty_like(mine), np.empty_like(mine)
        COMM.allreduce(mine, op, got)
        WORLD.ring_allreduce(mine, op, flat)
        want = reduce.reduce([data(r, count, dtype) for r in range(N)], dtype=dtype)
        if not (np.array_equal(got, want, equal_nan=True)
                and got.tobytes() == flat.tobytes()):
            failures.append(f"{np.dtype(dtype)} {op} of {count}: differs from NumPy or the ring")


def sum_float(dtype, rtol):
    count = 300_000
    got = data(R, count, dtype)
    COMM.allreduce(got, "sum")  # in place
    want = np.sum([data(r, count, dtype).astype(np.float64) for r in range(N)], axis=0)
    if not np.allclose(got.astype(np.float64), want, rtol=rtol, atol=rtol * 1e3,
                       equal_nan=True):
        failures.append(f"{np.dtype(dtype)} sum: largest error "
                        f"{np.nanmax(np.abs(got.astype(np.float64) - want))}")


def allgather(dtype):
    counts = [1000 * (r + 1) for r in range(N)]
    got = np.empty(sum(counts), dtype)
    COMM.allgatherv(data(R, counts[R], dtype), got, counts)
    if not np.array_equal(got, np.concatenate([data(r, counts[r], dtype) for r in range(N)]),
                          equal_nan=True):
        failures.append(f"allgather of {np.dtype(dtype)}: not in world rank order")


run_cases({
    "int32_sum_wraps_as_the_ring": lambda: check_exact(np.int32, "sum", np.add),
    "int64_product_as_the_ring": lambda: check_exact(np.int64, "prod", np.multiply),
    "uint8_max_as_the_ring": lambda: check_exact(np.uint8, "max", np.maximum),
    "bool_sum_is_or_as_the_ring": lambda: check_exact(np.bool_, "sum", np.logical_or),
    "float32_min_propagates_nan_as_the_ring": lambda: check_exact(np.float32, "min", np.minimum),
    "float16_max_propagates_nan_as_the_ring": lambda: check_exact(np.float16, "max", np.maximum),
    "float64_sum_matches_numpy": lambda: sum_float(np.float64, 1e-12),
    "float16_sum_matches_numpy": lambda: sum_float(np.float16, 4e-3),
    "bfloat16_sum_matches_numpy": lambda: sum_float(ml_dtypes.bfloat16, 3e-2),
    "allgather_in_world_rank_order": lambda: [allgather(d) for d in (np.float32, np.int8)],
}, failures)
