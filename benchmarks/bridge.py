"""What moving data between NDArrays and the core's NumPy buffers costs, per size and per op.

Run in one process (a size-1 world, no MPI needed):  python benchmarks/bridge.py [--quick]

Part 1 times the bridge's zero-copy paths against the copying ones MXNet offers, for float32
arrays of 4 KiB to 64 MiB: reading (read_view vs asnumpy), writing a result back (assign
through write_view vs ``x[:] = array``), wrapping a new result (from_numpy zero-copy, as
hvd_trainer.mxnet.ops does on cpu(0), vs mx.nd.array) and the in-place round trip an
allreduce_ needs (write_view vs asnumpy plus write-back). Variants run in interleaved rounds
and each keeps its best round, so machine noise hits them alike.

Part 2 times each NDArray collective on a 16 MiB tensor in the size-1 world, where the
communication is free or a single local copy, in units of one 16 MiB ``np.copyto`` between
NDArrays' memory: the figure is about the number of full-size copies the op makes.
"""
import argparse
import platform
import time

import mxnet as mx
import numpy as np

import hvd_trainer as core
import hvd_trainer.mxnet as hvd
from hvd_trainer.mxnet import bridge

KIB = 1024


def best_of(variants: dict, rounds: int, iters: int) -> dict:
    best = {k: float("inf") for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            mx.nd.waitall()
            best[k] = min(best[k], (time.perf_counter() - start) / iters)
    return best


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:10.1f} us"


def part1(sizes, rounds):
    print("\nPart 1: bridge moves, float32, best of", rounds, "rounds")
    print(f"{'size':>9} | {'move':<40} | {'zero-copy':>13} | {'copying':>13} | ratio")
    for nbytes in sizes:
        n = nbytes // 4
        x = mx.nd.ones((n,))
        src = np.full(n, 2.0, np.float32)
        iters = max(3, min(2000, (256 << 20) // nbytes))

        def roundtrip_copy():
            host = x.asnumpy()
            x[:] = host

        pairs = {
            "read (read_view / asnumpy)": (lambda: bridge.read_view(x), x.asnumpy),
            "write back (assign / x[:] = a)": (lambda: bridge.assign(x, src),
                                               lambda: x.__setitem__(slice(None), src)),
            "new result (from_numpy / array)": (
                lambda: mx.nd.from_numpy(np.empty(n, np.float32), zero_copy=True),
                lambda: mx.nd.array(src, dtype=np.float32)),
            "in-place buffer (write_view / 2 copies)": (lambda: bridge.write_view(x),
                                                        roundtrip_copy),
        }
        for move, (fast, slow) in pairs.items():
            t = best_of({"fast": fast, "slow": slow}, rounds, iters)
            print(f"{nbytes // KIB:>6} KiB | {move:<40} | {fmt(t['fast'])} | {fmt(t['slow'])} "
                  f"| {t['slow'] / t['fast']:8.1f}x")


def part2(rounds):
    nbytes = 16 << 20
    n = nbytes // 4
    x = mx.nd.ones((n // 4, 4))
    parts = [mx.nd.ones((n // 32, 4)) for _ in range(8)]
    # The unit copies between two NDArrays' memory, which MXNet allocates differently from
    # NumPy (its pool, aligned): the ops below work on such memory too.
    src, dst = mx.nd.ones((n,)), mx.nd.zeros((n,))  # the views below do not keep these alive
    a, b = bridge.read_view(src), bridge.write_view(dst)
    ops = {
        "memcpy (np.copyto), the unit": lambda: np.copyto(b, a),
        "allreduce_ (in place)": lambda: hvd.allreduce_(x, op=hvd.Sum),
        "allreduce": lambda: hvd.allreduce(x, op=hvd.Sum),
        "grouped_allreduce_ (8 x 2 MiB)": lambda: hvd.grouped_allreduce_(parts, op=hvd.Sum),
        "broadcast_ (in place)": lambda: hvd.broadcast_(x, 0),
        "broadcast": lambda: hvd.broadcast(x, 0),
        "allgather": lambda: hvd.allgather(x),
        "alltoall": lambda: hvd.alltoall(x),
        "reducescatter (Sum)": lambda: hvd.reducescatter(x, op=hvd.Sum),
        "naive allreduce (asnumpy, core, mx.nd.array)": lambda: mx.nd.array(
            core.allreduce(x.asnumpy(), op=hvd.Sum)),
    }
    t = best_of(ops, rounds, 10)
    unit = t["memcpy (np.copyto), the unit"]
    print(f"\nPart 2: NDArray ops on 16 MiB in a size-1 world, best of {rounds} rounds")
    print(f"{'op':<46} | {'time':>13} | memcpy units")
    for name, seconds in t.items():
        print(f"{name:<46} | {fmt(seconds)} | {seconds / unit:6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    args = parser.parse_args()
    hvd.init()
    assert hvd.size() == 1, "run this benchmark in one process: python benchmarks/bridge.py"
    print(f"mxnet {mx.__version__}, numpy {np.__version__}, {platform.processor() or 'cpu'}, "
          f"{platform.python_version()}")
    sizes = [4 * KIB, 1 << 20, 64 << 20] if args.quick else \
        [4 * KIB, 64 * KIB, 1 << 20, 16 << 20, 64 << 20]
    rounds = 3 if args.quick else 7
    part1(sizes, rounds)
    part2(rounds)
