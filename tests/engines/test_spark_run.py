"""hvd_trainer.spark.run on a real local-cluster (one executor JVM with 3 slots, a fake GPU
each): results against NumPy, Horovod's per-rank variables, a rank that raises, bad num_proc,
each rank's own GPU, output on the driver while the ranks run (and in no executor log), results
over spark.driver.maxResultSize, too few slots, a start past start_timeout (tasks, then ranks),
Ctrl-C on the driver, Gluon's DistributedTrainer against one process on the global batch, a
task's Python worker killed, an executor killed through a barrier socket and by SIGKILL (last:
each takes the executor with it), no process left behind, and the agent folders of the jobs
ended by force swept by the next job."""
import io
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import cloudpickle
import numpy as np
import pytest

import engines
from hvd_trainer_launch.engines.calls import EngineError

RANKS = 3
# The ranks cannot import this test module: its functions travel by value, as __main__'s do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _collective(scale):
    import os
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    mine = np.arange(4.0) * (hvd.rank() + 1) * scale
    print(f"rank {hvd.rank()} says hello", flush=True)
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
            os.environ.get("HOROVOD_CROSS_SIZE"), hvd.allreduce(mine, op=hvd.Sum),
            hvd.broadcast(mine, root_rank=2))


def _wait_for_no_engine_processes(seconds):
    deadline = time.monotonic() + seconds
    while engines.job_processes():
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)


def test_results_against_numpy_and_output(spark, capsys):
    import hvd_trainer.spark
    results = hvd_trainer.spark.run(_collective, args=(3.0,), num_proc=RANKS)
    rows = [np.arange(4.0) * (rank + 1) * 3.0 for rank in range(RANKS)]
    for rank, (got, size, local_rank, local_size, cross_size, summed, root) in \
            enumerate(results):
        # One executor host: every rank shares it.
        assert (got, size, local_rank, local_size, cross_size) == (rank, RANKS, rank, RANKS, "1")
        np.testing.assert_array_equal(summed, np.sum(rows, axis=0))
        np.testing.assert_array_equal(root, rows[2])
    out = capsys.readouterr().out
    assert all(f"[{rank}]<stdout>:rank {rank} says hello" in out for rank in range(RANKS))
    _wait_for_no_engine_processes(10)


def _raise_on_two():
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    if hvd.rank() == 2:
        raise ZeroDivisionError("rank two's own error")
    hvd.allreduce(np.ones(3))


def test_rank_that_raises_is_named(spark):
    import hvd_trainer.spark
    with pytest.raises(EngineError,
                       match=r"(?s)raised on rank 2 on host .*rank two.s own error") as raised:
        hvd_trainer.spark.run(_raise_on_two, num_proc=RANKS)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    _wait_for_no_engine_processes(10)


def test_refusals(spark):
    import hvd_trainer.spark
    with pytest.raises(ValueError, match="use_gloo=True is not supported: hvd_trainer runs on "
                                         "MPI only"):
        hvd_trainer.spark.run(_raise_on_two, use_gloo=True)


@pytest.mark.parametrize("num_proc", [0, -1, "2", 2.5, True])
def test_num_proc_not_a_positive_int_is_refused(spark, num_proc):
    import hvd_trainer.spark
    with pytest.raises(ValueError, match=rf"num_proc={num_proc!r} must be an int >= 1"):
        hvd_trainer.spark.run(_raise_on_two, num_proc=num_proc)


def _devices_and_local_rank():
    import hvd_trainer as hvd
    from hvd_trainer.spark.task import get_available_devices
    hvd.init()
    return get_available_devices(), hvd.local_rank()


def test_each_rank_gets_its_own_tasks_gpus(spark):
    import hvd_trainer.spark
    results = hvd_trainer.spark.run(_devices_and_local_rank, num_proc=RANKS)
    assert [local_rank for _, local_rank in results] == list(range(RANKS))
    # Each task asked for one of the discovery script's addresses: every rank has its own.
    assert all(len(devices) == 1 for devices, _ in results)
    assert sorted(devices[0] for devices, _ in results) == engines.SPARK_GPUS


