"""Every tensor collective of hvd_trainer.torch on this job's ranks, against NumPy.

Each rank's input is regenerated from a seed on every rank, so the reference is computed with
NumPy from all ranks' inputs, independently of the implementation. Covers every dtype Horovod
takes, the async handles, sparse tensors, and argument errors made on one rank only.
Each section is a case of its own (case_runner.py).
"""
import numpy as np
import torch

import hvd_trainer
import hvd_trainer.torch as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]


def data(seed: int, rank: int, shape, low=-4, high=5) -> np.ndarray:
    """Rank ``rank``'s input for check ``seed``: small integers, exact in every dtype."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(low, high, size=shape).astype(np.float64)


def as_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor (never sharing ``values``' memory) of ``dtype``."""
    return torch.tensor(values).to(dtype)


# Where a result may round differently from the float64 reference (Average's 1/size).
RTOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-12}


def check(got: torch.Tensor, want: np.ndarray, what: str, dtype: torch.dtype = None) -> None:
    """``got`` has ``dtype`` and, converted to float64, equals ``want`` (computed in float64,
    then rounded to ``dtype`` like the result)."""
    rtol = RTOL.get(dtype, 0.0)
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    if dtype is not None:
        assert got.dtype == dtype, f"{what}: dtype {got.dtype} != {dtype}"
        want = as_torch(np.asarray(want, np.float64), dtype).to(torch.float64).numpy()
    assert tuple(got.shape) == np.shape(want), f"{what}: shape {tuple(got.shape)} != {np.shape(want)}"
    np.testing.assert_allclose(got.to(torch.float64).numpy(), want, rtol=rtol, atol=0,
                               err_msg=what)


def raises(kind, fragments, fn, *args, **kwargs) -> Exception:
    """``fn`` raises ``kind`` whose message holds every fragment; returns the error."""
    try:
        fn(*args, **kwargs)
    except kind as e:
        for fragment in [fragments] if isinstance(fragments, str) else fragments:
            assert fragment in str(e), f"{kind.__name__} without {fragment!r}: {e}"
        return e
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__} ({fragments!r})")


