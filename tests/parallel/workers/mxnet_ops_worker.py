"""Every NDArray collective of hvd_trainer.mxnet on this job's ranks, checked against NumPy.

Each rank's input is regenerated from a seed on every rank, so the reference is computed
with NumPy from the inputs of all ranks, independently of the implementation. Each
section is a case of its own (case_runner.py).
"""
import warnings

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError

import hvd_trainer
import hvd_trainer.mxnet as hvd
from case_runner import run_cases
from hvd_trainer.mxnet import bridge

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
DTYPES = ["float32", "float16", "float64", "int32", "int64", "uint8"]


def data(seed: int, rank: int, shape, dtype="float64", low=-4, high=5) -> np.ndarray:
    """Rank ``rank``'s input for check ``seed``: small integers, exact in every dtype."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(low, high, size=shape).astype(dtype)


def nd(values: np.ndarray, ctx=mx.cpu()) -> mx.nd.NDArray:
    return mx.nd.array(values, ctx=ctx, dtype=values.dtype)


def check(got: mx.nd.NDArray, want: np.ndarray, what: str, rtol=1e-6, ctx=mx.cpu()) -> None:
    assert isinstance(got, mx.nd.NDArray), f"{what}: got {type(got).__name__}"
    assert got.context == ctx, f"{what}: result on {got.context}, expected {ctx}"
    assert got.dtype == np.dtype(want.dtype), f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got.asnumpy().astype(np.float64), want.astype(np.float64),
                               rtol=rtol, atol=0, err_msg=what)


def raises(kind, fragment: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except kind as e:
        assert fragment in str(e), f"{kind.__name__} without {fragment!r}: {e}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__} ({fragment!r})")


def raises_mxnet(kind, fragment: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except MXNetError as e:
        assert isinstance(e, kind), f"{type(e).__name__} is not a {kind.__name__}: {e}"
        assert fragment in str(e), f"{type(e).__name__} without {fragment!r}: {e}"
        return
    raise AssertionError(f"{fn.__name__} did not raise MXNetError ({fragment!r})")


def case_allreduce():
    """allreduce: every op with pre/postscale, in place and out of place"""
    REDUCE = {hvd.Sum: np.sum, hvd.Average: np.mean, hvd.Min: np.min, hvd.Max: np.max,
              hvd.Product: np.prod}
    for seed, (op, ref) in enumerate(REDUCE.items()):
        inputs = [data(seed, r, (3, 5), low=1 if op == hvd.Product else -4) for r in range(SIZE)]
        want = ref(np.stack([x * 0.5 for x in inputs]), axis=0) * 3.0
        x = nd(inputs[RANK])
        out = hvd.allreduce(x, op=op, prescale_factor=0.5, postscale_factor=3.0, name=f"ar{seed}")
        check(out, want, f"allreduce {op.name}")
        check(x, inputs[RANK], f"allreduce {op.name} leaves its input alone")
        view = bridge.read_view(x)  # shares x's memory: shows the in-place write lands there
        assert hvd.allreduce_(x, op=op, prescale_factor=0.5, postscale_factor=3.0) is x
        check(x, want, f"allreduce_ {op.name}")
        np.testing.assert_allclose(view, want)

    # Non-default context: in place writes into the cpu(1) array; out of place stays on cpu(1).
    inputs = [data(10, r, (4, 3)) for r in range(SIZE)]
    x1 = nd(inputs[RANK], mx.cpu(1))
    check(hvd.allreduce(x1, op=hvd.Sum), sum(inputs), "allreduce on cpu(1)", ctx=mx.cpu(1))
    assert hvd.allreduce_(x1) is x1
    check(x1, sum(inputs) / SIZE, "allreduce_ on cpu(1)", ctx=mx.cpu(1))

    # Horovod's deprecated average= flag, and its conflict with op=.
    inputs = [data(11, r, (6,)) for r in range(SIZE)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(hvd.allreduce(nd(inputs[RANK]), average=False), sum(inputs), "average=False")
        check(hvd.allreduce(nd(inputs[RANK]), average=True), sum(inputs) / SIZE, "average=True")
    ours = [w for w in caught if "average=" in str(w.message)]
    assert [w.category for w in ours] == [DeprecationWarning] * 2, [str(w.message) for w in caught]
    raises(ValueError, "op=", hvd.allreduce, nd(inputs[RANK]), average=True, op=hvd.Sum)
    check(hvd.allreduce(nd(inputs[RANK])), sum(inputs) / SIZE, "allreduce averages by default")

    # Every dtype: Sum/Min/Max reduce exactly; allgather and broadcast move bytes unchanged.
    for seed, dtype in enumerate(DTYPES, start=20):
        low = 0 if dtype == "uint8" else -4
        inputs = [data(seed, r, (2, 3), dtype, low=low) for r in range(SIZE)]
        stacked = np.stack(inputs)
        for op, ref in ((hvd.Sum, np.sum), (hvd.Min, np.min), (hvd.Max, np.max)):
            rtol = 1e-3 if dtype == "float16" else 0
            want = ref(stacked, axis=0).astype(dtype)
            check(hvd.allreduce(nd(inputs[RANK]), op=op), want, f"allreduce {op.name} {dtype}", rtol)
            check(hvd.allreduce_(nd(inputs[RANK]), op=op), want, f"allreduce_ {op.name} {dtype}", rtol)
        check(hvd.allgather(nd(inputs[RANK])), np.concatenate(inputs), f"allgather {dtype}")
        check(hvd.broadcast(nd(inputs[RANK]), 1), inputs[1], f"broadcast {dtype}")


def case_grouped_allreduce():
    """grouped allreduce: mixed shapes and dtypes"""
    shapes = [(3,), (2, 2), (5, 1, 2)]
    dtypes = ["float32", "float64", "int32"]
    inputs = [[data(30 + i, r, s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
              for r in range(SIZE)]
    mine = [nd(t) for t in inputs[RANK]]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, prescale_factor=2.0)
    for i, out in enumerate(outs):
        check(out, sum(inp[i] for inp in inputs) * 2, f"grouped_allreduce[{i}]")
        check(mine[i], inputs[RANK][i], f"grouped_allreduce leaves tensors[{i}] alone")
    floats = mine[:2]
    assert hvd.grouped_allreduce_(floats, op=hvd.Max) == floats
    for i, t in enumerate(floats):
        check(t, np.max([inp[i] for inp in inputs], axis=0), f"grouped_allreduce_[{i}]")
    assert hvd.grouped_allreduce([]) == []


def case_allgather():
    """allgather with a different dim 0 on every rank"""
    inputs = [data(40, r, (r + 1, 2, 3)) for r in range(SIZE)]
    check(hvd.allgather(nd(inputs[RANK])), np.concatenate(inputs), "allgather ragged")
    check(hvd.allgather(nd(inputs[RANK], mx.cpu(1))), np.concatenate(inputs),
          "allgather on cpu(1)", ctx=mx.cpu(1))
    second = [data(41, r, (2 * r + 1,), "int64") for r in range(SIZE)]
    gathered = hvd.grouped_allgather([nd(inputs[RANK]), nd(second[RANK])])
    check(gathered[0], np.concatenate(inputs), "grouped_allgather[0]")
    check(gathered[1], np.concatenate(second), "grouped_allgather[1]")


def case_broadcast():
    """broadcast from rank 1"""
    inputs = [data(50, r, (3, 4)) for r in range(SIZE)]
    x = nd(inputs[RANK], mx.cpu(1))
    check(hvd.broadcast(x, root_rank=1), inputs[1], "broadcast root 1", ctx=mx.cpu(1))
    check(x, inputs[RANK], "broadcast leaves its input alone", ctx=mx.cpu(1))
    assert hvd.broadcast_(x, 1) is x
    check(x, inputs[1], "broadcast_ root 1", ctx=mx.cpu(1))


def case_alltoall():
    """alltoall"""
    inputs = [data(60, r, (2 * SIZE, 3)) for r in range(SIZE)]
    out = hvd.alltoall(nd(inputs[RANK]))
    assert isinstance(out, mx.nd.NDArray), "alltoall without splits returns only the output"
    check(out, np.concatenate([inputs[r][2 * RANK:2 * RANK + 2] for r in range(SIZE)]),
          "alltoall equal splits")


    def splits_of(r: int) -> list:
        """Rank r sends (r + j) % 3 rows to rank j."""
        return [(r + j) % 3 for j in range(SIZE)]


    inputs = [data(61, r, (sum(splits_of(r)), 2), "int32") for r in range(SIZE)]
    expect = []
    for r in range(SIZE):
        start = sum(splits_of(r)[:RANK])
        expect.append(inputs[r][start:start + splits_of(r)[RANK]])
    out, received = hvd.alltoall(nd(inputs[RANK]), splits=splits_of(RANK))
    check(out, np.concatenate(expect), "alltoall with splits")
    check(received, np.array([splits_of(r)[RANK] for r in range(SIZE)], np.int32),
          "alltoall received splits")
    out, received = hvd.alltoall(nd(inputs[RANK]), splits=mx.nd.array(splits_of(RANK), dtype="int32"))
    check(out, np.concatenate(expect), "alltoall with NDArray splits")


def case_reducescatter():
    """reducescatter with an odd number of rows: the first ranks take one extra"""
    rows = 2 * SIZE + 1
    shares = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    lo = sum(shares[:RANK])
    inputs = [data(70, r, (rows, 2)) for r in range(SIZE)]
    total = np.sum(inputs, axis=0)
    check(hvd.reducescatter(nd(inputs[RANK])), total[lo:lo + shares[RANK]] / SIZE,
          "reducescatter Average")
    check(hvd.reducescatter(nd(inputs[RANK]), op=hvd.Sum, prescale_factor=2.0),
          2 * total[lo:lo + shares[RANK]], "reducescatter Sum")
    second = [data(71, r, (SIZE, 3), "float32") for r in range(SIZE)]
    outs = hvd.grouped_reducescatter([nd(inputs[RANK]), nd(second[RANK])], op=hvd.Sum)
    check(outs[0], total[lo:lo + shares[RANK]], "grouped_reducescatter[0]")
    check(outs[1], np.sum(second, axis=0)[RANK:RANK + 1], "grouped_reducescatter[1]")

    # Fewer rows than ranks: the last ranks get empty shares; a rank may also gather zero rows.
    inputs = [data(72, r, (1, 2)) for r in range(SIZE)]
    check(hvd.reducescatter(nd(inputs[RANK]), op=hvd.Sum), np.sum(inputs, axis=0)[RANK:RANK + 1],
          "reducescatter with one row")
    inputs = [data(73, r, (r, 2), "int32") for r in range(SIZE)]  # rank 0 contributes no rows
    check(hvd.allgather(nd(inputs[RANK])), np.concatenate(inputs), "allgather with an empty part")


def case_objects():
    """objects"""
    assert hvd.broadcast_object({"from": RANK, "list": [RANK]}, root_rank=1) == {"from": 1, "list": [1]}
    assert hvd.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]


def case_waits_for_pending_writes():
    """waits for pending engine writes"""
    big = mx.nd.ones((300, 300)) * (RANK + 1)
    product = mx.nd.dot(big, big)  # queued in the engine; allreduce must see the finished values
    check(hvd.allreduce(product, op=hvd.Sum), np.full((300, 300), 300.0 * sum(
        (r + 1) ** 2 for r in range(SIZE)), np.float32), "allreduce waits for pending writes")


def case_process_sets():
    """process sets: the first SIZE-1 ranks"""
    members = list(range(SIZE - 1))
    ps = hvd.add_process_set(members)
    inputs = [data(80, r, (5,)) for r in range(SIZE)]
    if RANK in members:
        check(hvd.allreduce(nd(inputs[RANK]), op=hvd.Sum, process_set=ps),
              sum(inputs[r] for r in members), "allreduce in a process set")
        check(hvd.allgather(nd(inputs[RANK]), process_set=ps),
              np.concatenate([inputs[r] for r in members]), "allgather in a process set")
        assert hvd.broadcast_object(RANK, 0, process_set=ps) == 0
    else:
        raises(ValueError, "not a part of process set", hvd.allreduce, nd(inputs[RANK]),
               process_set=ps)
        raises(ValueError, "not a part of process set", hvd.broadcast_, nd(inputs[RANK]), 0,
               process_set=ps)
    assert hvd.remove_process_set(ps)
    raises(ValueError, "not registered", hvd.allreduce, nd(inputs[RANK]), process_set=ps)


def case_bad_input_and_misused_collectives():
    """bad input and misused collectives"""
    inputs = [data(80, r, (5,)) for r in range(SIZE)]
    raises(TypeError, "tensor must be an mxnet NDArray", hvd.allreduce, np.ones(3))
    raises(TypeError, "tensor must be an mxnet NDArray", hvd.broadcast_, np.ones(3), 0)
    sparse = mx.nd.zeros((4, 2)).tostype("row_sparse")
    raises(TypeError, "row_sparse", hvd.allreduce_, sparse)
    raises(TypeError, "tensor has storage type", hvd.allgather, sparse)
    raises(TypeError, "tensors[1]", hvd.grouped_allreduce, [mx.nd.ones(2), np.ones(2)])
    raises(TypeError, "list of NDArrays", hvd.grouped_allreduce_, mx.nd.ones(2))
    shape = (2, 3) if RANK == 0 else (3, 2)
    raises(hvd.MismatchError, "shape", hvd.allreduce, mx.nd.ones(shape), name="mismatch")
    assert hvd.MismatchError is hvd_trainer.MismatchError

    # Misused collectives raise MXNetError, as horovod.mxnet's, and still the core's class.
    raises_mxnet(ValueError, "not divisible", hvd.alltoall, mx.nd.ones((SIZE + 1, 2)))
    raises_mxnet(ValueError, "splits", hvd.alltoall, mx.nd.ones((4, 2)), splits=[1] * SIZE)
    raises_mxnet(hvd.MismatchError, "shape", hvd.allreduce_, mx.nd.ones(shape), name="mismatch2")
    raises_mxnet(hvd.MismatchError, "shape", hvd.grouped_allreduce, [mx.nd.ones(shape)],
                 name="mismatch3")
    raises_mxnet(TypeError, "tensor must be an mxnet NDArray", hvd.allgather, np.ones(3))
    outside = hvd.add_process_set([0])
    if RANK != 0:
        raises_mxnet(ValueError, "not a part of process set", hvd.broadcast_object, 1, 0,
                     process_set=outside)
        raises_mxnet(ValueError, "not a part of process set", hvd.allgather_object, 1,
                     process_set=outside)
    hvd.remove_process_set(outside)
    check(hvd.allreduce(nd(inputs[RANK]), op=hvd.Sum, name="after errors"),
          sum(inputs[r] for r in range(SIZE)), "allreduce after the errors")


run_cases({"allreduce": case_allreduce, "grouped_allreduce": case_grouped_allreduce,
           "allgather": case_allgather, "broadcast": case_broadcast, "alltoall": case_alltoall,
           "reducescatter": case_reducescatter, "objects": case_objects,
           "waits_for_pending_writes": case_waits_for_pending_writes,
           "process_sets": case_process_sets,
           "bad_input_and_misused_collectives": case_bad_input_and_misused_collectives},
          rank=RANK)