def _print_then_wait_to_be_seen(seen, marker):
    import os
    import time
    import hvd_trainer as hvd
    hvd.init()
    if hvd.rank() == 0:
        print(marker, flush=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(seen)


class _Watch(io.TextIOBase):
    """A stream that records what it is given and touches ``seen`` when ``marker`` comes."""

    def __init__(self, seen, marker):
        self.seen, self.marker, self.text = seen, marker, ""

    def writable(self):
        return True

    def write(self, text):
        self.text += text
        if self.marker in self.text and not os.path.exists(self.seen):
            open(self.seen, "w").close()
        return len(text)


def _executor_logs(application):
    """The text of this application's executors' stdout and stderr files."""
    text = ""
    for pid in _executors_of(application):
        folder = os.readlink(f"/proc/{pid}/cwd")
        for name in ("stdout", "stderr"):
            with open(os.path.join(folder, name), errors="replace") as log:
                text += log.read()
    return text


def test_output_reaches_the_driver_as_it_is_printed_and_no_executor_log(spark, tmp_path):
    import hvd_trainer.spark
    marker = f"marker {uuid.uuid4().hex}"
    seen = str(tmp_path / "seen")
    out = _Watch(seen, marker)
    # Rank 0 waits until the driver's stream has its line: the output came while it ran.
    assert hvd_trainer.spark.run(_print_then_wait_to_be_seen, args=(seen, marker),
                                 num_proc=RANKS, stdout=out) == [True] * RANKS
    assert f"[0]<stdout>:{marker}" in out.text
    assert marker not in _executor_logs(spark.sparkContext.applicationId)


def _big_result(megabytes):
    import numpy as np
    return np.zeros(megabytes << 17)  # float64: 8 bytes each


def test_results_over_max_result_size_are_named_with_the_limit(spark):
    import hvd_trainer.spark
    with pytest.raises(EngineError, match=r"results \(\d+\.\d MiB: the ranks' return values\) "
                                          r"exceed spark.driver.maxResultSize \(16.0 MiB\).*"
                                          r"spark.driver.maxResultSize', '4g'"):
        hvd_trainer.spark.run(_big_result, args=(8,), num_proc=RANKS)
    _wait_for_no_engine_processes(10)


def test_too_few_slots_fails_in_seconds(spark):
    import hvd_trainer.spark
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="num_proc=4 needs 4 task slots"):
        hvd_trainer.spark.run(_collective, args=(1.0,), num_proc=RANKS + 1, start_timeout=20)
    assert time.monotonic() - started < 25


