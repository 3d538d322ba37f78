"""hvd_trainer.spark across the test bed: a Spark standalone master on h1 and a one-core worker
on each host, started with ``spark-class`` inside their hosts and ended by PID (every process
whose environment carries the fixture's marker). The driver runs on h1 and imports hvd_trainer
alone; the ranks on each host are started by the Spark task there, with no ssh. Checked: a
rank on h3 that raises, h3's executor killed and Ctrl-C on the driver (no process left on any
host); then, in one job, a HorovodRunner main that imports horovod.torch against one process,
one rank per executor host and data across the link against NumPy, and the forced jobs' agent
folders swept from their hosts; and then Horovod's
examples/spark/pytorch/pytorch_spark_mnist.py, unmodified, in the same driver with the
horovod shim importable: the torch estimator's fit on the hosts' executors, its store a folder
every host sees. (The estimators' weights against one process are checked on a local cluster,
tests/engines, where the transport is the same MPI's; a second fit here cost 41 s.)"""
import importlib.util
import json
import os
import re
import textwrap
from typing import Dict, List, NamedTuple, Optional

import pytest

import horovod_examples
import multihost
import spark_bed
import torch_loops

PAYLOAD = 8 << 20  # bytes in the allreduce: at least that much must cross h2's link

_SPARK_DRIVER = textwrap.dedent("""
    import glob, json, os, signal, sys, threading, time
    import hvd_trainer.spark
    import spark_bed

    def place(size):
        import os, socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        total = hvd.allreduce(np.full(size // 8, float(hvd.rank() + 1)), op=hvd.Sum)
        return {"host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
                "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                "sum": [float(total.min()), float(total.max())]}

    def raise_on_h3():
        import socket
        import numpy as np
        import hvd_trainer as hvd
        hvd.init()
        if socket.gethostname() == "h3":
            raise RuntimeError("the rank on h3 fails")
        hvd.allreduce(np.ones(4))

    def sleep_long(folder, kill_executor_on_h3):
        # Each rank says it sleeps, naming its host and its agent's folder there; with
        # kill_executor_on_h3, h3's rank then SIGKILLs its host's executor JVM (only h3's own
        # processes are in sight there).
        import glob, json, os, signal, socket, time
        import hvd_trainer as hvd
        hvd.init()
        with open("/proc/self/environ", "rb") as environ:  # as started: the wrapper took
            agent = [item.split(b"=", 1)[1].decode() for item in environ.read().split(b"\\0")
                     if item.startswith(b"HVD_ENGINE_FOLDER=")]  # it from os.environ
        with open(os.path.join(folder, f"note.{hvd.rank()}"), "w") as note:
            note.write(json.dumps([socket.gethostname(), agent[0]]))
        os.replace(note.name, os.path.join(folder, f"asleep.{hvd.rank()}"))  # whole, at once
        if kill_executor_on_h3 and socket.gethostname() == "h3":
            while len(glob.glob(os.path.join(folder, "asleep.*"))) < hvd.size():
                time.sleep(0.2)
            for entry in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                        if b"CoarseGrainedExecutorBackend" in cmdline.read():
                            os.kill(int(entry), signal.SIGKILL)
                except OSError:  # a process that ended meanwhile
                    pass
        time.sleep(120)

    def forget_sleepers(folder):
        # The sleepers' notes: each rank's host and agent folder.
        notes = []
        for name in glob.glob(os.path.join(folder, "asleep.*")):
            with open(name) as note:
                notes.append(json.load(note))
            os.remove(name)
        return notes

    def still_there(folders):  # the agent folders of ``folders`` ([host, path]) on this host
        import os, socket
        return [path for host, path in folders
                if host == socket.gethostname() and os.path.exists(path)]

    session = spark_bed.session(sys.argv[1])
    import torch_loops
    try:
        hvd_trainer.spark.run(raise_on_h3, num_proc=3)
    except Exception as error:
        print("RAISED", json.dumps(str(error)), flush=True)
    # A killed executor: h3's, while the ranks sleep (their notes in a folder of their own).
    notes = os.path.join(sys.argv[3], "spark-sleepers")
    os.makedirs(notes, exist_ok=True)
    started = time.monotonic()
    try:
        hvd_trainer.spark.run(sleep_long, args=[notes, True], num_proc=3)
    except Exception as error:
        print("KILLED", json.dumps([str(error), time.monotonic() - started]), flush=True)
    # Ctrl-C on the driver while the ranks sleep, once h3's worker has a new executor.
    spark_bed.wait_for_executors(session)
    forced = forget_sleepers(notes)
    def interrupt():
        while len(glob.glob(os.path.join(notes, "asleep.*"))) < 3:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    try:
        hvd_trainer.spark.run(sleep_long, args=[notes, False], num_proc=3)
    except KeyboardInterrupt:
        print("INTERRUPTED", json.dumps(time.monotonic() - started), flush=True)
    # One job for three checks (each Spark job costs seconds): a Databricks HorovodRunner main
    # that imports horovod.torch (torch_loops.main) gives rank 0's value; every rank's place;
    # and the forced jobs' agent folders, which this job's agents sweep from their hosts.
    forced += forget_sleepers(notes)
    def bed_main(train, steps, size, forced):
        import hvd_trainer as hvd
        weights = train(steps)
        ranks = hvd.allgather_object({**place(size), "left": still_there(forced)})
        return {"weights": [w.tolist() for w in weights], "ranks": ranks}
    from hvd_trainer.spark import HorovodRunner
    value = HorovodRunner(np=3).run(bed_main, train=torch_loops.main, steps=3,
                                    size=int(sys.argv[2]), forced=forced)
    print("RUNNER", json.dumps(value["weights"]), flush=True)
    print("SPARK", json.dumps(value["ranks"]), flush=True)
    print("SWEPT", json.dumps({"forced": forced, "left": [r["left"] for r in value["ranks"]]}),
          flush=True)
    if sys.argv[4]:  # Horovod's example, unmodified, with hvd_trainer's horovod shim
        spark_bed.run_example(sys.argv[3], sys.argv[4], sys.argv[5])  # it stops the session
    session.stop()
""")


