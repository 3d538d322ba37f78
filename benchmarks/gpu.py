"""GPU figures: NCCL allreduce at world size 1, kernels against the device's copy bandwidth,
and the host-staged allreduce on 2 ranks against raw mpi4py.

    python benchmarks/gpu.py                        # one GPU, one process
    hvdrun -np 2 python benchmarks/gpu.py --staged  # 2 ranks sharing the GPU

Device times come from CUDA events around repeated calls after a warm-up, best of 3 rounds.
Every kernel figure is set against a device-to-device copy of the same bytes measured in the
same run (bytes read plus written per second), the memory bandwidth the kernel can hope for.
busbw = bytes / t * 2 (n - 1) / n as nccl-tests defines it; at n = 1 that factor is 0, so the
NCCL table gives algbw (bytes / t) beside NCCL called directly through CuPy on the same buffers.
"""
import argparse
import datetime
import time

import cupy
import numpy as np

import hvd_trainer as hvd
from hvd_trainer import compression, cuda
from hvd_trainer.cuda import fusion

MiB = 1 << 20


def device_seconds(fn, iters: int, rounds: int = 3) -> float:
    """Best seconds per ``fn()`` call over ``rounds`` of ``iters`` calls, by CUDA events."""
    fn()
    cupy.cuda.get_current_stream().synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3 / iters)
    return best


