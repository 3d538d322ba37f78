"""The torch training step with PowerSGD: hvd_trainer.torch's against PyTorch DDP's
``powerSGD_hook`` (gloo), and both uncompressed.

Run:  python benchmarks/powersgd_step.py [--rounds 2] [--rank 4] [--start-iter 2]
Each launch is 2 processes on this machine (hvdrun for ours, torchrun for DDP), the same
model, batch, PowerSGD rank and start iteration; the warm-up steps pass the start iteration,
so the timed steps are compressed. Launches alternate between the four variants, so that
machine noise hits all alike; each keeps its best repetition (the slowest rank sets each
repetition's time) and the table keeps each variant's best launch, as ratios to DDP's
uncompressed step measured in the same run. One thread per process. DDP's gradients travel
in one bucket (see measure()). On one host the link is memory, so this measures the compute
PowerSGD adds, not what it saves on a slow link.
"""
import argparse
import os
import sys
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from torch_ddp import (BATCH, MODELS, REPETITIONS, WARMUP, Timing, ddp_timing,  # noqa: E402
                       hvd_timing, launch, mlp, seconds_per_step)

VARIANTS = ("hvd", "hvd-powersgd", "ddp", "ddp-powersgd")
NAME = "8 x Linear(2048)"


class Setup(NamedTuple):
    """A launch's model, its (distributed) optimizer and how its ranks agree."""

    net: Any
    optimizer: Any
    timing: Timing


def setup(variant: str, rank: int, start_iter: int) -> Setup:
    """The model of ``variant`` ready to train: ours with ``Compression.powersgd`` or none
    (hvd_trainer.torch initialised), or DDP with ``powerSGD_hook`` or none (gloo's process
    group initialised from torchrun's variables)."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    inputs, width, layers, _ = MODELS[NAME]
    net = mlp(inputs, width, layers)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if variant.startswith("hvd"):
        timing = hvd_timing()
        import hvd_trainer.torch as hvd
        compression = (hvd.Compression.powersgd(rank=rank, start_iter=start_iter)
                       if variant == "hvd-powersgd" else hvd.Compression.none)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                             compression=compression)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        timing = ddp_timing()
        # One bucket: with several, DDP's powerSGD_hook on gloo (torch 2.13) issued its
        # buckets' allreduces in different orders on the two ranks and aborted ("Received
        # data size doesn't match expected size").
        net = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=256)
        if variant == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=rank,
                                                start_powerSGD_iter=start_iter)
            net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return Setup(net, optimizer, timing)


def warmup_steps(start_iter: int) -> int:
    """Warm-up steps that pass the start iteration, so that every timed step is compressed."""
    return max(WARMUP, start_iter + 1)


def measure(variant: str, rank: int, start_iter: int) -> None:
    """One launch's worker: time the training step of ``variant``."""
    inputs, _, _, steps = MODELS[NAME]
    net, optimizer, timing = setup(variant, rank, start_iter)
    best = seconds_per_step(net, optimizer, inputs, steps, warmup_steps(start_iter), timing)
    if timing.rank == 0:
        common.report({"seconds": best})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's approximation rank")
    parser.add_argument("--start-iter", type=int, default=2,
                        help="exact steps before compression (DDP needs more than 1)")
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "MODEL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        measure(args.worker[0], args.rank, args.start_iter)
        return
    best = dict.fromkeys(VARIANTS, float("inf"))
    for _ in range(args.rounds):
        for variant in VARIANTS:
            best[variant] = min(best[variant], launch(
                variant, NAME, __file__, ["--rank", str(args.rank),
                                          "--start-iter", str(args.start_iter)]))
    print(common.header(f"torch step with PowerSGD rank {args.rank} from step "
                        f"{args.start_iter}, {NAME}, batch {BATCH} per rank, 2 processes, "
                        "1 thread each", f"best of {args.rounds} interleaved launches x "
                        f"{REPETITIONS} repetitions"))
    print("| variant | ms/step | / DDP uncompressed |")
    print("|---|---|---|")
    for variant in VARIANTS:
        print(f"| {variant} | {best[variant] * 1e3:.1f} | {best[variant] / best['ddp']:.2f} |")


if __name__ == "__main__":
    main()
