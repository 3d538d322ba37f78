"""DistributedOptimizer with each of the core's packed codecs against a NumPy model of it.

One process replays the job: each rank's gradient from a replica of the weights on that rank's
rows, each rank's residual per tensor, the codec's rule written out here (not the library's),
the decoded values summed and averaged, then plain torch SGD. Tensors under the codecs'
min_size (the biases) are averaged uncompressed. PowerSGD replays its own NumPy model
(powersgd_model.py). A user's comm hook (register_comm_hook) against the built-in sum.
Each case reports on its own (case_runner.py).
"""
import copy
import math

import numpy as np
import torch

import hvd_trainer
import hvd_trainer.torch as hvd
from case_runner import run_cases
from hvd_trainer.compression import OneBit, ScaledTwoBit, TopK, TwoBit
from hvd_trainer.training import hooks
from powersgd_model import PowerSGDModel

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
B, STEPS = 6, 3


def two_bit(x: np.ndarray, t: np.float32) -> np.ndarray:
    return (np.where(x >= t, t, 0) - np.where(x <= -t, t, 0)).astype(np.float32)


def scaled_two_bit(x: np.ndarray, g: np.ndarray, t: float) -> np.ndarray:
    return two_bit(x, np.float32(t * float(np.abs(g).astype(np.float64).sum()) / g.size))


def one_bit(x: np.ndarray, t: np.float32) -> np.ndarray:
    return np.where(x > t, 1, -1).astype(np.float32)


def top_k(x: np.ndarray, ratio: float) -> np.ndarray:
    sent = np.zeros_like(x)
    index = np.argsort(np.abs(x))[x.size - math.ceil(ratio * x.size):]
    sent[index] = x[index]
    return sent


CASES = {
    "2bit": (TwoBit(0.001), lambda x, g: two_bit(x, np.float32(0.001))),
    "scaled 2bit": (ScaledTwoBit(1.0), lambda x, g: scaled_two_bit(x, g, 1.0)),
    "1bit": (OneBit(0.0), lambda x, g: one_bit(x, np.float32(0.0))),
    "topk": (TopK(0.1), lambda x, g: top_k(x, 0.1)),
}


def batch(step: int, rank: int):
    rng = np.random.default_rng(10 * step + rank)
    return (torch.from_numpy(rng.normal(size=(B, 40)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 16, size=B)))


def loss(net: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return torch.nn.functional.cross_entropy(net(x), y)


def run(case: str) -> None:
    codec, rule = CASES[case]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    single, start = copy.deepcopy(net), copy.deepcopy(net)
    lr = 0.001 if case == "1bit" else 0.1  # 1-bit sends +-1 whatever the gradient's scale
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
                                         named_parameters=net.named_parameters(),
                                         compression=codec)
    reference = torch.optim.SGD(single.parameters(), lr=lr, momentum=0.9)
    residuals = {(r, name): np.zeros(p.numel(), np.float32)
                 for r in range(SIZE) for name, p in single.named_parameters()}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss(net, step, RANK).backward()
        optimizer.step()
        summed = {name: np.zeros(p.numel(), np.float32) for name, p in single.named_parameters()}
        for r in range(SIZE):
            single.zero_grad()
            loss(single, step, r).backward()
            for name, p in single.named_parameters():
                g = p.grad.numpy().reshape(-1).copy()
                if g.size < codec.min_size:
                    summed[name] += g
                    continue
                x = residuals[r, name] + g
                sent = rule(x, g)
                residuals[r, name] = x - sent
                summed[name] += sent
        for name, p in single.named_parameters():
            p.grad = torch.from_numpy(summed[name] / SIZE).reshape(p.shape)
        reference.step()
    for (name, p), want in zip(net.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.detach(), want.detach(), rtol=1e-5, atol=1e-6,
                                   msg=f"{case}: {name}")
    moved = sum(float((p - q).abs().sum()) for p, q in zip(net.parameters(), start.parameters()))
    assert moved > 0, f"{case}: the weights did not move"


def run_powersgd() -> None:
    """hvd.Compression.powersgd in DistributedOptimizer against the NumPy model, replayed."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    single = copy.deepcopy(net)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        named_parameters=net.named_parameters(),
        compression=hvd.Compression.powersgd(rank=2, start_iter=1))
    reference = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    model = PowerSGDModel(SIZE, rank=2, start_iter=1)
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        loss(net, step, RANK).backward()
        optimizer.step()
        grads = {}
        for r in range(SIZE):
            single.zero_grad()
            loss(single, step, r).backward()
            for key, p in enumerate(single.parameters()):
                grads.setdefault(key, []).append(p.grad.numpy().copy())
        for key, p in enumerate(single.parameters()):
            summed = model.sum(key, grads[key]).astype(np.float32)
            p.grad = torch.from_numpy(summed / SIZE)
        reference.step()
    for (name, p), want in zip(net.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.detach(), want.detach(), rtol=1e-4, atol=1e-5,
                                   msg=f"powersgd: {name}")
    assert model.compressed(tuple(net[0].weight.shape), np.float32), "nothing was factored"
    every = hvd.allgather_object([p.detach().numpy() for p in net.parameters()])
    for r, theirs in enumerate(every):
        assert all(np.array_equal(a, b) for a, b in zip(every[0], theirs)), f"rank {r} differs"


def summing_hook(calls, bucket):
    """A user's comm hook: the bucket summed by hvd_trainer.allreduce into a new array."""
    calls.append(bucket.index)
    return hooks.done(hvd_trainer.allreduce(bucket.buffer, op=hvd_trainer.Sum,
                                            name=f"user.{bucket.index}",
                                            prescale_factor=bucket.prescale,
                                            process_set=bucket.process_set))


def run_comm_hook() -> None:
    """register_comm_hook: a user's hook that sums as the built-in one does gives the same
    weights, bit for bit, and is called once per bucket and step; registering after the first
    step, or on an op=Adasum optimizer, is refused."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    nets = [net, copy.deepcopy(net)]
    plain, hooked = [hvd.DistributedOptimizer(
        torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{which}.{name}", p) for name, p in n.named_parameters()])
        for which, n in zip(("plain", "hooked"), nets)]
    calls = []
    hooked.register_comm_hook(calls, summing_hook)
    for step in range(STEPS):
        for n, optimizer in zip(nets, (plain, hooked)):
            optimizer.zero_grad()
            loss(n, step, RANK).backward()
            optimizer.step()
    for (name, p), q in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert torch.equal(p, q), f"comm hook: {name} differs from the built-in sum"
    assert len(calls) == STEPS * len(hooked._reducer.buckets) > 0, calls
    for refused in (hooked, hvd.DistributedOptimizer(
            torch.optim.SGD(copy.deepcopy(net).parameters(), lr=0.1), op=hvd.Adasum)
            if SIZE & (SIZE - 1) == 0 else hooked):
        try:
            refused.register_comm_hook(None, hooks.sum_hook)
        except ValueError:
            continue
        raise AssertionError("register_comm_hook was not refused")


run_cases({"2bit": lambda: run("2bit"), "scaled_2bit": lambda: run("scaled 2bit"),
           "1bit": lambda: run("1bit"), "topk": lambda: run("topk"), "powersgd": run_powersgd,
           "comm_hook": run_comm_hook})