def _holder_running(context, seconds):
    """Whether the job group "holder" has a running task within ``seconds``."""
    tracker, deadline = context.statusTracker(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        for job in tracker.getJobIdsForGroup("holder"):
            info = tracker.getJobInfo(job)
            stages = [tracker.getStageInfo(stage) for stage in (info.stageIds if info else ())]
            if any(stage and stage.numActiveTasks for stage in stages):
                return True
        time.sleep(0.2)
    return False


def test_start_timeout_cancels_a_job_whose_tasks_cannot_all_start(spark):
    import hvd_trainer.spark
    context = spark.sparkContext
    # Another job holds one of the 3 slots: the barrier job passes Spark's slot check (the
    # cluster has 3), but Spark starts a barrier stage's tasks all at once, so none starts.
    def hold(_):
        import time
        time.sleep(60)
        yield 0

    def holder():
        context.setJobGroup("holder", "holds a slot", interruptOnCancel=True)
        try:
            context.parallelize([0], 1).mapPartitions(hold).collect()
        except Exception:  # cancelled below
            pass
    from pyspark import InheritableThread
    thread = InheritableThread(target=holder, daemon=True)
    thread.start()
    assert _holder_running(context, 60), "the holding job did not start"
    try:
        started = time.monotonic()
        # Horovod's words first (its test_timeout_with_mpi matches them).
        with pytest.raises(TimeoutError, match=r"^Timed out waiting for Spark tasks to start: "
                                               r"0 of the 3 tasks started within "
                                               r"start_timeout=4 s.*add executors or ask for a "
                                               r"smaller num_proc"):
            hvd_trainer.spark.run(_collective, args=(1.0,), num_proc=RANKS, start_timeout=4)
        assert time.monotonic() - started < 40
    finally:
        context.cancelJobGroup("holder")
        thread.join(30)
    _wait_for_no_engine_processes(10)  # the next tests get every slot: the job was cancelled


def _sleep_long():
    import time
    import hvd_trainer as hvd
    hvd.init()
    time.sleep(120)


def _when_ranks_run(action):
    """Call ``action`` once the job's ranks are running (seen by their environment)."""
    def watch():
        deadline = time.monotonic() + 60
        while len(engines.job_processes()) < 2 * RANKS:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        time.sleep(1)
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# The agent folders of the jobs that the tests below end by force (Ctrl-C on the driver, an
# executor lost through a barrier socket or to SIGKILL): killed, the Python workers that made
# them leave them, and the next job's agent on the host sweeps them (owned_folders).
_FORCED_AGENT_FOLDERS = set()


def _end_by_force(action, raises, match=None, seconds=60):
    """Run a job of sleeping ranks, ``action()`` once they run (its agent folders noted first),
    and check that the job ends within ``seconds`` with ``raises`` (matching ``match``) and
    leaves no process."""
    import hvd_trainer.spark

    def noted():
        _FORCED_AGENT_FOLDERS.update(engines.agent_folders())
        action()
    _when_ranks_run(noted)
    started = time.monotonic()
    with pytest.raises(raises, match=match):
        hvd_trainer.spark.run(_sleep_long, num_proc=RANKS)
    assert time.monotonic() - started < seconds
    _wait_for_no_engine_processes(20)


def test_ctrl_c_on_the_driver_cancels_the_job(spark):
    _end_by_force(lambda: os.kill(os.getpid(), signal.SIGINT), KeyboardInterrupt)


def _gluon_steps(distributed, steps):
    """Train a small Gluon net for ``steps`` SGD-with-momentum steps on this rank's slice of a
    fixed global batch (the whole batch in one process when not ``distributed``)."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon
    rng = np.random.RandomState(0)
    x, y = rng.randn(4 * RANKS, 6).astype("f"), rng.randn(4 * RANKS, 2).astype("f")
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, activation="tanh"), gluon.nn.Dense(2))
    mx.random.seed(0)
    net.initialize(mx.init.Xavier())
    params = {"learning_rate": 0.1, "momentum": 0.9}
    if distributed:
        import hvd_trainer
        trainer = hvd_trainer.DistributedTrainer(net.collect_params(), "sgd", params)
        x, y = x[hvd_trainer.rank()::hvd_trainer.size()], y[hvd_trainer.rank()::hvd_trainer.size()]
    else:
        trainer = gluon.Trainer(net.collect_params(), "sgd", params)
    loss = gluon.loss.L2Loss()
    for _ in range(steps):
        with autograd.record():
            out = loss(net(mx.nd.array(x)), mx.nd.array(y))
        out.backward()
        trainer.step(len(x))
    return [p.data().asnumpy() for p in net.collect_params().values()]


def test_gluon_training_equals_one_process_on_the_global_batch(spark):
    pytest.importorskip("mxnet")
    import hvd_trainer.spark
    reference = _gluon_steps(False, 3)
    for weights in hvd_trainer.spark.run(_gluon_steps, args=(True, 3), num_proc=RANKS):
        for got, want in zip(weights, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _executors_of(application):
    """PIDs of this Spark application's executor JVMs."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                words = cmdline.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in words \
                and application.encode() in words:
            found.append(int(entry))
    return found


def _slow_python(folder):
    """A Python for the ranks that takes 60 s to start."""
    path = os.path.join(folder, "slow-python")
    with open(path, "w") as script:
        script.write(f"#!/bin/sh\nsleep 60\nexec {sys.executable} \"$@\"\n")
    os.chmod(path, 0o700)
    return path


def test_start_timeout_bounds_a_rank_whose_start_is_slow(spark, tmp_path):
    import hvd_trainer.spark
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^Timed out waiting for the ranks to start: ranks "
                                           r"0, 1, 2 on \S+ had not begun running the function "
                                           r"within start_timeout=10 s"):
        hvd_trainer.spark.run(_sleep_long, num_proc=RANKS, start_timeout=10,
                              executable=_slow_python(str(tmp_path)))
    assert time.monotonic() - started < 40  # not the 60 s that the ranks' Python takes
    _wait_for_no_engine_processes(20)


