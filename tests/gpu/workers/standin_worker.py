"""The CPU stand-in for CuPy (tests/gpu/standin) fails where a GPU program's ordering or
arguments are wrong, as docs/gpu.md says: run with the stand-in only (HVD_STANDIN_GPUS=2)."""
import os

import numpy as np
from mpi4py import MPI  # noqa: F401 - started before NCCL's stand-in uses it

from gpu_common import expect, run_cases

import cupy  # noqa: E402
import cupyx  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

assert cupy.__version__.endswith("+standin"), "these cases check the stand-in, not CuPy"
KERNEL = """
extern "C" __global__ void axpy(const float* x, float* y, long long n, float a) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) y[i] += a * x[i];
}
"""


def a_host_read_without_the_wait_sees_stale_data() -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4, cupy.float32)
    cupy.cuda.Stream.null.synchronize()
    with side:
        x += 1
    assert x.get().tolist() == [0, 0, 0, 0]  # the null stream does not wait for side
    side.synchronize()
    assert x.get().tolist() == [1, 1, 1, 1]


def an_event_orders_one_stream_after_another() -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.arange(4, dtype=cupy.float32)
        done = side.record()
    cupy.cuda.get_current_stream().wait_event(done)
    assert x.get().tolist() == [0, 1, 2, 3]  # no synchronize: the event orders it


def a_read_before_the_wait_for_its_producer_sees_stale_memory() -> None:
    producer, consumer = (cupy.cuda.Stream(non_blocking=True) for _ in range(2))
    with producer:
        x = cupy.zeros(3, cupy.float32)
        x += 1
    with consumer:
        early = x * 2  # before the wait: the late schedule runs it before the producer
        consumer.wait_event(producer.record())
        late = x * 2
    assert np.isnan(early.get(stream=consumer)).all()
    assert late.get(stream=consumer).tolist() == [2, 2, 2]


def a_stream_that_never_waits_for_its_producer_sees_stale_memory() -> None:
    os.environ["HVD_STANDIN_SCHEDULE"] = "early"
    try:
        host_side, other = (cupy.cuda.Stream(non_blocking=True) for _ in range(2))
        with host_side:
            x = cupy.zeros(3, cupy.float32)
            x += 1
        with other:
            y = x * 2  # never waits for host_side, which writes x
        host_side.wait_event(other.record())
        assert np.isnan(y.get(stream=host_side)).all()  # other's work ran first
    finally:
        del os.environ["HVD_STANDIN_SCHEDULE"]


def the_null_stream_is_ordered_with_blocking_streams_only() -> None:
    blocking = cupy.cuda.Stream()
    with blocking:
        x = cupy.ones(3, cupy.float32)
    assert x.get().tolist() == [1, 1, 1]  # the legacy stream waits for blocking streams
    other = cupy.cuda.Stream(non_blocking=True)
    with other:
        y = cupy.ones(3, cupy.float32)
    assert np.isnan(y.get()).all()  # new memory holds NaN until something writes it


def a_copy_from_page_locked_memory_reads_it_when_it_runs() -> None:
    pinned, pageable = cupyx.empty_pinned(3, np.float32), np.zeros(3, np.float32)
    pinned[...] = 0
    a, b = cupy.empty(3, cupy.float32), cupy.empty(3, cupy.float32)
    a.set(pinned)
    b.set(pageable)
    pinned[...] = 7  # before the copies run: the page-locked one sees it
    pageable[...] = 7
    assert a.get().tolist() == [7, 7, 7] and b.get().tolist() == [0, 0, 0]


