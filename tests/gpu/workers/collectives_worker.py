"""The GPU collectives, each rank checking against NumPy results computed from every rank's
inputs: where every rank has a GPU of its own (NCCL between them; at world size 1, NCCL's
one-rank path), and where the ranks share one GPU (host-staged MPI: NCCL refuses them), as
HVD_TEST_GPU_LAYOUT places them (gpu_common.py). The job sets HVD_FUSION_THRESHOLD and
HVD_BUCKET_THRESHOLD small, so that a few small tensors make several buckets."""
import contextlib
import functools
import gc
import os
import weakref

from gpu_common import data, expect, place_gpus, run_cases

place_gpus()
import cupy  # noqa: E402
import numpy as np  # noqa: E402

import hvd_trainer as hvd  # noqa: E402
from hvd_trainer import compression, cuda  # noqa: E402
from hvd_trainer.backends import nccl  # noqa: E402
from hvd_trainer.backends.host_staged import HostStagedCommunicator  # noqa: E402
from hvd_trainer.collectives import feedback  # noqa: E402
from hvd_trainer.training.buckets import Gradient  # noqa: E402
from hvd_trainer.training.reducer import Reducer  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
cupy.cuda.Device(cuda.device()).use()
REDUCE = {"Sum": np.add, "Average": np.add, "Max": np.maximum, "Min": np.minimum,
          "Product": np.multiply}
OPS = {"grouped_allreduce_sum": "Sum", "grouped_allreduce_average": "Average",
       "grouped_allreduce_max": "Max", "grouped_allreduce_min": "Min",
       "grouped_allreduce_product": "Product"}
UNTYPED = {"nccl_lacks_bool": "bool", "nccl_lacks_complex64": "complex64",
           "nccl_lacks_int16": "int16"}


def over_ranks(ufunc, arrays):
    """``arrays`` (one per rank) reduced with ``ufunc`` in rank order, in their own type."""
    out = arrays[0].copy()
    for a in arrays[1:]:
        ufunc(out, a, out=out)
    return out


def the_communicator_is_nccl_unless_ranks_share_a_gpu() -> None:
    assert hvd.cuda_built() and hvd.nccl_built() == nccl.available()
    shared = size > 1 and os.environ.get("HVD_TEST_GPU_LAYOUT") in ("rotated", "shared")
    expected = HostStagedCommunicator if shared or not nccl.available() else \
        nccl.NCCLCommunicator
    assert type(cuda.communicator()) is expected, type(cuda.communicator())


def grouped_allreduce_with_scaling_matches_numpy(case: str) -> None:
    op = OPS[case]
    shapes = [(3, 4), (1000,), (2,), (513,), (300,)]
    dtypes = ["float32"] * 4 + ["int32"]
    tensors = [cupy.asarray(data(rank, s, d)) for s, d in zip(shapes, dtypes)]
    out = cuda.grouped_allreduce_(tensors, getattr(hvd, op), case, prescale_factor=2.0,
                                  postscale_factor=0.5)
    assert all(o is t for o, t in zip(out, tensors))
    post = 0.5 / size if op == "Average" else 0.5
    for s, d, t in zip(shapes, dtypes, tensors):
        summed = over_ranks(REDUCE[op], [data(r, s, d) * np.dtype(d).type(2) for r in range(size)])
        if d == "int32":  # scaled in float64, truncated toward zero
            np.testing.assert_array_equal(t.get(), np.trunc(summed * post).astype(d))
        else:
            np.testing.assert_allclose(t.get(), summed * np.float32(post), rtol=1e-5, atol=1e-4)


def out_of_place_allreduce_leaves_its_input() -> None:
    x = cupy.arange(10, dtype=cupy.float64) + rank
    y = cuda.allreduce(x[::2], hvd.Sum, "strided")  # a strided input is copied first
    np.testing.assert_array_equal(y.get(), sum(np.arange(0, 10, 2) + r for r in range(size)))
    np.testing.assert_array_equal(x.get(), np.arange(10) + rank)


