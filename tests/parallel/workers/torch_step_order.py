"""What a Horovod script does between backward and step, and join before any step, against
hand-computed weights (SGD, lr 0.1, loss = sum over the used parameters of p . [0, 1, 2, 3],
so each used parameter's gradient is [0, 1, 2, 3] on each rank that uses it).

1. An allreduce_async of the loss between backward() and step(), every parameter used, one
   bucket: the step must be ordered before that allreduce on every rank.
2. The same with one bucket per parameter (num_groups=4) and ranks other than 0 using only
   parameters 0 and 2: no rank's buckets all complete during backward there.
3. A synchronous allreduce of the loss there, with ranks other than 0 using only
   parameters 0 and 2, in one bucket: it must close the step rather than wait behind it.
4. Ranks other than 0 join before their first step (they have no batch in epoch 0), then
   everyone trains: the joined ranks must learn which gradients the others found dense.
Each is a case of its own (see case_runner.py).
"""
import numpy as np
import torch

import hvd_trainer.torch as hvd
from case_runner import run_cases

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
RAMP = np.arange(4.0)
STEPS = 40


def between_backward_and_step(num_groups: int, used_here: list, used_count: list,
                              synchronous: bool = False) -> None:
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
                                     for _ in range(4)])
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.1),
                                         named_parameters=params.named_parameters(),
                                         num_groups=num_groups)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = sum((params[i] * torch.from_numpy(RAMP)).sum() for i in used_here)
        loss.backward()
        if synchronous:
            losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
            optimizer.step()
        else:
            handle = hvd.allreduce_async(loss.detach(), name="loss")  # metric averaging
            optimizer.step()
            losses.append(float(hvd.synchronize(handle)))
    for i, p in enumerate(params):
        want = 1 - STEPS * 0.1 * used_count[i] / SIZE * RAMP
        np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12,
                                   err_msg=f"num_groups={num_groups}: parameter {i}")
    assert len(losses) == STEPS


def join_before_first_step() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).double()
    start = [p.detach().clone() for p in net.parameters()]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters())
    for epoch, batches in enumerate((1 if RANK == 0 else 0, 2)):
        for _ in range(batches):
            optimizer.zero_grad()
            net(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
            optimizer.step()
        last = hvd.join()
        assert epoch == 1 or last == 0, f"rank 0 joined last in epoch 0, join said {last}"
        # A joined rank's weights stopped where it joined (Horovod's pattern).
        hvd.broadcast_parameters(net.state_dict(), root_rank=last)
    # d(sum of outputs)/dW = 1 and /db = 1 on each rank that steps; Average divides by the
    # full size: epoch 0 moves by 0.1 / SIZE, epoch 1 by 2 * 0.1.
    for p, p0 in zip(net.parameters(), start):
        np.testing.assert_allclose(p.detach().numpy(), p0.numpy() - 0.1 / SIZE - 0.2,
                                   rtol=1e-12, err_msg="join before the first step")


OTHERS = [0, 1, 2, 3] if RANK == 0 else [0, 2]
run_cases({
    "async_one_bucket": lambda: between_backward_and_step(0, [0, 1, 2, 3], [SIZE] * 4),
    "async_bucket_per_parameter": lambda: between_backward_and_step(4, OTHERS,
                                                                    [SIZE, 1, SIZE, 1]),
    "sync_closes_the_step": lambda: between_backward_and_step(0, OTHERS, [SIZE, 1, SIZE, 1],
                                                              synchronous=True),
    "join_before_first_step": join_before_first_step})
