"""hvd_trainer.spark.run on a real local-cluster (one executor JVM with 3 slots): results
against NumPy, Horovod's per-rank variables, a rank that raises, too few slots, Ctrl-C on
the driver, Gluon's DistributedTrainer against one process on the global batch, a killed
executor (last: the cluster replaces it slowly), and no process left behind."""
import os
import signal
import sys
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
    while engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE):
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
    with pytest.raises(ValueError, match="run_elastic is not supported"):
        hvd_trainer.spark.run_elastic(_raise_on_two)


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
        with pytest.raises(TimeoutError, match=r"of the 3 tasks started within "
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
        while len(engines.processes_with(protocol.ENGINE_FOLDER_VARIABLE)) < 2 * RANKS:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        time.sleep(1)
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_on_the_driver_cancels_the_job(spark):
    import hvd_trainer.spark
    _when_ranks_run(lambda: os.kill(os.getpid(), signal.SIGINT))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        hvd_trainer.spark.run(_sleep_long, num_proc=RANKS)
    assert time.monotonic() - started < 60
    _wait_for_no_engine_processes(20)


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


def test_killed_executor_ends_the_job(spark):
    import hvd_trainer.spark
    context = spark.sparkContext
    executors = _executors_of(context.applicationId)
    assert executors, "no executor JVM found"
    _when_ranks_run(lambda: [os.kill(pid, signal.SIGKILL) for pid in executors])
    started = time.monotonic()
    with pytest.raises(EngineError, match="the Spark job failed"):
        hvd_trainer.spark.run(_sleep_long, num_proc=RANKS)
    assert time.monotonic() - started < 90
    _wait_for_no_engine_processes(20)