def reduce_ref(op, stacked: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """NumPy's reduction across ranks, with the core's integer and boolean rules."""
    if dtype == torch.bool:
        stacked = stacked != 0
        return {hvd.Sum: np.any, hvd.Min: np.all, hvd.Max: np.any}[op](stacked, axis=0)
    if op == hvd.Average:
        mean = stacked.sum(axis=0) / SIZE
        return mean if dtype.is_floating_point else np.trunc(mean)
    return {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max,
            hvd.Product: np.prod}[op](stacked, axis=0)


def case_every_dtype_every_collective():
    """every dtype, every collective"""
    for seed, dtype in enumerate(DTYPES):
        low = 0 if dtype in (torch.uint8, torch.bool) else -4
        inputs = [data(seed, r, (2 * SIZE + 1, 3), low=low) for r in range(SIZE)]
        if dtype == torch.bool:
            inputs = [(x > 1).astype(np.float64) for x in inputs]
        stacked = np.stack(inputs)
        mine = inputs[RANK]
        ops = [hvd.Sum, hvd.Min, hvd.Max]
        if dtype != torch.bool:
            ops += [hvd.Average, hvd.Product]
        for op in ops:
            values = np.stack([np.clip(x, 1, 2) for x in inputs]) if op == hvd.Product else stacked
            x = as_torch(values[RANK], dtype)
            want = reduce_ref(op, values, dtype)
            what = f"{dtype} op {op}"
            check(hvd.allreduce(x, op=op), want, f"allreduce {what}", dtype)
            check(x, values[RANK], f"allreduce leaves its input alone {what}", dtype)
            view = x.numpy() if dtype != torch.bfloat16 else None
            assert hvd.allreduce_(x, op=op) is x
            check(x, want, f"allreduce_ {what}", dtype)
            if view is not None:  # the write landed in the tensor's own memory
                np.testing.assert_array_equal(view, x.numpy())
        x = as_torch(mine, dtype)
        check(hvd.allgather(x), np.concatenate(inputs), f"allgather {dtype}", dtype)
        ragged = [inputs[r][:r + 1] for r in range(SIZE)]
        check(hvd.allgather(as_torch(ragged[RANK], dtype)), np.concatenate(ragged),
              f"allgather ragged {dtype}", dtype)
        root = SIZE - 1
        check(hvd.broadcast(x, root), inputs[root], f"broadcast {dtype}", dtype)
        y = as_torch(mine, dtype)
        assert hvd.broadcast_(y, root) is y
        check(y, inputs[root], f"broadcast_ {dtype}", dtype)
        rows = [2 * SIZE + 1 - (2 * SIZE + 1) % SIZE] * SIZE  # equal split
        equal = [inputs[r][:rows[r]] for r in range(SIZE)]
        per = rows[0] // SIZE
        check(hvd.alltoall(as_torch(equal[RANK], dtype)),
              np.concatenate([equal[r][RANK * per:(RANK + 1) * per] for r in range(SIZE)]),
              f"alltoall {dtype}", dtype)
        splits = [(RANK + j) % 3 for j in range(SIZE)]
        sent = [[(r + j) % 3 for j in range(SIZE)] for r in range(SIZE)]
        parts = [inputs[r][sum(sent[r][:RANK]):sum(sent[r][:RANK + 1])] for r in range(SIZE)]
        out, received = hvd.alltoall(as_torch(mine[:sum(splits)], dtype), splits=splits)
        check(out, np.concatenate(parts), f"alltoall splits {dtype}", dtype)
        check(received, np.array([s[RANK] for s in sent]), f"alltoall received {dtype}", torch.int32)
        shares = [(2 * SIZE + 1) // SIZE + (1 if r < (2 * SIZE + 1) % SIZE else 0)
                  for r in range(SIZE)]
        lo = sum(shares[:RANK])
        op = hvd.Sum if dtype == torch.bool or not dtype.is_floating_point else hvd.Average
        check(hvd.reducescatter(x, op=op), reduce_ref(op, stacked, dtype)[lo:lo + shares[RANK]],
              f"reducescatter {dtype}", dtype)


def case_grouped_scale_factors_average():
    """grouped forms, scale factors, deprecated average="""
    inputs = [[data(20, r, (3,)), data(21, r, (2, 2))] for r in range(SIZE)]
    dtypes = [torch.float32, torch.int64]
    mine = [as_torch(x, d) for x, d in zip(inputs[RANK], dtypes)]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=1.5)
    for i, out in enumerate(outs):
        check(out, sum(inp[i] for inp in inputs) * 3.0, f"grouped_allreduce[{i}]", dtypes[i])
    assert hvd.grouped_allreduce_(mine, op=hvd.Max) == mine
    for i, t in enumerate(mine):
        check(t, np.max([inp[i] for inp in inputs], axis=0), f"grouped_allreduce_[{i}]", dtypes[i])
    gathered = hvd.grouped_allgather([as_torch(inp[:RANK + 1], torch.float64) for inp in inputs[RANK]])
    for i, g in enumerate(gathered):
        check(g, np.concatenate([inp[i][:r + 1] for r, inp in enumerate(inputs)]),
              f"grouped_allgather[{i}]", torch.float64)
    shares = hvd.grouped_reducescatter([as_torch(np.tile(inputs[RANK][0], (SIZE, 1)), torch.float32)],
                                       op=hvd.Sum)
    check(shares[0], np.sum([inp[0] for inp in inputs], axis=0)[None], "grouped_reducescatter",
          torch.float32)
    check(hvd.allreduce(as_torch(inputs[RANK][0], torch.float32), average=False),
          np.sum([inp[0] for inp in inputs], axis=0), "average=False", torch.float32)
    fp16 = hvd.allreduce(as_torch(inputs[RANK][0], torch.float32), op=hvd.Sum,
                         compression=hvd.Compression.fp16)
    check(fp16, np.sum([inp[0] for inp in inputs], axis=0), "Compression.fp16", torch.float32)


