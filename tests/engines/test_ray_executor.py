"""hvd_trainer.ray.RayExecutor on a real local Ray instance (3 CPUs): results against NumPy,
Horovod's per-rank variables and path, a rank that raises, bad arguments refused before
anything starts, too few CPUs, a killed agent (named with Ray's words, its folder swept by the
next job), two calls at once, Ctrl-C on the driver, a Ray Train loop that imports
horovod.torch and Lightning 2's HorovodStrategy (in one job) against one process, and no
process left behind."""
import os
import re
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
import torch_loops
from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines.calls import EngineError

RANKS = 3
# The ranks cannot import this test module: its functions travel by value, as __main__'s do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _collective(scale):
    """On each rank: its place and a Sum allreduce and allgather of rank-made arrays."""
    import os
    import sys
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    mine = np.arange(5.0) * (hvd.rank() + 1) * scale
    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
            {name: os.environ.get(name) for name in names},
            hvd.allreduce(mine, op=hvd.Sum), hvd.allgather(mine[None, :] + hvd.rank()),
            sys.path)


@pytest.fixture(scope="module")
def executor(ray_cluster):
    from hvd_trainer.ray import RayExecutor
    job = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=RANKS)
    job.start()
    try:
        yield job
    finally:
        job.shutdown()


def test_results_against_numpy(executor, tmp_path, monkeypatch):
    # A driver run as `python -c` or in a notebook: '' (its working folder) on its path.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    results = executor.run(_collective, args=[2.0])
    # Python normalises PYTHONPATH's entries at a rank's start ('a/../b' becomes 'b').
    drivers = [os.path.abspath(entry) for entry in sys.path if entry and os.path.isdir(entry)]
    rows = [np.arange(5.0) * (rank + 1) * 2.0 for rank in range(RANKS)]
    for rank, (got_rank, size, local_rank, local_size, variables, summed, gathered, path) in \
            enumerate(results):
        assert str(tmp_path) not in path  # issue 46: the driver's folder stood in for ''
        assert set(drivers) <= set(path)  # the rest of the driver's path, as Ray gives it
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


def test_the_settings_nics_reach_the_ranks(executor, monkeypatch):
    # create_settings(nics=...) is hvdrun's --network-interfaces (it was accepted and dropped).
    monkeypatch.setattr(executor.settings, "nics", ["lo"])
    assert executor.run(lambda: os.environ.get("NCCL_SOCKET_IFNAME")) == ["lo"] * RANKS


@pytest.mark.parametrize("arguments, named", [
    (dict(num_workers=0), "num_workers=0"), (dict(num_workers=-1), "num_workers=-1"),
    (dict(num_workers="2"), "num_workers='2'"), (dict(num_workers=2.5), "num_workers=2.5"),
    (dict(num_hosts=0), "num_hosts=0"),
    (dict(num_hosts=2, num_workers_per_host=0), "num_workers_per_host=0"),
])
def test_bad_counts_are_refused_when_the_executor_is_made(arguments, named):
    from hvd_trainer.ray import RayExecutor
    with pytest.raises(ValueError, match=rf"^RayExecutor: {re.escape(named)} must be an int "
                                         r">= 1$"):
        RayExecutor(RayExecutor.create_settings(), **arguments)


