"""hvd_trainer.torch.lightning.HorovodStrategy under hvdrun: a LightningModule trained with it
against the same module trained by Lightning's own DDP strategy (CPU, gloo) on the same ranks
and data; and the strategy's collectives against arithmetic."""
import os

import numpy as np
import torch
import pytorch_lightning as pl
from lightning_fabric.plugins.environments import LightningEnvironment

import hvd_trainer.torch as hvd
from hvd_trainer.torch.lightning import HorovodStrategy, register_horovod_strategy
from case_runner import run_cases

failures = []
BATCH, STEPS, EPOCHS = 4, 2, 2


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                       torch.nn.Linear(4, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)


def _loader():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(hvd.size() * BATCH * STEPS, 3)).astype(np.float32)
    y = (x @ np.array([[0.5], [-1.0], [2.0]], dtype=np.float32)) + 0.25
    data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def _fit(strategy, **kwargs):
    module = Regression()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=EPOCHS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **kwargs)
    trainer.fit(module, _loader())
    return module, trainer


def _weights(module):
    return [p.detach().numpy().copy() for p in module.parameters()]


def equals_lightning_ddp():
    ours, trainer = _fit(HorovodStrategy())
    if trainer.global_step != EPOCHS * STEPS:
        failures.append(f"{trainer.global_step} steps, expected {EPOCHS * STEPS}")
    # Rank 0 holds DDP's rendezvous store itself, bound to a free port in one step, and every
    # rank joins it as a client (torch's agent store): a port probed and closed first was
    # taken by another test's job before torch bound it (EADDRINUSE, CI 2026-12-07).
    store = port = None
    if hvd.rank() == 0:
        store = torch.distributed.TCPStore("127.0.0.1", 0, hvd.size(), True,
                                           wait_for_workers=False)
        port = store.port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(hvd.broadcast_object(port)),
                      LOCAL_RANK="0", NODE_RANK=str(hvd.rank()), WORLD_SIZE=str(hvd.size()),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        # Lightning would pick its MPI environment under mpiexec: name the plain one.
        reference, _ = _fit("ddp", devices=1, num_nodes=hvd.size(),
                            plugins=[LightningEnvironment()])
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
        del store
    for got, want in zip(_weights(ours), _weights(reference)):
        if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            failures.append(f"rank {hvd.rank()}: HorovodStrategy {got.ravel()[:4]} != "
                            f"DDP {want.ravel()[:4]}")
    first = hvd.allgather_object(_weights(ours)[0])
    if any(not np.array_equal(first[0], other) for other in first):
        failures.append("the ranks' weights differ")


def collectives_and_the_name():
    strategy = HorovodStrategy()
    rank, size = hvd.rank(), hvd.size()
    value = torch.tensor([float(rank + 1)])
    checks = {"sum": strategy.reduce(value, reduce_op="sum").item() == size * (size + 1) / 2,
              "mean": abs(strategy.reduce(value).item() - (size + 1) / 2) < 1e-6,
              "max": strategy.reduce(value, reduce_op="max").item() == size,
              "gather": strategy.all_gather(value).reshape(-1).tolist() ==
              [float(r + 1) for r in range(size)],
              "broadcast": strategy.broadcast({"from": rank}, src=size - 1) == {"from": size - 1},
              "any": strategy.reduce_boolean_decision(rank == 0, all=False),
              "all": not strategy.reduce_boolean_decision(rank == 0),
              "sampler": strategy.distributed_sampler_kwargs == {"num_replicas": size,
                                                                 "rank": rank}}
    strategy.barrier()
    failures.extend(f"rank {rank}: {name} is wrong" for name, ok in checks.items() if not ok)
    register_horovod_strategy()
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", logger=False)
    if not isinstance(trainer.strategy, HorovodStrategy):
        failures.append(f"strategy='horovod' gave {type(trainer.strategy).__name__}")


if __name__ == "__main__":
    hvd.init()
    run_cases({"equals_lightning_ddp": equals_lightning_ddp,
               "collectives_and_the_name": collectives_and_the_name}, failures)
