"""Training-step efficiency: hvd_trainer.torch's DistributedOptimizer against PyTorch DDP.

Run:  python benchmarks/torch_ddp.py [--rounds 2]
It launches its own measurements as subprocesses. Per model and round, launches alternate
between one plain PyTorch process, 2 ranks with DistributedOptimizer (through hvdrun) and 2
ranks with DistributedDataParallel on gloo (through torchrun), at the same per-rank batch, so
that machine noise hits all alike; each launch keeps its best repetition (the slowest rank
sets each repetition's time) and the table keeps each variant's best launch. Efficiency is
t_single / t_2ranks (1.0 = perfect). One thread per process, as one process per core.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# name: (input width, layer width, layers, timed steps per repetition)
MODELS = {"40 x Linear(256)": (64, 256, 40, 30), "8 x Linear(2048)": (2048, 2048, 8, 4)}
BATCH, WARMUP, REPETITIONS = 64, 3, 3
VARIANTS = ("single", "hvd", "ddp")


def mlp(inputs: int, width: int, layers: int):
    """``layers`` Linear(width) + ReLU layers and a Linear(10) head."""
    import torch
    modules = []
    for i in range(layers):
        modules += [torch.nn.Linear(inputs if i == 0 else width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules, torch.nn.Linear(width, 10))


class Timing(NamedTuple):
    """How a launch's ranks agree: this rank, the slowest rank's value, a barrier."""

    rank: int
    slowest: Callable[[float], float]
    barrier: Callable[[], None]


def hvd_timing() -> Timing:
    """Timing over hvd_trainer.torch's ranks (initialises it)."""
    import torch
    import hvd_trainer.torch as hvd
    hvd.init()
    return Timing(hvd.rank(), lambda v: hvd.allreduce(torch.tensor([v]), op=hvd.Max).item(),
                  hvd.barrier)


def ddp_timing() -> Timing:
    """Timing over torch.distributed's gloo ranks (initialises the process group)."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")

    def slowest(value: float) -> float:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()
    return Timing(dist.get_rank(), slowest, dist.barrier)


def seconds_per_step(net: Any, optimizer: Any, inputs: int, steps: int, warmup: int,
                     timing: Timing, *, warm: Optional[Callable[[], None]] = None) -> float:
    """Best seconds per training step over the repetitions; the slowest rank sets the pace.
    ``warm`` is called once between the warm-up and the timed steps."""
    import torch
    x, y = torch.randn(BATCH, inputs), torch.randint(0, 10, (BATCH,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    if warm is not None:
        warm()
    best = float("inf")
    for _ in range(REPETITIONS):
        timing.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, timing.slowest((time.perf_counter() - start) / steps))
    return best


def measure(variant: str, name: str) -> None:
    """One launch's worker: time the training step of ``variant`` on model ``name``."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    inputs, width, layers, steps = MODELS[name]
    net = mlp(inputs, width, layers)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if variant == "hvd":
        timing = hvd_timing()
        import hvd_trainer.torch as hvd
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    elif variant == "ddp":
        timing = ddp_timing()
        net = torch.nn.parallel.DistributedDataParallel(net)
    else:
        timing = Timing(0, lambda value: value, lambda: None)
    best = seconds_per_step(net, optimizer, inputs, steps, WARMUP, timing)
    if timing.rank == 0:
        result = {"seconds": best}
        if variant == "hvd":  # which tree it imported (train_step.py --against checks it)
            result["file"] = hvd.__file__
        common.report(result)


def launch(variant: str, name: str, script: str = __file__, options: Sequence[str] = ()) -> float:
    """Seconds per step of one launch of ``variant`` (of ``script``'s workers, given
    ``options``: through hvdrun when it starts with "hvd", torchrun when with "ddp")."""
    worker = [os.path.abspath(script), *options, "--worker", variant, name]
    if variant == "single":
        cmd = [sys.executable] + worker
    elif variant.startswith("hvd"):
        cmd = [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "-np", "2", "--no-prefix",
               sys.executable] + worker
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2"] + worker
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    found = re.search(r"RESULT (\{.*\})", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return json.loads(found.group(1))["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "MODEL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        measure(*args.worker)
        return
    best = {(name, v): float("inf") for name in MODELS for v in VARIANTS}
    for _ in range(args.rounds):
        for name in MODELS:
            for variant in VARIANTS:
                best[name, variant] = min(best[name, variant], launch(variant, name))
    print(common.header("torch training step, batch 64 per rank, 1 thread per process",
                        f"best of {args.rounds} interleaved launches x {REPETITIONS} "
                        "repetitions"))
    print("| model | 1 process ms/step | DistributedOptimizer, 2 ranks | efficiency "
          "| DDP gloo, 2 ranks | efficiency |")
    print("|---|---|---|---|---|---|")
    for name in MODELS:
        single, hvd, ddp = (best[name, v] * 1e3 for v in VARIANTS)
        print(f"| {name} | {single:.1f} | {hvd:.1f} | {single / hvd:.2f} | {ddp:.1f} "
              f"| {single / ddp:.2f} |")


if __name__ == "__main__":
    main()