def test_bad_calls_are_refused_before_anything_starts(executor, ray_cluster):
    from hvd_trainer.ray import RayExecutor
    from ray.util import placement_group_table
    groups = len(placement_group_table())
    with pytest.raises(TypeError, match=r"RayExecutor.run: fn=5 is not callable"):
        executor.run(5)
    with pytest.raises(EngineError, match=r"started already .* call shutdown\(\) first"):
        executor.start()  # issue 46: a second placement group, the first one left
    fresh = RayExecutor(RayExecutor.create_settings(), num_workers=1)
    with pytest.raises(ValueError, match=r"RayExecutor.start: extra_env_vars: 'A-B' is not a "
                                         r"variable name"):
        fresh.start(extra_env_vars={"A-B": "1"})
    assert len(placement_group_table()) == groups
    assert engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE) == []


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
    [folder] = engines.agent_folders()  # one host: one agent
    ray_cluster.kill(executor._agents[0])
    thread.join(60)
    assert not thread.is_alive()
    # The host, and what Ray said of the actor's death.
    assert re.search(r"the agent on \S+ was lost .*\n\S+: ActorDiedError: .*ray\.kill",
                     str(outcome.get("error"))), outcome
    deadline = time.monotonic() + 10
    while engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE):
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)
    assert os.path.isdir(folder)  # SIGKILL skipped the agent's cleanup ...
    executor.shutdown()  # a lost agent: start afresh
    executor.start()
    assert [r[0] for r in executor.run(_collective, args=[1.0])] == list(range(RANKS))
    assert not os.path.exists(folder)  # ... and the next job's agent swept it


def _sleep_then_rank(seconds):
    import time
    import hvd_trainer as hvd
    hvd.init()
    time.sleep(seconds)
    return hvd.rank()


def test_a_second_call_waits_for_the_running_one_and_then_runs(executor):
    # Issue 46: the second call started at once, queued on the actors behind the first, and
    # failed after timeout_s with the MPI launcher's "Connection refused".
    first = {}
    thread = threading.Thread(target=lambda: first.update(
        ranks=executor.run(_sleep_then_rank, args=[4])))
    saved, executor.settings.timeout_s = executor.settings.timeout_s, 3  # under the first's 4 s
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while len(engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE)) < 2 * RANKS:
            assert time.monotonic() < deadline, "the first call's ranks did not start"
            time.sleep(0.1)
        with pytest.warns(RuntimeWarning, match=r"_sleep_then_rank waits for _sleep_then_rank "
                                                r"\(running since \d\d:\d\d:\d\d\) to end"):
            assert executor.run(_sleep_then_rank, args=[0]) == list(range(RANKS))
        thread.join(60)
        # A start timeout says what it timed: no Python starts its rank in 10 ms.
        executor.settings.timeout_s = 0.01
        with pytest.raises(TimeoutError, match=r"_sleep_then_rank: the ranks did not all start "
                                               r"within the settings' timeout_s=0.01 s, the time "
                                               r"from launching the job to every rank's start"):
            executor.run(_sleep_then_rank, args=[0])
    finally:
        executor.settings.timeout_s = saved
    assert first["ranks"] == list(range(RANKS))


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


def _torch_then_lightning(steps):
    """One job for both (the ranks import torch once): each rank's weights from each."""
    import importlib.util
    lightning = importlib.util.find_spec("pytorch_lightning") is not None
    return (torch_loops.train_func({"steps": steps}),
            torch_loops.lightning_steps(steps) if lightning else None)


@pytest.fixture(scope="module")
def trained(executor):
    """Each rank's weights from _torch_then_lightning (3 steps), from a driver that never
    imported horovod; and the one-process reference (the whole batch)."""
    pytest.importorskip("torch")
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in sys.modules if n.split(".")[0] == "horovod"]:
            patch.delitem(sys.modules, name)
        ranks = executor.run(_torch_then_lightning, args=[3])
    return ranks, torch_loops.one_process(3)


def test_torch_training_equals_one_process_on_the_global_batch(trained):
    # Issue 46: a loop that imports horovod.torch failed on every rank (No module named
    # 'horovod') unless the driver itself had imported horovod from the shim.
    ranks, reference = trained
    for weights, _ in ranks:
        for got, want in zip(weights, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lightning_strategy_equals_one_process_on_the_global_batch(trained):
    # Issue 49: Lightning 2's HorovodStrategy on RayExecutor's ranks, as under hvdrun and
    # hvd_trainer.spark.run.
    pytest.importorskip("pytorch_lightning")
    ranks, reference = trained
    for _, weights in ranks:
        for got, want in zip(weights, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
