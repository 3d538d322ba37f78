"""An elastic torch training for the engines' elastic tests (run_elastic, ElasticRayExecutor):
the function each rank runs, and the one-process replay of its commits that its final weights
are checked against.

The function trains tests/parallel/workers/elastic_model's Linear(5, 3) under
``hvd.elastic.run`` with a TorchState (model, optimizer, sampler, epoch, step and the history
of global batches), committing every COMMIT_EVERY steps. In its first life, at step
SIGNAL_AT_STEP (right after the commit of that step), rank 0 writes ``signal`` (a path)
and the ranks wait there, checking for host changes, for the test to take an agent or a task
away (the test writes ``signal + ".taken"`` first, so that later lives pass on). A life that
runs on fewer ranks than the first ends the epoch, commits, and then waits for the job to
grow back (the host change arrives as HostsUpdatedInterrupt), so that the test sees a shrink
and a growth in one run, whatever the timing, and every life's ranks share its epoch's
samples evenly: lives (first, 0), (fewer, COMMIT_EVERY), (first, the step that ended epoch
0). Rank 0 prints ``LIFE size=S step=K`` at each start, every rank ``RANK size=S step=K
host=H pid=P at=T``, and rank 0 returns
the final weights and history; the other ranks return None.
"""
import os
import re
import sys
from typing import Dict, List, NamedTuple, Tuple

import cloudpickle
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel",
                                "workers"))

import elastic_model  # noqa: E402  (after its folder is on the path)
from elastic_model import BATCH, EPOCHS, data, make_torch_net, torch_step  # noqa: E402

# The ranks cannot import these modules: the function and its model travel by value.
cloudpickle.register_pickle_by_value(elastic_model)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# The signal comes right after a commit: a life that fails there and one that leaves there
# (at a host change) both go on from it. 36 samples in batches of 2: the 12 left of epoch 0
# share evenly on 2 ranks, and epoch 1 on 3.
COMMIT_EVERY = SIGNAL_AT_STEP = 4
LR, MOMENTUM = 0.05, 0.9
GROW_WAIT_SECONDS = 120


def train(signal_path: str, first_size: int):
    """The function each rank runs (see the module's docstring); ``first_size``: the first
    life's ranks."""
    import os
    import socket
    import time
    import torch
    import hvd_trainer.torch as hvd

    hvd.init()
    X, Y = (torch.from_numpy(a) for a in data())
    model = make_torch_net()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=model.named_parameters())
    dataset = torch.utils.data.TensorDataset(X, Y)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)

    @hvd.elastic.run
    def run(state):
        if hvd.rank() == 0:
            print(f"LIFE size={hvd.size()} step={state.step}", flush=True)
        print(f"RANK size={hvd.size()} step={state.step} host={socket.gethostname()} "
              f"pid={os.getpid()} at={time.time():.3f}", flush=True)
        while state.epoch < EPOCHS:
            for position, (x, y) in enumerate(loader):
                if hvd.size() == first_size and state.step == SIGNAL_AT_STEP \
                        and not os.path.exists(signal_path + ".taken"):
                    if hvd.rank() == 0:
                        with open(signal_path, "w"):
                            pass
                    _wait_for_hosts(state, "no agent or task was taken away")
                torch_step(state, optimizer, x, y, position,
                           state.sampler.get_indices(position, BATCH), COMMIT_EVERY)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            if hvd.size() < first_size:
                state.commit()
                _wait_for_hosts(state, "the job did not grow back")
        if hvd.rank() == 0:
            return {"weights": [p.detach().numpy().tolist() for p in (model.weight, model.bias)],
                    "history": state.history, "steps": state.step}
        return None

    def _wait_for_hosts(state, otherwise):
        """Until a host change interrupts (it restarts the job from the last commit)."""
        deadline = time.monotonic() + GROW_WAIT_SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.1)
            state.check_host_updates()
        raise RuntimeError(otherwise)

    return run(hvd.elastic.TorchState(model, optimizer, epoch=0, step=0, history=[],
                                      sampler=sampler))


def lives(stdout: str) -> List[Tuple[int, int]]:
    """(size, step) at the start of each life, as rank 0 printed them."""
    return [(int(size), int(step))
            for size, step in re.findall(r"LIFE size=(\d+) step=(\d+)", stdout)]


class RankProcesses(NamedTuple):
    """The ranks of a life as they printed it at its start (or when the survivors of a
    shrink went on: hvdrun --ulfm): its size and step, each host's rank's process id, and
    when (time.time()) the last of them started the training function."""

    size: int
    step: int
    pids: Dict[str, int]
    at: float


def rank_processes(stdout: str) -> List[RankProcesses]:
    """Each life's :class:`RankProcesses`, in order."""
    found: Dict[Tuple[int, int], RankProcesses] = {}
    for size, step, host, pid, at in re.findall(
            r"RANK size=(\d+) step=(\d+) host=(\S+) pid=(\d+) at=([\d.]+)", stdout):
        key = (int(size), int(step))
        life = found.setdefault(key, RankProcesses(key[0], key[1], {}, 0.0))
        life.pids[host] = int(pid)
        found[key] = life._replace(at=max(life.at, float(at)))
    return list(found.values())


def reference_weights(history) -> List[np.ndarray]:
    """The global batches of ``history`` replayed in one process with torch's SGD: each
    step's gradient is the sum over the global batch divided by the ranks then, as the
    DistributedOptimizer averages the ranks' summed losses."""
    import torch
    X, Y = (torch.from_numpy(a) for a in elastic_model.data())
    net = elastic_model.make_torch_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for _, size, batches in history:
        batch = [i for part in batches for i in part]
        optimizer.zero_grad()
        (((net(X[batch]) - Y[batch]) ** 2).sum() / size).backward()
        optimizer.step()
    return [p.detach().numpy() for p in (net.weight, net.bias)]


def check_result(result: dict, stdout: str, first_size: int) -> None:
    """The job shrank after the commit of step COMMIT_EVERY and went on from it, grew back to
    ``first_size``, saw every sample once per epoch, and ended with the weights of the
    one-process replay of its commits."""
    found = lives(stdout)
    assert found[0] == (first_size, 0), found
    # The second life starts from the last commit before the agent or task was taken away: a
    # commit lost (or one never made) would start it elsewhere.
    assert found[1][0] < first_size and found[1][1] == COMMIT_EVERY, found
    history = result["history"]
    assert found[-1] == (first_size, sum(1 for epoch, _, _ in history if epoch == 0)), found
    assert len(history) == result["steps"]
    for epoch in range(elastic_model.EPOCHS):
        seen = sorted(i for e, _, batches in history if e == epoch
                      for batch in batches for i in batch)
        assert seen == list(range(elastic_model.NUM_SAMPLES)), (epoch, seen)
    for got, want in zip(result["weights"], reference_weights(history)):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)
