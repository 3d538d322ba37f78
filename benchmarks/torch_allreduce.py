"""hvd_trainer.torch against gloo: allreduce bus bandwidth, and the optimizer's own cost per step.

Run on 2 ranks:  hvdrun -np 2 python benchmarks/torch_allreduce.py [--quick]
Both parts run in the same two processes, which also join a gloo process group
(torch.distributed, the backend DDP uses on CPU), so every variant works on the same buffers
in interleaved rounds and machine noise hits all alike; each variant keeps its best round.

1. Allreduce (sum, float32, in place) of 1 to 64 MiB: ``hvd.allreduce_`` vs gloo's
   ``dist.all_reduce`` vs raw ``MPI_Allreduce`` through mpi4py.
   busbw = bytes / t * 2 (n - 1) / n, as nccl-tests defines it.
2. A model of 100 small parameters (50 Linear(16, 16)): a training step with
   DistributedOptimizer, minus the least a data-parallel step needs (the same step with the
   plain optimizer followed by one raw MPI_Allreduce of all the gradient bytes, so the ranks
   also wait for each other), is the adapter's overhead per step.
"""
import argparse
import socket
import time
from typing import Callable, Dict

import torch
import torch.distributed as dist
import common
from mpi4py import MPI

import hvd_trainer.torch as hvd

MIB = 1 << 20


def timed(fn: Callable[[], None], iters: int) -> float:
    """Seconds per call; the slowest rank defines the time."""
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return MPI.COMM_WORLD.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def best_of(variants: Dict[str, Callable[[], None]], rounds: int, iters: int) -> Dict[str, float]:
    best = {k: float("inf") for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            best[k] = min(best[k], timed(fn, iters))
    return best


def join_gloo() -> None:
    """Make these MPI ranks a gloo process group, rendezvousing at rank 0's free port."""
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=hvd.rank(), world_size=hvd.size())


def allreduce_table(rounds: int) -> None:
    n = hvd.size()
    comm = MPI.COMM_WORLD
    if hvd.rank() == 0:
        print("| size | hvd_trainer.torch allreduce_ | gloo all_reduce | raw MPI_Allreduce "
              "| busbw hvd / gloo |")
        print("|---|---|---|---|---|")
    for mib in (1, 4, 16, 64):
        buf = torch.ones(mib * MIB // 4)
        raw = buf.numpy()
        iters = max(3, 64 // mib)
        best = best_of({
            "hvd": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="bench"),
            "gloo": lambda: dist.all_reduce(buf),
            "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, raw),
        }, rounds, iters)
        busbw = {k: mib * MIB / t * 2 * (n - 1) / n / 1e9 for k, t in best.items()}
        if hvd.rank() == 0:
            cells = " | ".join(f"{best[k] * 1e3:.2f} ms, {busbw[k]:.2f} GB/s"
                               for k in ("hvd", "gloo", "mpi"))
            print(f"| {mib} MiB | {cells} | {busbw['hvd'] / busbw['gloo']:.2f} |", flush=True)


def overhead(rounds: int) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(50)))

    x = torch.randn(8, 16)
    plain_net, net = model(), model()
    plain = torch.optim.SGD(plain_net.parameters(), lr=1e-3)
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3),
                                       named_parameters=net.named_parameters())
    flat = torch.zeros(sum(p.numel() for p in net.parameters())).numpy()

    def step(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
        return run

    local = step(plain_net, plain)

    def least() -> None:
        local()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, flat)

    best = best_of({"plain": local, "least": least, "hvd": step(net, wrapped)}, rounds, 50)
    if hvd.rank() == 0:
        own = best["hvd"] - best["least"]
        print(f"\n100 parameters ({flat.nbytes / 1024:.1f} KiB of gradients): plain step "
              f"{best['plain'] * 1e3:.3f} ms; plain step + raw MPI_Allreduce of the gradient "
              f"bytes {best['least'] * 1e3:.3f} ms; DistributedOptimizer step "
              f"{best['hvd'] * 1e3:.3f} ms; adapter overhead {own * 1e3:.3f} ms per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = parser.parse_args()
    rounds = 2 if args.quick else 7
    torch.set_num_threads(1)
    hvd.init()
    join_gloo()
    if hvd.rank() == 0:
        print(common.header(f"torch allreduce on {hvd.size()} ranks", f"best of {rounds} "
                            "interleaved rounds"))
    allreduce_table(rounds)
    overhead(rounds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
