"""The torch training that the engine tests run on their ranks, written as Horovod's engine
users write it (a Ray Train ``HorovodTrainer`` loop moved to RayExecutor, a Databricks
HorovodRunner ``main``: both ``import horovod.torch``, which the ranks get from the shim), the
same model trained by Lightning 2 with hvd_trainer's HorovodStrategy, and the reference: one
process on the global batch. The functions travel to the ranks by value, so that the ranks
need not import this module (tests/engines and the multi-host test bed's drivers use it)."""
import sys

import cloudpickle

RANKS = 3
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def model_and_batch():
    """A small model and a fixed global batch of 4 rows per rank."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    return model, torch.randn(4 * RANKS, 6), torch.randn(4 * RANKS, 2)


def optimizer_of(model):
    import torch
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def weights(model):
    """The model's parameters as NumPy arrays."""
    return [p.detach().numpy().copy() for p in model.parameters()]


def _steps(model, optimizer, x, y, steps):
    import torch
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return weights(model)


def one_process(steps):
    """The reference: ``steps`` steps of the model on the whole batch in this process."""
    model, x, y = model_and_batch()
    return _steps(model, optimizer_of(model), x, y, steps)


def train_func(config):
    """A Ray Train ``train_loop_per_worker`` (``config["steps"]`` steps), unchanged: on each
    rank its slice of the batch, gradients averaged by horovod.torch's DistributedOptimizer."""
    import horovod.torch as hvd
    hvd.init()
    model, x, y = model_and_batch()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    optimizer = hvd.DistributedOptimizer(optimizer_of(model),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return _steps(model, optimizer, x, y, config["steps"])


def main(steps):
    """A HorovodRunner ``main(**kwargs)``: train_func's training."""
    return train_func({"steps": steps})


def lightning_steps(steps):
    """The same training with Lightning 2 and hvd_trainer's HorovodStrategy: one step an epoch
    for ``steps`` epochs, each rank on its share of the batch (Lightning's DistributedSampler
    deals the rows as train_func slices them)."""
    import torch
    import pytorch_lightning as pl
    from hvd_trainer.torch.lightning import HorovodStrategy
    model, x, y = model_and_batch()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return optimizer_of(self.model)
    trainer = pl.Trainer(strategy=HorovodStrategy(), accelerator="cpu", max_epochs=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                      batch_size=len(x) // RANKS))
    return weights(model)