def case_adasum():
    """Adasum: (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b per tensor, on a power of two of ranks"""
    first = [data(25, r, (4,)) for r in range(SIZE)]
    second = [data(26, r, (2, 3)) + 1 for r in range(SIZE)]
    if SIZE & (SIZE - 1):
        # NotImplementedError, as Horovod raises (and a ValueError, as the other refusals)
        raises(NotImplementedError, ["power-of-two", str(SIZE)], hvd.allreduce,
               torch.tensor(first[RANK]), op=hvd.Adasum)
    else:
        def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            dot = float(np.sum(a * b))
            return (1 - dot / (2 * np.sum(a * a))) * a + (1 - dot / (2 * np.sum(b * b))) * b

        assert SIZE == 2, "the reference below pairs two ranks"
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            outs = hvd.grouped_allreduce([as_torch(first[RANK], dtype), as_torch(second[RANK], dtype)],
                                         op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
            rounded = [[as_torch(x, dtype).double().numpy() * 0.5 for x in xs]
                       for xs in (first, second)]
            check(outs[0], 3.0 * adasum_pair(*rounded[0]), f"Adasum tensor 0 {dtype}", dtype)
            check(outs[1], 3.0 * adasum_pair(*rounded[1]), f"Adasum tensor 1 {dtype}", dtype)
        x = torch.tensor(first[RANK])
        assert hvd.allreduce_(x, op=hvd.Adasum) is x
        check(x, adasum_pair(first[0], first[1]), "Adasum in place", torch.float64)
        raises(TypeError, "floating-point", hvd.allreduce, torch.ones(3, dtype=torch.int32),
               op=hvd.Adasum)


def case_async_handles():
    """async: handles, poll, synchronize; in-place async writes into the tensor"""
    inputs = [data(30, r, (SIZE * 2, 3)) for r in range(SIZE)]
    x = as_torch(inputs[RANK], torch.float32)
    inplace = x.clone()
    started = [hvd.allreduce_async(x, op=hvd.Sum, name="a.sum"),
               hvd.allreduce_async_(inplace, name="a.avg"),
               hvd.allgather_async(x, name="a.gather"),
               hvd.broadcast_async(x, 0, name="a.bcast"),
               hvd.alltoall_async(x, name="a.a2a"),
               hvd.reducescatter_async(x, op=hvd.Sum, name="a.rs"),
               hvd.grouped_allreduce_async([x, x], op=hvd.Sum),
               hvd.grouped_allgather_async([x]),
               hvd.grouped_reducescatter_async([x], op=hvd.Sum)]
    while not all(hvd.poll(h) for h in started):
        pass
    total = np.sum(inputs, axis=0)
    results = [hvd.synchronize(h) for h in started]
    check(results[0], total, "allreduce_async", torch.float32)
    assert results[1] is inplace
    check(inplace, total / SIZE, "allreduce_async_ wrote into its tensor", torch.float32)
    check(results[2], np.concatenate(inputs), "allgather_async", torch.float32)
    check(results[3], inputs[0], "broadcast_async", torch.float32)
    output, received = results[4]  # alltoall_async's synchronize gives both, as in Horovod
    check(output, np.concatenate([inp[2 * RANK:2 * RANK + 2] for inp in inputs]), "alltoall_async",
          torch.float32)
    check(received, np.full(SIZE, 2), "alltoall_async received splits", torch.int32)
    check(results[5], total[2 * RANK:2 * RANK + 2], "reducescatter_async", torch.float32)
    check(results[6][1], total, "grouped_allreduce_async", torch.float32)
    check(results[7][0], np.concatenate(inputs), "grouped_allgather_async", torch.float32)
    check(results[8][0], total[2 * RANK:2 * RANK + 2], "grouped_reducescatter_async", torch.float32)
    check(x, inputs[RANK], "out-of-place async leaves the input alone", torch.float32)
    y = as_torch(inputs[RANK], torch.float64)
    assert hvd.synchronize(hvd.broadcast_async_(y, SIZE - 1)) is y
    check(y, inputs[SIZE - 1], "broadcast_async_", torch.float64)


def case_sparse_coo():
    """sparse COO tensors: one and two sparse dimensions, sparse and dense transport"""
    for sparse_dims, rows_total, seed in ((1, 40, 40), (2, 6, 41), (1, 3, 42)):
        shape = (rows_total, 5, 2) if sparse_dims == 1 else (rows_total, 5, 2)
        rng = np.random.default_rng(seed)
        per_rank = []
        for r in range(SIZE):
            nnz = 4 + r
            idx = np.stack([rng.integers(0, shape[d], nnz) for d in range(sparse_dims)])
            vals = rng.integers(-3, 4, (nnz,) + shape[sparse_dims:]).astype(np.float32)
            per_rank.append((idx, vals))
        dense = []
        for idx, vals in per_rank:
            d = np.zeros(shape, np.float32)
            np.add.at(d, tuple(idx), vals)
            dense.append(d)
        idx, vals = per_rank[RANK]
        t = torch.sparse_coo_tensor(torch.from_numpy(idx), torch.from_numpy(vals), shape,
                                    check_invariants=True)
        for op in (hvd.Sum, hvd.Average):
            handle = hvd.sparse_allreduce_async(t, f"sparse{seed}", op)
            result = handle() if op == hvd.Average else hvd.synchronize(handle)
            assert result.is_sparse, "sparse_allreduce_async returns a sparse tensor"
            want = np.sum(dense, axis=0) / (SIZE if op == hvd.Average else 1)
            check(result.to_dense(), want, f"sparse_allreduce {sparse_dims}d {op}", torch.float32)
            touched = np.zeros(shape[:sparse_dims], bool)
            for i, _ in per_rank:
                touched[tuple(i)] = True
            assert result.indices().shape[1] == touched.sum(), "one entry per touched index"


def case_objects_barrier_process_sets():
    """objects, barrier, process sets"""
    assert hvd.broadcast_object({"from": RANK}, root_rank=SIZE - 1) == {"from": SIZE - 1}
    assert hvd.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]
    hvd.barrier()
    members = list(range(1, SIZE))
    ps = hvd.add_process_set(members)
    inputs = [data(50, r, (4,)) for r in range(SIZE)]
    if RANK in members:
        check(hvd.allreduce(as_torch(inputs[RANK], torch.float32), op=hvd.Sum, process_set=ps),
              sum(inputs[r] for r in members), "allreduce on a process set", torch.float32)
        check(hvd.broadcast(as_torch(inputs[RANK], torch.float32), SIZE - 1, process_set=ps),
              inputs[SIZE - 1], "broadcast on a process set: global root rank", torch.float32)
    else:
        raises(ValueError, "not a part of process set", hvd.allreduce,
               as_torch(inputs[RANK], torch.float32), process_set=ps)
    hvd.remove_process_set(ps)