def iterations(nbytes: int) -> int:
    return max(3, min(200, (2 << 30) // max(nbytes, 1)))


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``nbytes``."""
    src, dst = cupy.ones(nbytes // 4, cupy.float32), cupy.empty(nbytes // 4, cupy.float32)
    return 2 * nbytes / device_seconds(lambda: cupy.copyto(dst, src), iterations(nbytes))


def nccl_table() -> None:
    from cupy.cuda import nccl as raw
    comm = cuda.communicator()
    # The reference: a communicator of CuPy's own, called directly on the same buffers.
    direct_comm = raw.NcclCommunicator(1, raw.get_unique_id(), 0) if raw.available else None
    print(f"\nallreduce at world size 1 through {type(comm).__name__} (algbw GB/s; µs per call)")
    print("| size | hvd_trainer allreduce (out of place) | NCCL allReduce via CuPy | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for mib in (1, 4, 16, 64, 256, 1024):
        n = mib * MiB // 4
        x = cupy.ones(n, cupy.float32)
        y = cupy.empty_like(x)
        ours = device_seconds(lambda: cuda.allreduce(x, hvd.Sum, "bench"), iterations(x.nbytes))
        stream = cupy.cuda.get_current_stream().ptr
        direct = device_seconds(lambda: direct_comm.allReduce(
            x.data.ptr, y.data.ptr, n, raw.NCCL_FLOAT32, raw.NCCL_SUM, stream),
            iterations(x.nbytes)) if direct_comm else float("nan")
        print(f"| {mib} MiB | {x.nbytes / ours / 1e9:.1f} ({ours * 1e6:.0f} µs) | "
              f"{x.nbytes / direct / 1e9:.1f} ({direct * 1e6:.0f} µs) | {direct / ours:.2f} |")
        x = y = None  # free the buffers before the next size is allocated
        cupy.get_default_memory_pool().free_all_blocks()


def kernel_table(copy_bw: float) -> None:
    n = 64 * MiB  # float32 elements: 256 MiB of gradient
    rng = cupy.random.default_rng(0)
    grad = rng.standard_normal(n, dtype=cupy.float32)
    print(f"\ncompression kernels on {n * 4 // MiB} MiB of float32 gradient "
          f"(device copy: {copy_bw / 1e9:.0f} GB/s read+written)")
    print("| codec | encode GB/s of gradient | encode memory GB/s | of copy bw | "
          "decode GB/s of gradient |")
    print("| --- | ---: | ---: | ---: | ---: |")
    codecs = [("2bit", compression.TwoBit(0.5)), ("scaled_2bit", compression.ScaledTwoBit(1.0)),
              ("1bit", compression.OneBit(0.0)), ("topk 0.01", compression.TopK(0.01))]
    for label, codec in codecs:
        twin = cuda.device_codec(codec)
        residual = cupy.zeros(n, cupy.float32)
        payload = twin.encode(grad, residual)
        out = cupy.zeros(n, cupy.float32)
        enc = device_seconds(lambda: twin.encode(grad, residual), 5)
        dec = device_seconds(lambda: twin.decode_add(payload, out), 5)
        # encode reads the gradient and the residual, writes the residual and the payload
        moved = 3 * grad.nbytes + payload.nbytes
        print(f"| {label} | {grad.nbytes / enc / 1e9:.0f} | {moved / enc / 1e9:.0f} | "
              f"{moved / enc / copy_bw:.2f} | {grad.nbytes / dec / 1e9:.0f} |")
    fp16 = device_seconds(lambda: grad.astype(cupy.float16), 5)
    print(f"| fp16 (cast) | {grad.nbytes / fp16 / 1e9:.0f} | {1.5 * grad.nbytes / fp16 / 1e9:.0f} "
          f"| {1.5 * grad.nbytes / fp16 / copy_bw:.2f} | - |")


def fusion_table(copy_bw: float) -> None:
    print("\npack then unpack of 100 tensors into one device bucket (one kernel each way)")
    print("| tensors | bucket | pack+unpack µs | memory GB/s | of copy bw | "
          "100 cupy copies each way, µs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for each in (4096, 256 * 1024, 2 * MiB):  # bytes per tensor
        tensors = [cupy.ones(each // 4, cupy.float32) for _ in range(100)]
        bucket = cupy.empty(sum(t.size for t in tensors), cupy.float32)

        def kernels():
            fusion.pack(tensors, bucket)
            fusion.unpack(bucket, tensors)

        def copies():
            offset = 0
            for t in tensors:
                bucket[offset:offset + t.size] = t
                offset += t.size
            offset = 0
            for t in tensors:
                t[...] = bucket[offset:offset + t.size]
                offset += t.size

        ours = device_seconds(kernels, 20)
        naive = device_seconds(copies, 20)
        moved = 4 * bucket.nbytes  # each way reads and writes every byte
        print(f"| 100 × {each // 1024} KiB | {bucket.nbytes / MiB:.3g} MiB | {ours * 1e6:.0f} | "
              f"{moved / ours / 1e9:.0f} | {moved / ours / copy_bw:.2f} | {naive * 1e6:.0f} |")


def staged_table() -> None:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    size = hvd.size()
    if hvd.rank() == 0:
        print(f"\nhost-staged allreduce on {size} ranks sharing one GPU, against raw mpi4py "
              "Allreduce on host buffers of the same size (busbw GB/s)")
        print("| size | hvd_trainer (GPU arrays, staged) | mpi4py Allreduce (host arrays) | "
              "ratio |")
        print("| ---: | ---: | ---: | ---: |")
    for mib in (1, 4, 16, 64, 256):
        n = mib * MiB // 4
        # zeros: the timed calls sum in place over and over, and ones would overflow to inf
        dev = cupy.zeros(n, cupy.float32)
        host = np.zeros(n, np.float32)
        iters = max(3, min(50, (512 * MiB) // dev.nbytes))

        def timed(fn):
            best = float("inf")
            fn()
            for _ in range(3):
                world.Barrier()
                tic = time.perf_counter()
                for _ in range(iters):
                    fn()
                best = min(best, world.allreduce((time.perf_counter() - tic) / iters, MPI.MAX))
            return best

        ours = timed(lambda: cuda.allreduce_(dev, hvd.Sum, "staged"))
        raw = timed(lambda: world.Allreduce(MPI.IN_PLACE, host, MPI.SUM))
        factor = 2 * (size - 1) / size
        if hvd.rank() == 0:
            print(f"| {mib} MiB | {dev.nbytes * factor / ours / 1e9:.2f} | "
                  f"{host.nbytes * factor / raw / 1e9:.2f} | {raw / ours:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staged", action="store_true",
                        help="time the host-staged allreduce (run under hvdrun -np 2)")
    args = parser.parse_args()
    hvd.init()
    props = cupy.cuda.runtime.getDeviceProperties(cuda.device())
    if hvd.rank() == 0:
        print(f"# {props['name'].decode()} · CuPy {cupy.__version__} · "
              f"{datetime.date.today().isoformat()}")
    if args.staged:
        staged_table()
        return
    copy_bw = copy_bandwidth(1 << 30)
    nccl_table()
    kernel_table(copy_bw)
    fusion_table(copy_bw)


if __name__ == "__main__":
    main()
