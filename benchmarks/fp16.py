"""fp16 that pays its way: the compressed step and the float16 allreduce, as ratios in one run.

Run:  python benchmarks/fp16.py [--rounds 2] [--elements 8388608]
In one run:
1. Kernels, one process, one core: G elements/s of the three 16-bit operations the fp16 path
   needs (float32 -> float16, float16 -> float32, float16 + float16 rounded once) on NumPy's
   loops (the core's default), torch's (the torch adapter's kernels, on views of the same
   arrays) and MXNet's (Cast and elemwise_add on NDArrays), and bfloat16 on ml_dtypes' loops
   and torch's; best of 5 on ``--elements`` values drawn like the MLP's gradients.
2. Steps, 2 ranks: the training step of the 8 x Dense(2048) MLP (batch 64 per rank, SGD with
   momentum, OMP_NUM_THREADS=1) with fp16 compression over the uncompressed step, in MXNet
   (DistributedTrainer, compression_params={'type': 'fp16'}) and PyTorch
   (DistributedOptimizer, Compression.fp16); both variants in the same processes, repetitions
   interleaved, each keeps its best repetition, the best launch of ``--rounds``. A what-if
   row runs the MXNet step on torch's kernels, which the MXNet adapter cannot hand down.
3. Bus bandwidth, 2 ranks: in-place Sum allreduce of float16 and float32 buffers of equal
   bytes (16, 64, 256 MiB), busbw = bytes / t * 2 (n - 1) / n; through the core on NumPy
   arrays (NumPy's sums) and through hvd_trainer.torch on tensors (torch's sums); variants
   interleaved, best of the repetitions, the best launch of ``--rounds``.
Targets (issue 25): the fp16 step at most 1.15 x the uncompressed one, and float16 busbw at
least 0.9 x the float32 one from 16 MiB up.
"""
import argparse
import os
import subprocess
import sys
import time
from typing import Callable, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dense_mlp, header, launch, report, training_step  # noqa: E402

MIB = 1 << 20
SIZES = [16, 64, 256]  # MiB
STEP_WARMUP, STEP_REPS, STEPS = 2, 4, 3
BUS_REPS = 10


def best_seconds(fn: Callable[[], None], reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - tic)
    return best


def gradient_like(n: int, seed: int = 0) -> np.ndarray:
    """Values like the MLP's gradients: a third zeros (ReLU), the rest normal with sigma 1e-3
    (the MLP's: 32 % zeros, median |g| 7.7e-4, 2.8 % below float16's normal range)."""
    rng = np.random.RandomState(seed)
    x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    x[rng.uniform(size=n) < 1 / 3] = 0
    return x


def kernel_rates(n: int) -> Dict[str, Dict[str, float]]:
    """G elements/s of narrow, widen and add per implementation."""
    import ml_dtypes
    import mxnet as mx
    import torch

    from hvd_trainer.backends.halves import NUMPY
    from hvd_trainer.torch.compression import KERNELS
    torch.set_num_threads(1)
    x = gradient_like(n)
    y = gradient_like(n, 1)
    rates = {}
    for dtype, name in ((np.float16, "float16"), (ml_dtypes.bfloat16, "bfloat16")):
        h, g, out, wide = x.astype(dtype), y.astype(dtype), np.empty(n, dtype), np.empty_like(x)
        for label, k in (("numpy" if name == "float16" else "ml_dtypes", NUMPY),
                         ("torch", KERNELS)):
            rates[f"{name} {label}"] = {
                "narrow": best_seconds(lambda: k.narrow(x, out)),
                "widen": best_seconds(lambda: k.widen(h, wide)),
                "add": best_seconds(lambda: k.add(h, g, out))}
    mx_x, mx_h, mx_g = mx.nd.array(x), mx.nd.array(x, dtype="float16"), \
        mx.nd.array(y, dtype="float16")
    mx_out, mx_wide = mx.nd.empty(n, dtype="float16"), mx.nd.empty(n)
    mx.nd.waitall()

    def run(fn):
        def timed():
            fn()
            mx.nd.waitall()
        return best_seconds(timed)
    rates["float16 mxnet"] = {
        "narrow": run(lambda: mx.nd.Cast(mx_x, dtype="float16", out=mx_out)),
        "widen": run(lambda: mx.nd.Cast(mx_h, dtype="float32", out=mx_wide)),
        "add": run(lambda: mx.nd.elemwise_add(mx_h, mx_g, out=mx_out))}
    return {k: {op: n / s / 1e9 for op, s in v.items()} for k, v in rates.items()}