def case_bad_argument_on_one_rank():
    """one rank's bad argument raises on every rank, and the next collective works"""
    good = torch.ones(4)


    def bad_on(rank: int, bad, fine=good):
        return bad if RANK == rank else fine


    last = SIZE - 1
    raises(ValueError, ["on rank 1", "contiguous"], hvd.allreduce_,
           bad_on(1, torch.ones(4, 2).t(), torch.ones(2, 4)))
    raises(TypeError, ["on rank 0", "torch.Tensor"], hvd.allgather, bad_on(0, np.ones(4)))
    raises(ValueError, [f"on rank {last}", "Adasum"], hvd.reducescatter, good,
           op=hvd.Adasum if RANK == last else hvd.Sum)
    raises(TypeError, ["on rank 1", "sparse"], hvd.broadcast_,
           bad_on(1, torch.ones(4).to_sparse()), 0)
    raises(ValueError, ["on rank 0", "splits"], hvd.alltoall, torch.ones(SIZE, 2),
           splits=bad_on(0, [SIZE + 1] + [0] * (SIZE - 1), [1] * SIZE))
    raises(ValueError, ["on rank 1", "Average or Sum"], lambda: hvd.synchronize(
        hvd.sparse_allreduce_async(torch.ones(4).to_sparse(), "s", hvd.Max if RANK == 1 else hvd.Sum)))
    error = raises(hvd.HorovodInternalError, "shape", hvd.allreduce,
                   torch.ones(2 + (RANK == 1)), name="mismatch")
    assert isinstance(error, hvd_trainer.MismatchError), type(error).__mro__
    # The async form: the rank with the bad argument raises at the call, the others at synchronize.
    if RANK == 1:
        raises(ValueError, "on rank 1", hvd.allreduce_async_, torch.ones(4, 2).t())
    else:
        error = raises(hvd.HorovodInternalError, "on rank 1", hvd.synchronize,
                       hvd.allreduce_async_(torch.ones(2, 4)))
        assert isinstance(error, ValueError), type(error).__mro__
    check(hvd.allreduce(torch.full((3,), float(RANK)), op=hvd.Sum, name="after errors"),
          np.full(3, float(sum(range(SIZE)))), "allreduce after the errors", torch.float32)


run_cases({"every_dtype_every_collective": case_every_dtype_every_collective,
           "grouped_scale_factors_average": case_grouped_scale_factors_average,
           "adasum": case_adasum, "async_handles": case_async_handles,
           "sparse_coo": case_sparse_coo,
           "objects_barrier_process_sets": case_objects_barrier_process_sets,
           "bad_argument_on_one_rank": case_bad_argument_on_one_rank}, rank=RANK)