def kernel_arguments_of_another_type_raise() -> None:
    axpy = cupy.RawModule(code=KERNEL).get_function("axpy")
    x, y = cupy.ones(5, cupy.float32), cupy.zeros(5, cupy.float32)
    axpy((1,), (32,), (x, y, np.int64(5), np.float32(2)))
    assert y.get().tolist() == [2] * 5  # the right types run
    expect(TypeError, "takes int64, got int32", lambda: axpy((1,), (32,), (x, y, np.int32(5),
                                                                           np.float32(2))))
    expect(TypeError, "takes float32, got float64", lambda: axpy((1,), (32,), (x, y, 5, 2.0)))
    expect(TypeError, "takes a cupy array", lambda: axpy((1,), (32,), (x.get(), y, 5,
                                                                       np.float32(2))))
    expect(TypeError, "4-byte items", lambda: axpy((1,), (32,), (x.view(np.uint8)[:5], y,
                                                                 np.int64(5), np.float32(2))))
    expect(TypeError, "takes 4 arguments", lambda: axpy((1,), (32,), (x, y)))


def kernels_whose_threads_share_memory_are_refused() -> None:
    source = KERNEL.replace("y[i] += a * x[i];", "{ __shared__ float t[32]; __syncthreads(); }")
    expect(RuntimeError, "__shared__, __syncthreads", lambda: cupy.RawModule(code=source))


def dlpack_takes_device_memory_only_and_once() -> None:
    expect(ValueError, "not a GPU", lambda: cupy.from_dlpack(np.arange(3.0)))
    x = cupy.arange(6, dtype=cupy.float32)
    capsule = x.toDlpack()
    y = cupy.from_dlpack(capsule)
    assert y.data.ptr == x.data.ptr and y.get().tolist() == list(range(6))
    expect(ValueError, "consumed already", lambda: cupy.from_dlpack(capsule))


def an_array_on_another_gpu_is_refused() -> None:
    with cupy.cuda.Device(1):
        other = cupy.ones(3, cupy.float32)
    expect(ValueError, "array device = 1 while current = 0", lambda: other + 1)


def nccl_work_runs_with_its_stream_only() -> None:
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x, y = cupy.ones(4, cupy.float32), cupy.zeros(4, cupy.float32)
    cupy.cuda.Stream.null.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    comm.allReduce(x.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    assert y.get().tolist() == [0] * 4
    stream.synchronize()
    assert y.get().tolist() == [1] * 4
    expect(nccl.NcclError, "no allocation", lambda: comm.allReduce(
        x.data.ptr, x.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr))
    comm.destroy()


def freed_memory_goes_back_to_its_streams_pool() -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        ptr = cupy.empty(1000, cupy.float32).data.ptr  # freed at once, on side
        assert cupy.empty(1000, cupy.float32).data.ptr == ptr
    assert cupy.empty(1000, cupy.float32).data.ptr != ptr  # another stream's pool


run_cases({"a_host_read_without_the_wait_sees_stale_data":
               a_host_read_without_the_wait_sees_stale_data,
           "an_event_orders_one_stream_after_another": an_event_orders_one_stream_after_another,
           "a_read_before_the_wait_for_its_producer_sees_stale_memory":
               a_read_before_the_wait_for_its_producer_sees_stale_memory,
           "a_stream_that_never_waits_for_its_producer_sees_stale_memory":
               a_stream_that_never_waits_for_its_producer_sees_stale_memory,
           "the_null_stream_is_ordered_with_blocking_streams_only":
               the_null_stream_is_ordered_with_blocking_streams_only,
           "a_copy_from_page_locked_memory_reads_it_when_it_runs":
               a_copy_from_page_locked_memory_reads_it_when_it_runs,
           "kernel_arguments_of_another_type_raise": kernel_arguments_of_another_type_raise,
           "kernels_whose_threads_share_memory_are_refused":
               kernels_whose_threads_share_memory_are_refused,
           "dlpack_takes_device_memory_only_and_once": dlpack_takes_device_memory_only_and_once,
           "an_array_on_another_gpu_is_refused": an_array_on_another_gpu_is_refused,
           "nccl_work_runs_with_its_stream_only": nccl_work_runs_with_its_stream_only,
           "freed_memory_goes_back_to_its_streams_pool":
               freed_memory_goes_back_to_its_streams_pool},
          rank=0)