def interleaved(variants: Dict[str, Callable[[], float]], reps: int) -> Dict[str, float]:
    """Each variant's best over ``reps`` interleaved repetitions (each returns seconds)."""
    best = {k: float("inf") for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            best[k] = min(best[k], fn())
    return best


def step_seconds(steps: Dict[str, Callable[[], None]], framework: str,
                 finish: Callable[[], None]) -> Dict[str, float]:
    """Best seconds per step of each variant (``finish`` waits for queued work), warmed up,
    repetitions interleaved; the slowest rank's."""
    import hvd_trainer

    def repetition(step: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            hvd_trainer.barrier()
            tic = time.perf_counter()
            for _ in range(STEPS):
                step()
            finish()
            return slowest((time.perf_counter() - tic) / STEPS)
        return run
    for step in steps.values():
        for _ in range(STEP_WARMUP):
            step()
    finish()
    return interleaved({f"{framework} {k}": repetition(s) for k, s in steps.items()},
                       STEP_REPS)


def mxnet_steps() -> Dict[str, float]:
    import mxnet as mx

    import hvd_trainer
    from hvd_trainer.torch.compression import KERNELS
    steps = {}
    for name, params in (("none", None), ("fp16", {"type": "fp16"}),
                         ("fp16 torch kernels", {"type": "fp16"})):
        net = dense_mlp()
        trainer = hvd_trainer.DistributedTrainer(
            net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
            compression_params=params, prefix=f"mxnet {name}.")
        if name == "fp16 torch kernels":
            # What-if: the MXNet adapter has no vectorised kernels to hand down (MXNet's
            # are slower than NumPy's, table 1); this is its step if it had torch's.
            trainer._reducer.kernels = KERNELS
        x = mx.nd.random.uniform(shape=(64, 2048))
        y = mx.nd.array(np.random.RandomState(0).randint(0, 10, 64))
        steps[name] = training_step(net, trainer, x, y)
    return step_seconds(steps, "mxnet", mx.nd.waitall)


def torch_steps() -> Dict[str, float]:
    import torch

    import hvd_trainer.torch as hvd
    torch.set_num_threads(1)
    steps = {}
    for name, compression in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
        torch.manual_seed(0)
        layers = []
        for _ in range(8):
            layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
            compression=compression)
        x = torch.rand(64, 2048)
        y = torch.from_numpy(np.random.RandomState(0).randint(0, 10, 64))

        def step(model=model, opt=opt, x=x, y=y):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        steps[name] = step
    return step_seconds(steps, "torch", lambda: None)


def slowest(seconds: float) -> float:
    import hvd_trainer
    return float(hvd_trainer.allreduce(np.array([seconds]), op=hvd_trainer.Max)[0])


def bus_bandwidth() -> Dict[str, float]:
    """busbw in GB/s per (path, dtype, MiB)."""
    import torch

    import hvd_trainer
    import hvd_trainer.torch as hvd
    torch.set_num_threads(1)
    n = hvd_trainer.size()
    variants = {}
    for mib in SIZES:
        for dtype in (np.float32, np.float16):
            source = gradient_like(mib * MIB // np.dtype(dtype).itemsize).astype(dtype)
            array = source.copy()
            tensor = torch.from_numpy(source.copy())
            for path, reduce in (("numpy", lambda a=array: hvd_trainer.allreduce_(
                                     a, op=hvd_trainer.Sum, name="bus")),
                                 ("torch", lambda t=tensor: hvd.allreduce_(
                                     t, op=hvd.Sum, name="bus"))):
                buf = array if path == "numpy" else tensor.numpy()

                def run(reduce=reduce, buf=buf, source=source, nbytes=mib * MIB) -> float:
                    buf[...] = source  # the same values every time, not yet summed
                    hvd_trainer.barrier()
                    tic = time.perf_counter()
                    reduce()
                    return slowest(time.perf_counter() - tic) / (2 * (n - 1) / n * nbytes)
                variants[f"{path} {np.dtype(dtype).name} {mib}"] = run
    for run in variants.values():
        run()  # warm up: buffers and scratch
    best = interleaved(variants, BUS_REPS)
    return {k: 1 / s / 1e9 for k, s in best.items()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="2-rank launches (default 2)")
    parser.add_argument("--elements", type=int, default=1 << 23,
                        help="values per kernel measurement (default 8388608)")
    parser.add_argument("--worker", choices=["steps", "bus"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import hvd_trainer
        results = ({**mxnet_steps(), **torch_steps()} if args.worker == "steps"
                   else bus_bandwidth())
        if hvd_trainer.rank() == 0:
            report(results)
        return

    load = os.getloadavg()
    kernels = kernel_rates(args.elements)
    steps, bus = {}, {}
    for _ in range(args.rounds):
        for k, v in launch(__file__, 2, ["--worker", "steps"]).items():
            steps[k] = min(steps.get(k, float("inf")), v)
        for k, v in launch(__file__, 2, ["--worker", "bus"]).items():
            bus[k] = max(bus.get(k, 0.0), v)
    from mpi4py import MPI
    print(header("fp16", f"commit {commit()}, load average {load[0]:.2f} at start, "
                 f"{os.getloadavg()[0]:.2f} at end, "
                 f"{MPI.Get_library_version().splitlines()[0].strip()}, 2 ranks"))
    print(f"\nKernels, one core, {args.elements / 1e6:.1f} M gradient-like values, "
          "G elements/s (best of 5)")
    print("| dtype, kernels | narrow (from float32) | widen (to float32) | add (rounded once) |")
    print("|---|---|---|---|")
    for name, r in kernels.items():
        print(f"| {name} | {r['narrow']:.3f} | {r['widen']:.3f} | {r['add']:.3f} |")
    print("\n2-rank training step, 8 x Dense(2048) MLP, batch 64 per rank, ms")
    print("| framework | uncompressed | fp16 | fp16 / uncompressed (target <= 1.15) |")
    print("|---|---|---|---|")
    for fw, variant in (("mxnet", "fp16"), ("torch", "fp16"),
                        ("mxnet, torch's kernels (what-if)", "fp16 torch kernels")):
        none, fp16 = steps[f"{fw.split(',')[0]} none"], steps[f"{fw.split(',')[0]} {variant}"]
        print(f"| {fw} | {none * 1e3:.1f} | {fp16 * 1e3:.1f} | {fp16 / none:.2f} |")
    print("\n2-rank Sum allreduce bus bandwidth, GB/s")
    print("| path | MiB | float32 | float16 | float16 / float32 (target >= 0.9) |")
    print("|---|---|---|---|---|")
    for path in ("numpy", "torch"):
        for mib in SIZES:
            f32, f16 = bus[f"{path} float32 {mib}"], bus[f"{path} float16 {mib}"]
            print(f"| {path} | {mib} | {f32:.2f} | {f16:.2f} | {f16 / f32:.2f} |")


if __name__ == "__main__":
    main()