class SparkRun(NamedTuple):
    """What the driver's run on h1 gave."""

    said: Dict[str, object]  # its SPARK and RUNNER results, RAISED, KILLED, SWEPT...
    moved: int  # the bytes h2's link carried meanwhile
    left: Dict[str, List[str]]  # the job processes left on each host after it
    out: str  # all it printed (Horovod's example's output last)
    no_example: Optional[str]  # why Horovod's example did not run, or None


@pytest.fixture(scope="module")
def spark_driver(bed, spark_master) -> SparkRun:
    """One driver run on h1 (Horovod's example last, when the Horovod mirror has it)."""
    no_example = horovod_examples.missing()
    example = "" if no_example else horovod_examples.write_example(
        horovod_examples.PYTORCH_MNIST, bed.shared)
    if example:
        horovod_examples.write_mnist(bed.shared)
    arguments = horovod_examples.arguments(bed.shared, os.path.join(bed.shared, "mnist-store"))
    before = bed.link_bytes("h2")
    done = bed.run("h1", spark_bed.driver_command(_SPARK_DRIVER, str(PAYLOAD), bed.shared,
                                                  example, json.dumps(arguments)),
                   cwd=bed.shared, env=spark_bed.driver_environment(), capture_output=True,
                   text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    said = multihost.driver_said(done.stdout, "SPARK", "RUNNER", "RAISED",
                                 "KILLED", "INTERRUPTED", "SWEPT")
    return SparkRun(said, bed.link_bytes("h2") - before, multihost.wait_until_no_job_is_left(bed),
                    done.stdout, no_example)


def test_spark_ranks_one_per_executor_host(spark_driver):
    results, moved = spark_driver.said["SPARK"], spark_driver.moved
    assert sorted(r["host"] for r in results) == ["h1", "h2", "h3"]
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"]) == (3, 0, 1, 3)
        assert r["cross_rank"] == r["rank"]
        assert r["sum"] == [6.0, 6.0]
    assert moved >= PAYLOAD


def test_spark_horovodrunner_main_importing_horovod_torch_equals_one_process(spark_driver):
    # Issue 46: as on Ray, from a driver that imports hvd_trainer alone; rank 0's value.
    assert importlib.util.find_spec("horovod") is None
    multihost.assert_weights_close(spark_driver.said["RUNNER"], torch_loops.one_process(3))


def test_spark_rank_on_h3_raises_named(spark_driver):
    text = spark_driver.said["RAISED"]
    assert "on host h3" in text and "the rank on h3 fails" in text


def test_spark_killed_executor_on_h3_ends_the_job_and_leaves_nothing(spark_driver):
    message, seconds = spark_driver.said["KILLED"]
    assert "the Spark job failed" in message
    # The host, from the task's registration, and what Spark said (its exit code's meaning).
    assert re.search(r"the executor of task \d on h3 was lost .*Spark says", message), message
    assert seconds < 100  # the ranks sleep 120 s: the job ended because its executor died
    assert spark_driver.left == {}  # no rank, wrapper or proxy on any host (their own ps)


def test_spark_ctrl_c_on_the_driver_ends_the_job(spark_driver):
    assert spark_driver.said["INTERRUPTED"] < 100


def test_spark_the_next_job_sweeps_the_agent_folders_of_jobs_ended_by_force(spark_driver):
    # Issue 46: the agent on h3 died with its executor (SIGKILL skips its cleanup), leaving
    # its folder (the pickled function and arguments) in h3's /tmp; the next job on the host
    # removes it, and those that Ctrl-C left on any host.
    swept = spark_driver.said["SWEPT"]
    assert "h3" in [host for host, _ in swept["forced"]]
    assert swept["left"] == [[], [], []]


def test_horovods_pytorch_spark_mnist_runs_unmodified_across_hosts(spark_driver):
    # Issue 49: Horovod's estimator example, its MNIST file written here (nothing downloads),
    # on the three hosts' executors.
    if spark_driver.no_example:
        pytest.skip(spark_driver.no_example)
    accuracy = horovod_examples.accuracy(spark_driver.out)
    assert accuracy is not None and 0.0 <= accuracy <= 1.0, spark_driver.out[-3000:]
    assert "Epoch 1/1 - loss: " in spark_driver.out
