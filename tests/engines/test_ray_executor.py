"""hvd_trainer.ray.RayExecutor on a real local Ray instance (3 CPUs): results against NumPy,
Horovod's per-rank variables, a rank that raises, too few CPUs, a killed agent, Ctrl-C on the
driver, and no process left behind."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import numpy as np
import pytest

import engines
from hvd_trainer_launch import protocol
from hvd_trainer_launch.engine_launch import EngineError

RANKS = 3
# The ranks cannot import this test module: its functions travel by value, as __main__'s do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _collective(scale):
    """On each rank: its place and a Sum allreduce and allgather of rank-made arrays."""
    import os
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    mine = np.arange(5.0) * (hvd.rank() + 1) * scale
    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
            {name: os.environ.get(name) for name in names},
            hvd.allreduce(mine, op=hvd.Sum), hvd.allgather(mine[None, :] + hvd.rank()))


@pytest.fixture(scope="module")
def executor(ray_cluster):
    from hvd_trainer.ray import RayExecutor
    job = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=RANKS)
    job.start()
    try:
        yield job
    finally:
        job.shutdown()


def test_results_against_numpy(executor):
    results = executor.run(_collective, args=[2.0])
    rows = [np.arange(5.0) * (rank + 1) * 2.0 for rank in range(RANKS)]
    for rank, (got_rank, size, local_rank, local_size, variables, summed, gathered) in \
            enumerate(results):
        assert (got_rank, size, local_rank, local_size) == (rank, RANKS, rank, RANKS)
        assert variables == {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(RANKS),
                             "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(RANKS),
                             "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
        np.testing.assert_array_equal(summed, np.sum(rows, axis=0))
        np.testing.assert_array_equal(gathered, np.stack([row + r for r, row in enumerate(rows)]))


def _raise_on_one():
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("rank one's own error")
    hvd.allreduce(np.ones(3))  # the others wait in a collective: the job must still end


def test_rank_that_raises_is_named_and_the_executor_goes_on(executor):
    started = time.monotonic()
    with pytest.raises(EngineError,
                       match=r"(?s)raised on rank 1 on host .*rank one.s own error") as raised:
        executor.run(_raise_on_one)
    assert isinstance(raised.value.__cause__, KeyError)
    assert time.monotonic() - started < 30
    assert engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE) == []
    # execute() and execute_single(), on the same executor after the failure.
    assert executor.execute(lambda worker: worker is None) == [True] * RANKS
    assert executor.execute_single(
        lambda worker: (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"])) == ("0", "1")


def test_too_few_cpus_is_a_timeout(ray_cluster):
    from hvd_trainer.ray import RayExecutor
    job = RayExecutor(RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=2),
                      num_workers=RANKS + 1)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"could not place 4 PACK bundles.*3 CPUs"):
        job.start()
    assert time.monotonic() - started < 15
    job.shutdown()


def _sleep_long():
    import time
    import hvd_trainer as hvd
    hvd.init()
    print("ranks asleep", flush=True)
    time.sleep(120)


def test_killed_agent_ends_the_job(executor, ray_cluster):
    outcome = {}

    def job():
        try:
            executor.run(_sleep_long)
        except Exception as error:
            outcome["error"] = error
    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 30
    while len(engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE)) < 2 * RANKS:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    time.sleep(1)
    ray_cluster.kill(executor._agents[0])
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), EngineError)
    assert "was lost" in str(outcome["error"]) or "exited with code" in str(outcome["error"])
    deadline = time.monotonic() + 10
    while engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE):
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)
    executor.shutdown()  # a lost agent: start afresh
    executor.start()
    assert [r[0] for r in executor.run(_collective, args=[1.0])] == list(range(RANKS))


_DRIVER = textwrap.dedent("""
    import ray, sys, time
    from hvd_trainer.ray import RayExecutor
    ray.init(address=sys.argv[1], log_to_driver=False)
    def sleep_long():
        import time, hvd_trainer as hvd
        hvd.init()
        print("ranks asleep", flush=True)
        time.sleep(120)
    job = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    job.start()
    job.run(sleep_long)
""")


def test_ctrl_c_on_the_driver_leaves_nothing(ray_cluster, executor):
    executor.shutdown()  # the other driver needs the CPUs
    address = ray_cluster.get_runtime_context().gcs_address
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, address], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        for line in driver.stdout:
            if b"ranks asleep" in line:
                break
        driver.send_signal(signal.SIGINT)
        assert driver.wait(30) != 0
    finally:
        if driver.poll() is None:
            driver.kill()
    deadline = time.monotonic() + 15
    while engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE):
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)
    executor.start()


def _torch_steps(ranks, steps):
    """Train a small model for ``steps`` SGD-with-momentum steps on this rank's slice of a
    fixed global batch (one slice per rank; the whole batch when ``ranks`` is None)."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = torch.randn(4 * RANKS, 6), torch.randn(4 * RANKS, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if ranks is not None:
        import hvd_trainer.torch as hvd
        hvd.init()
        x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_torch_training_equals_one_process_on_the_global_batch(executor):
    pytest.importorskip("torch")
    reference = _torch_steps(None, 3)
    for weights in executor.run(_torch_steps, args=[RANKS, 3]):
        for got, want in zip(weights, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