def _parent(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _kill_agents():
    """SIGKILL the running job's agents (the Spark Python workers whose tasks run its proxies:
    the parents of the job processes that are not a job process's child)."""
    ours = set(engines.job_processes())
    for parent in {_parent(pid) for pid in ours} - ours:
        os.kill(parent, signal.SIGKILL)


def test_killed_python_worker_ends_the_job(spark):
    _end_by_force(_kill_agents, EngineError, r"the Spark job failed .*the Python worker of task "
                                             r"\d on \S+ died: Spark says 'Python worker "
                                             r"exited unexpectedly \(crashed\)'; it was killed")


def _executor_endpoints(context):
    """The host:port of each executor (and the driver) that the driver knows."""
    infos = context._jsc.sc().statusTracker().getExecutorInfos()
    return {f"{info.host()}:{info.port()}" for info in infos}


def _replaced(context, before, seconds=60):
    """Wait until the driver has dropped the executors it knew (``before``) but itself, and
    a new one has registered: the next job gets its slots."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = _executor_endpoints(context)
        if len(before & now) == 1 and now - before:  # only the driver is still known
            return
        time.sleep(0.2)
    raise AssertionError(f"no new executor registered: before {before}, now {now}")


def _unix_listeners(pid):
    """The paths of the Unix sockets on which process ``pid`` listens."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:["):-1]
              for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    with open("/proc/net/unix") as table:
        rows = [line.split() for line in table.read().splitlines()[1:]]
    return [row[7] for row in rows if len(row) >= 8 and row[6] in inodes
            and row[3] == "00010000"]  # __SO_ACCEPTCON: listening


_CONNECT = ("import socket, sys\n"
            "for path in sys.argv[1:]:\n"
            "    with socket.socket(socket.AF_UNIX) as s:\n"
            "        try:\n"
            "            s.connect(path)\n"
            "            print('connected')\n"
            "        except OSError as error:\n"
            "            print(type(error).__name__)\n")


def test_a_connection_to_a_barrier_socket_is_named_and_shut_to_other_users(spark):
    """Spark's executor dies (exit 50) when a connection to a barrier task's socket closes
    before it authenticates; over Unix sockets (the session's spark.python.unix.domain.socket
    .enabled) another user cannot connect, and the job's user who does is named as the cause."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to connect as another user (nobody)")
    executors = _executors_of(spark.sparkContext.applicationId)
    assert executors, "no executor JVM found"
    executor = executors[0]
    known = _executor_endpoints(spark.sparkContext)
    said = {}

    def connect():
        paths = _unix_listeners(executor)
        assert paths, "Spark did not give the barrier tasks Unix sockets"
        said["nobody"] = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-c", _CONNECT, *paths], capture_output=True, text=True).stdout.split()
        subprocess.run([sys.executable, "-c", _CONNECT, *paths])  # this user's: the kill
    _end_by_force(connect, EngineError, r"the executor of task 0 on \S+ was lost .*code 50.*"
                                        r"barrier socket.*unix.domain.socket.enabled")
    assert said["nobody"] and set(said["nobody"]) == {"PermissionError"}
    _replaced(spark.sparkContext, known)


def test_killed_executor_ends_the_job(spark):
    context = spark.sparkContext
    executors = _executors_of(context.applicationId)
    assert executors, "no executor JVM found"
    known = _executor_endpoints(context)
    _end_by_force(lambda: [os.kill(pid, signal.SIGKILL) for pid in executors], EngineError,
                  r"the Spark job failed .*the executor of task 0 on \S+ was lost .*Command "
                  r"exited with code 137.*killed \(SIGKILL", seconds=90)
    _replaced(context, known)  # the session's later tests (the estimators') need its slots


def _rank():
    return int(os.environ["HOROVOD_RANK"])


def test_the_next_job_sweeps_the_folders_of_agents_ended_by_force(spark):
    # Issue 46: each such job left its agent folder (the pickled function and arguments).
    if not _FORCED_AGENT_FOLDERS:
        pytest.skip("runs after the tests above that end jobs by force (it checks their folders)")
    import hvd_trainer.spark
    assert hvd_trainer.spark.run(_rank, num_proc=RANKS) == list(range(RANKS))
    assert sorted(f for f in _FORCED_AGENT_FOLDERS if os.path.exists(f)) == []
