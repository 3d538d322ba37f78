"""TorchState with 2-bit compression (error feedback), then PowerSGD, on 2 ranks, in one life
each: rank 1's commit is lost, a fresh model and optimizer recover rank 0's commit, and their
next step must equal that of a job that never left (so rank 1's residuals, and PowerSGD's
factors and counts, came back from rank 0's copy).

Usage: elastic_torch_residuals.py FOLDER (each rank commits to FOLDER/<compressor>/rank<r>).
Prints ``RESIDUALS OK`` and ``POWERSGD OK`` on rank 0.
"""
import glob
import os
import sys

import torch

import hvd_trainer.torch as hvd
from hvd_trainer.compression import TwoBit
from hvd_trainer.collectives.powersgd import PowerSGD
from hvd_trainer.training import hook_state
from hvd_trainer_launch import protocol

hvd.init()
# What hvdrun's elastic mode sets (this job is a plain one): the job's secret (and the folder).
os.environ[protocol.SECRET_VARIABLE] = "the job's secret"
torch.manual_seed(5 + hvd.rank())  # each rank its own data
BATCHES = [(torch.randn(6, 4), torch.randn(6, 2)) for _ in range(5)]


def two_bit():
    compressor = TwoBit(threshold=0.05)
    compressor.min_size = 1
    return compressor


def powersgd():
    # Linear(4, 2)'s 2 x 4 weight is factored only below a rate of 8 / 6.
    return PowerSGD(rank=1, start_iter=1, min_compression_rate=0.5)


def build(prefix: str, make):
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5), compression=make(),
        named_parameters=[(prefix + n, p) for n, p in model.named_parameters()])
    return model, optimizer


def step(model, optimizer, k: int) -> None:
    x, y = BATCHES[k]
    optimizer.zero_grad()
    ((model(x) - y) ** 2).sum().backward()
    optimizer.step()


def lose_a_commit(make, name: str) -> None:
    folder = os.path.join(sys.argv[1], name, f"rank{hvd.rank()}")
    os.environ[protocol.ELASTIC_DIR_VARIABLE] = folder
    model, optimizer = build(f"{name}.first.", make)
    state = hvd.elastic.TorchState(model, optimizer)
    state.recover()
    step(model, optimizer, 0)
    step(model, optimizer, 1)
    state.commit()
    assert hook_state.kept(optimizer._reducer).residuals, f"{name} kept no residuals"
    step(model, optimizer, 3)  # lost with the life
    if hvd.rank() == 1:
        for path in glob.glob(os.path.join(folder, "*.commit")):
            os.remove(path)
    again, again_optimizer = build(f"{name}.again.", make)
    hvd.elastic.TorchState(again, again_optimizer).recover()
    step(again, again_optimizer, 2)

    whole, whole_optimizer = build(f"{name}.whole.", make)
    for k in range(3):
        step(whole, whole_optimizer, k)
    for got, want in zip(again.parameters(), whole.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


lose_a_commit(two_bit, "2bit")
if hvd.rank() == 0:
    print("RESIDUALS OK", flush=True)
lose_a_commit(powersgd, "powersgd")
if hvd.rank() == 0:
    print("POWERSGD OK", flush=True)