def allgather_broadcast_reducescatter_match_numpy() -> None:
    rows = [r + 1 for r in range(size)]  # rank r contributes r + 1 rows
    gathered = cuda.allgather(cupy.asarray(data(rank, (rows[rank], 5))), "gather")
    np.testing.assert_array_equal(gathered.get(),
                                  np.concatenate([data(r, (rows[r], 5)) for r in range(size)]))
    b = cupy.asarray(data(rank, (4, 4)))
    cuda.broadcast_(b, size - 1, "bcast")
    np.testing.assert_array_equal(b.get(), data(size - 1, (4, 4)))
    share = cuda.reducescatter(cupy.asarray(data(rank, (7, 2))), hvd.Sum, "rs")
    total = over_ranks(np.add, [data(r, (7, 2)) for r in range(size)])
    first = sum(7 // size + (1 if q < 7 % size else 0) for q in range(rank))
    mine = 7 // size + (1 if rank < 7 % size else 0)
    np.testing.assert_allclose(share.get(), total[first:first + mine], rtol=1e-5, atol=1e-5)


def the_top_level_collectives_hand_cupy_arrays_to_the_gpu_ones() -> None:
    x = cupy.arange(6, dtype=cupy.float32) * (rank + 1)
    every = sum(r + 1 for r in range(size))
    expected = [np.arange(6) * every, np.arange(6) * every,
                np.concatenate([np.arange(6) * (r + 1) for r in range(size)]), np.arange(6)]
    results = [hvd.allreduce(x, hvd.Sum, "t.ar"), hvd.grouped_allreduce([x], hvd.Sum, "t.g")[0],
               hvd.allgather(x, "t.ag"), hvd.broadcast(x, 0, "t.b")]
    for result, want in zip(results, expected):
        assert isinstance(result, cupy.ndarray), type(result)
        np.testing.assert_array_equal(result.get(), want)
    assert isinstance(hvd.reducescatter(x, hvd.Sum, "t.rs"), cupy.ndarray)
    assert hvd.allreduce_(x, hvd.Sum, "t.ar_") is x and hvd.broadcast_(x, 0, "t.b_") is x


def compressed_sum_on_the_gpu_equals_the_numpy_one() -> None:
    host = feedback.ErrorFeedbackSum(compression.TwoBit(0.5))
    device = cuda.DeviceErrorFeedbackSum(compression.TwoBit(0.5))
    for step in range(3):
        grads = [data(rank * 10 + step, n) for n in (5000, 2048)]
        h = [(i, g.copy()) for i, g in enumerate(grads)]
        d = [(i, cupy.asarray(g)) for i, g in enumerate(grads)]
        host.sum_(h, f"h{step}", scale=0.5)
        device.sum_(d, f"d{step}", scale=0.5)
        for (_, a), (_, b) in zip(h, d):
            np.testing.assert_array_equal(b.get(), a)


def fp16_compression_casts_on_the_device() -> None:
    x = cupy.asarray(data(rank, 100))
    payload, ctx = compression.Compression.fp16.compress(x)
    assert isinstance(payload, cupy.ndarray) and payload.dtype == np.float16
    back = compression.Compression.fp16.decompress(payload, ctx)
    np.testing.assert_array_equal(back.get(), x.get().astype(np.float16).astype(np.float32))


def dtypes_nccl_has_no_type_for_still_reduce(case: str) -> None:
    dtype = UNTYPED[case]
    every = [(data(r, 50) > 0).astype(dtype) for r in range(size)]
    x = cupy.asarray(every[rank])
    cuda.allreduce_(x, hvd.Sum, case)
    want = np.logical_or.reduce(every) if dtype == "bool" else over_ranks(np.add, every)
    np.testing.assert_array_equal(x.get(), want)


def wrong_arguments_name_the_fix() -> None:
    for call, error, words in [
            (lambda: cuda.grouped_allreduce_([cupy.ones(2), np.ones(3)], name="w1"), TypeError,
             "tensors[1] must be a cupy.ndarray"),
            (lambda: cuda.allreduce_(cupy.ones((4, 4))[:, 1], name="w2"), ValueError,
             "C-contiguous"),
            (lambda: cuda.DeviceErrorFeedbackSum(compression.TwoBit(0.5)).sum_(
                [("w", cupy.ones(2048, cupy.float16))], "w3"), ValueError, "float32")]:
        expect(error, words, call)


def gpu_communicators_go_with_their_process_set_and_come_anew_after_init() -> None:
    if size > 1:  # a set of the first and last ranks (or the first) gets one of its own
        members = [0, size - 1] if size > 2 else [0]
        ps = hvd.add_process_set(members)
        if rank in members:
            x = cupy.asarray(data(rank, 9))
            cuda.allreduce_(x, hvd.Sum, "ps", process_set=ps)
            np.testing.assert_allclose(x.get(), over_ranks(np.add, [data(r, 9) for r in members]),
                                       rtol=1e-5, atol=1e-5)
            made = cuda.communicator(ps)
            assert made is not cuda.communicator()
            held = weakref.ref(made)
            del made
        hvd.remove_process_set(ps)
        gc.collect()
        if rank in members:
            assert held() is None, "the process set's GPU communicator outlived the set"
    before = cuda.communicator()
    hvd.shutdown()
    hvd.init()
    assert cuda.communicator() is not before  # the new world's own, which works
    y = cuda.allreduce(cupy.ones(3, cupy.float32), hvd.Sum, "after")
    np.testing.assert_array_equal(y.get(), np.full(3, size, np.float32))


def the_collective_runs_in_order_with_the_callers_stream() -> None:
    """Input produced on a side stream by a chain of kernels; the collective, called with that
    stream current, sees the finished values, and work queued after it sees the result."""
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        y = cupy.ones(1 << 16, cupy.float32)
        for _ in range(5):
            y = y * 1.0
        y *= rank + 1
        total = cuda.allreduce(y, hvd.Sum, "ordered").sum()
    side.synchronize()
    assert float(total.get()) == sum(r + 1 for r in range(size)) * (1 << 16)


def the_reducer_reduces_gpu_buckets_after_their_producers() -> None:
    """What DistributedOptimizer does with CUDA parameters, in the core's terms: gradients
    written on one stream into GPU buckets, each bucket reduced on another stream after an
    event, the caller's stream waiting for each bucket's event before it reads."""
    shapes = [(300,), (5, 7), (1000,), (3,)]
    reducer = Reducer(prefix="gpu.")
    reducer.set_gradients([Gradient(k, s, "float32", memory="gpu") for k, s in enumerate(shapes)])
    assert len(reducer.buckets) > 1, reducer.buckets
    produce, reduce = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    produced, reduced, views = cupy.cuda.Event(), {}, {}

    @contextlib.contextmanager
    def on_reduce_stream(bucket):
        reduce.wait_event(produced)
        with cupy.cuda.Device(cuda.device()), reduce:
            yield
        reduced[bucket.number] = reduce.record()

    for bucket in reducer.buckets:
        with produce:  # zeroed where the gradients are written, in order with them
            flat = cupy.zeros(bucket.bounds[-1], cupy.float32)
        for k, a, b in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
            views[k] = flat[a:b].reshape(shapes[k])
        bucket.open = functools.partial(lambda f: f, flat)
        bucket.active = functools.partial(on_reduce_stream, bucket)
    for step in range(2):
        with produce:
            for k, s in enumerate(shapes):
                views[k][...] = cupy.asarray(data(10 * rank + step + k, s))
        produced.record(produce)
        reducer.mark_all([(k, None) for k in range(len(shapes))])
        reducer.finish(reducer.close()[0])
        for event in reduced.values():
            cupy.cuda.get_current_stream().wait_event(event)
        for k, s in enumerate(shapes):
            want = over_ranks(np.add, [data(10 * r + step + k, s) for r in range(size)])
            np.testing.assert_allclose(views[k].get(), want, rtol=1e-5, atol=1e-4)


run_cases({"the_communicator_is_nccl_unless_ranks_share_a_gpu":
               the_communicator_is_nccl_unless_ranks_share_a_gpu,
           **{name: functools.partial(grouped_allreduce_with_scaling_matches_numpy, name)
              for name in OPS},
           "out_of_place_allreduce_leaves_its_input": out_of_place_allreduce_leaves_its_input,
           "allgather_broadcast_reducescatter_match_numpy":
               allgather_broadcast_reducescatter_match_numpy,
           "the_top_level_collectives_hand_cupy_arrays_to_the_gpu_ones":
               the_top_level_collectives_hand_cupy_arrays_to_the_gpu_ones,
           "compressed_sum_on_the_gpu_equals_the_numpy_one":
               compressed_sum_on_the_gpu_equals_the_numpy_one,
           "fp16_compression_casts_on_the_device": fp16_compression_casts_on_the_device,
           **{name: functools.partial(dtypes_nccl_has_no_type_for_still_reduce, name)
              for name in UNTYPED},
           "wrong_arguments_name_the_fix": wrong_arguments_name_the_fix,
           "gpu_communicators_go_with_their_process_set_and_come_anew_after_init":
               gpu_communicators_go_with_their_process_set_and_come_anew_after_init,
           "the_collective_runs_in_order_with_the_callers_stream":
               the_collective_runs_in_order_with_the_callers_stream,
           "the_reducer_reduces_gpu_buckets_after_their_producers":
               the_reducer_reduces_gpu_buckets_after_their_producers})
