"""hvd_trainer.torch.DistributedOptimizer under HVD_AUTOTUNE=1 (small samples) against one
process on the global batch: through every change of bucket layout the gradients must stay
the parameters' own (views of the new buckets) and the weights must track plain PyTorch.
"""
import copy

import numpy as np
import torch

import hvd_trainer.torch as hvd
from case_runner import run_cases

WIDE = 640  # a 640x640 float32 weight is 1.6 MB: 1 MiB and 4 MiB buckets lay out differently
PER_RANK, AFTER = 4, 3


def autotuned_training() -> None:
    hvd.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, WIDE), torch.nn.Tanh(),
                              torch.nn.Linear(WIDE, WIDE), torch.nn.Tanh(),
                              torch.nn.Linear(WIDE, 4))
    single = copy.deepcopy(net)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=net.named_parameters())
    reference = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    tuner = optimizer._reducer.autotuner
    assert tuner is not None, "HVD_AUTOTUNE=1 but the reducer has no autotuner"
    rng = np.random.default_rng(1)
    layouts = set()
    for step in range(tuner.last_step + 1 + AFTER):
        x = torch.from_numpy(rng.normal(size=(PER_RANK * hvd.size(), 8)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, 4, size=PER_RANK * hvd.size()))
        mine = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
        optimizer.step()
        reference.zero_grad()
        torch.nn.functional.cross_entropy(single(x), y).backward()
        reference.step()
        layouts.add(len(optimizer._reducer.buckets))
        for name, p in net.named_parameters():
            want = dict(single.named_parameters())[name]
            np.testing.assert_allclose(p.detach().numpy(), want.detach().numpy(), rtol=1e-4,
                                       atol=1e-5, err_msg=f"step {step}: {name}")
    assert len(layouts) > 1, f"the autotuner never changed the bucket layout: {layouts}"
    print(f"rank {hvd.rank()}: {sorted(layouts)} buckets", flush=True)


if __name__ == "__main__":
    run_cases({"autotuned_training": autotuned_training}, rank=hvd.rank())
