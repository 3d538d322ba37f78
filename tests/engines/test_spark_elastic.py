"""hvd_trainer.spark.run_elastic on a real local-cluster (one executor JVM, 3 slots).

Its Spark side: the slots' one-task jobs link up with the driver, the executor's agent takes
a command per life; a task whose Python worker dies is seen lost at once, its slot is asked
for again and its new task links up; a slot beyond the cluster's waits until one is free.
The job: a torch training shrinks when a task is lost, goes on from the last commit and
grows back when the slot frees, its final weights those of the one-process replay of its
commits; more restarts than reset_limit, too few slots for elastic_timeout, too few tasks
within start_timeout and every executor lost end it with the reason, and Ctrl-C on the
driver ends it. No process is left behind, nor any folder but those of an agent killed by
SIGKILL, which the next agent on the host removes. Where the multi-host test bed trains
through the same loss and return across its hosts in this session
(test_multihost_spark_elastic.py, an executor SIGKILLed), that run stands for the torch
training here (tests/bed_twins.py)."""
import io
import json
import os
import re
import signal
import sys
import threading
import time
from typing import NamedTuple

import cloudpickle
import pytest
import bed_twins
import elastic_training
import engines
from hvd_trainer_launch.engines import agent as engine_agent, elastic, spark_agents
from hvd_trainer_launch.engines.agent_link import Message
from hvd_trainer_launch.engines.calls import EngineError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SLOTS = 3


class _Dispatch(NamedTuple):
    life: int
    host: str
    line: str


class _Loss(NamedTuple):
    """What the agents told the job of an agent lost."""
    life: int
    host: str
    cause: str
    absent: bool


class _Job:
    """What an elastic job hears from SparkAgents, recorded: the hosts now, each life's
    outcomes and losses."""

    def __init__(self):
        self.changed = threading.Condition()
        self.hosts, self.outcomes, self.losses = {}, {}, []
        self.payload, self.secret = b"unused: the commands here are not ranks", os.urandom(32)
        self.settings = elastic.ElasticSettings()

    def _note(self, change):
        with self.changed:
            change()
            self.changed.notify_all()

    def joined(self, host, slots):
        self._note(lambda: self.hosts.__setitem__(host, slots))

    def left(self, host):
        self._note(lambda: self.hosts.pop(host, None))

    def returned(self, life, host, outcome):
        self._note(lambda: self.outcomes.__setitem__((life, host), outcome))

    def lost(self, life, host, cause, absent=False):
        self._note(lambda: (self.losses.append(_Loss(life, host, cause, absent)),
                            self.hosts.pop(host, None)))

    def wait_for(self, what, seconds=120):
        with self.changed:
            assert self.changed.wait_for(what, seconds), (self.hosts, self.outcomes, self.losses)


class _Driver:
    """SparkAgents on the test session's Spark, telling a _Job."""

    def __init__(self, spark, slots):
        self.job = _Job()
        self.agents = spark_agents.SparkAgents(spark.sparkContext, slots)
        self.agents.attach(self.job)

    def linked(self):
        return self.agents.links.agents()

    def wait_for(self, what, seconds=120):
        self.job.wait_for(what, seconds)

    def close(self):
        self.agents.close()


def _wait_for_no_engine_processes(seconds=30):
    deadline = time.monotonic() + seconds
    while engines.job_processes():
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)


def test_slots_link_up_take_commands_and_a_lost_task_is_replaced(spark):
    driver = _Driver(spark, SLOTS)
    job = driver.job
    try:
        driver.wait_for(lambda: sum(job.hosts.values()) == SLOTS)
        agents = driver.linked()
        assert [hello.slot for hello in agents] == list(range(SLOTS))
        # One executor: one host of the job, named by its host; its agent a task of it.
        host = agents[0].host
        assert job.hosts == {host: SLOTS}
        executor = driver.agents.executors()[0]
        assert executor[:3] == (host, host, SLOTS) and executor.agent in agents
        # Each task got one of the session's fake GPUs.
        assert sorted(hello.resources["gpu"][0] for hello in agents) == engines.SPARK_GPUS
        # The agent runs the life's command with every task's resources in slot order.
        driver.agents.serve(_Dispatch(1, host, "sh -c 'echo $HVD_SPARK_TASK_RESOURCES >&2; "
                                               "exit 3'"))
        driver.wait_for(lambda: (1, host) in job.outcomes)
        outcome = job.outcomes[(1, host)]
        assert outcome.code == 3 and outcome.host == host
        assert outcome.messages.strip() == json.dumps([hello.resources for hello in agents])
        # The agent's command kills its task's Python worker, as a lost executor would: the
        # life's agent is lost, and the executor stays with its two other tasks, the lowest
        # slot's its agent now.
        lost = executor.agent
        driver.agents.serve(_Dispatch(2, host, "sh -c 'kill -9 $PPID; sleep 30'"))
        driver.wait_for(lambda: job.losses and job.hosts == {host: SLOTS - 1})
        assert [(loss.life, loss.host, loss.absent) for loss in job.losses] == [(2, host, False)]
        assert "link to the driver closed" in job.losses[0].cause
        left = [hello for hello in agents if hello != lost]
        assert driver.agents.executors()[0].agent == left[0]
        # Its job fails (the session does not retry tasks) and the slot is asked for again.
        driver.wait_for(lambda: job.hosts == {host: SLOTS})
        assert [hello.slot for hello in driver.linked()] == [0, 1, 2]
        assert "Python worker exited unexpectedly" in \
            driver.agents.slots.failures()[lost.slot].text
        assert lost.token not in [hello.token for hello in driver.linked()]
        assert driver.agents.executors()[0].agent == left[0]  # it stays the agent
        # A life handed to an executor that is gone is lost at once, as absent when it began
        # (hvdrun does not count it against the host again).
        driver.agents.serve(_Dispatch(3, "elsewhere", "true"))
        last = job.losses[-1]
        assert (last.life, last.host, last.absent) == (3, "elsewhere", True)
    finally:
        driver.close()
    _wait_for_no_engine_processes()


def test_a_slot_beyond_the_cluster_waits_for_a_free_one(spark):
    driver = _Driver(spark, SLOTS + 1)
    try:
        driver.wait_for(lambda: sum(driver.job.hosts.values()) == SLOTS)
        time.sleep(2)  # the fourth waits in Spark's scheduler: no slot is free
        linked = [hello.slot for hello in driver.linked()]
        assert len(linked) == SLOTS
        first = driver.linked()[0]
        driver.agents.links.send(first.token, Message("run", {
            "life": 1, "line": "sh -c 'kill -9 $PPID'", "env": {}}))
        # Its Spark slot frees, and the waiting task, asked for before the lost one's slot
        # is asked for again, takes it.
        everyone = set(range(SLOTS + 1))
        driver.wait_for(lambda: {hello.slot for hello in driver.linked()}
                        == everyone - {first.slot} and sum(driver.job.hosts.values()) == SLOTS)
        time.sleep(2)
        assert {hello.slot for hello in driver.linked()} == everyone - {first.slot}
    finally:
        driver.close()
    _wait_for_no_engine_processes()



class _Stream(io.TextIOBase):
    """A stream that keeps what it is given, for a test to watch while the job runs."""

    def __init__(self):
        self.text = ""

    def writable(self):
        return True

    def write(self, text):
        self.text += text
        return len(text)


class _Recording(spark_agents.SparkAgents):
    """SparkAgents that a test can reach: the last one made."""

    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Recording.made.append(self)


def _in_thread(call):
    """Run ``call`` in a thread; the box gets its result or exception."""
    box = {}

    def run():
        try:
            box["result"] = call()
        except BaseException as error:
            box["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait(what, seconds=180, why="timed out"):
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def _hold_a_slot(context):
    """Ask Spark for one more slot (a job group "holder" of one task that sleeps), returning
    once its task waits in Spark's scheduler: it takes the next slot that frees, before the
    slots run_elastic asks for afterwards."""
    def hold(_):
        import time
        time.sleep(600)
        yield 0

    def holder():
        context.setJobGroup("holder", "holds a slot", interruptOnCancel=True)
        try:
            context.parallelize([0], 1).mapPartitions(hold).collect()
        except Exception:  # cancelled by the test
            pass
    from pyspark import InheritableThread
    thread = InheritableThread(target=holder, daemon=True)
    thread.start()
    _wait(lambda: _submitted(context.statusTracker(), "holder"), 60,
          "the holder's task was not submitted")
    return thread


def _submitted(tracker, group):
    """Whether a job of ``group`` has a stage submitted (its task waits for a slot)."""
    active = set(tracker.getActiveStageIds())
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        if info is not None and active & set(info.stageIds):
            return True
    return False


def _connected_to(port):
    """The PIDs of this machine's processes with a TCP connection to ``port`` (elsewhere)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    inodes.add(f"socket:[{fields[9]}]")
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                found.add(int(pid))
        except OSError:  # it ended meanwhile, or is not ours
            pass
    return found


def _lose_a_task_that_is_not_the_agent():
    """SIGKILL the Python worker of a linked task that is not its executor's agent (the
    agent's worker is the parent of its launcher proxy), as a lost task."""
    port = int(_Recording.made[-1].links.address.rpartition(":")[2])
    tasks = _connected_to(port)
    agents = {_parent(pid) for pid in engines.job_processes()} & tasks
    assert len(agents) == 1 and len(tasks) == SLOTS, (agents, tasks)
    os.kill(min(tasks - agents), signal.SIGKILL)


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _left_folders(makers):
    """The elastic job and commit folders in the temporary folder that ``makers`` (PIDs)
    made (other sessions on this machine make theirs there too)."""
    import tempfile
    found = []
    for name in os.listdir(tempfile.gettempdir()):
        for prefix in ("hvd_engine_elastic.", "hvd_engine_commits."):
            fields = name[len(prefix):].split(".")[0].split("-") \
                if name.startswith(prefix) else []
            if len(fields) == 3 and fields[1].isdigit() and int(fields[1]) in makers:
                found.append(name)
    return found


def _our_processes(context):
    """This process and this application's executors' descendants (the tasks' Python
    workers, which make the agents' folders)."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        parent = _parent(int(pid))
        if parent is not None:
            children.setdefault(parent, []).append(int(pid))
    found, todo = {os.getpid()}, list(_executors_of(context.applicationId))
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def test_run_elastic_shrinks_goes_on_from_the_last_commit_and_grows_back(request, spark,
                                                                        tmp_path, monkeypatch):
    bed_twins.skip_if_the_bed_runs(
        request, "tests/multihost/test_multihost_spark_elastic.py::"
                 "test_spark_run_elastic_survives_a_killed_executor_and_grows_back")
    import hvd_trainer.spark
    monkeypatch.setattr(spark_agents, "SparkAgents", _Recording)
    context, signal_path, out = spark.sparkContext, str(tmp_path / "signal"), _Stream()
    thread, box = _in_thread(lambda: hvd_trainer.spark.run_elastic(
        elastic_training.train, args=(signal_path, SLOTS), num_proc=SLOTS, min_num_proc=2,
        start_timeout=120, elastic_timeout=120, stdout=out))
    holder = None
    try:
        _wait(lambda: os.path.exists(signal_path) or not thread.is_alive(),
              why="the first life did not reach its signal")
        assert thread.is_alive(), box
        ours = _our_processes(context)
        open(signal_path + ".taken", "w").close()
        # The task is lost while another job waits for a slot: the freed slot goes to it, so
        # the job shrinks until the test lets it go.
        holder = _hold_a_slot(context)
        _lose_a_task_that_is_not_the_agent()
        _wait(lambda: "LIFE size=2" in out.text or not thread.is_alive(),
              why="the job did not shrink")
        context.cancelJobGroup("holder")
        thread.join(300)
        assert not thread.is_alive(), "the job did not end"
    finally:
        if thread.is_alive():  # end the job: its tasks, then its ranks, go
            _Recording.made[-1].close()
        context.cancelJobGroup("holder")
        if holder is not None:
            holder.join(30)
    assert "error" not in box, box.get("error")
    results = box["result"]
    assert len(results) == SLOTS and results[1:] == [None] * (SLOTS - 1)
    elastic_training.check_result(results[0], out.text, SLOTS)
    _wait_for_no_engine_processes()
    assert _left_folders(ours | _our_processes(context)) == []


def _wait_at_commits(signal_path):
    """An elastic function without a framework: rank 0 writes ``signal_path`` in the first
    life, and the ranks wait for a host change, checking for one (each restart would begin
    here again)."""
    import time
    import hvd_trainer as hvd
    import hvd_trainer.elastic

    hvd.init()

    @hvd_trainer.elastic.run
    def wait(state):
        if hvd.rank() == 0:
            open(signal_path, "a").close()
        for _ in range(1200):
            time.sleep(0.1)
            state.check_host_updates()
        raise RuntimeError("no host change came")

    return wait(hvd_trainer.elastic.ObjectState(step=0))


def _failing_run(spark, tmp_path, take_away, left=False, **given):
    """run_elastic of _wait_at_commits on the session's three slots; once its ranks wait,
    ``take_away()``; the error it ends with, and the processes that took part. No process of
    it may be left behind, nor any folder, but one when ``left``."""
    import hvd_trainer.spark
    signal_path = str(tmp_path / "signal")
    thread, box = _in_thread(lambda: hvd_trainer.spark.run_elastic(
        _wait_at_commits, args=(signal_path,), num_proc=SLOTS, start_timeout=120,
        stderr=_Stream(), **given))
    try:
        _wait(lambda: os.path.exists(signal_path) or not thread.is_alive(),
              why="the first life did not begin")
        ours = _our_processes(spark.sparkContext)
        take_away()
        thread.join(240)
        assert not thread.is_alive(), "the job did not end"
    finally:
        if thread.is_alive():
            _Recording.made[-1].close()
    _wait_for_no_engine_processes()
    ours |= _our_processes(spark.sparkContext)
    assert len(_left_folders(ours)) == (1 if left else 0), _left_folders(ours)
    return box.get("error"), ours


def test_more_restarts_than_reset_limit_end_the_job_with_the_reason(spark, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(spark_agents, "SparkAgents", _Recording)
    error, _ = _failing_run(spark, tmp_path, _lose_a_task_that_is_not_the_agent,
                            min_num_proc=1, reset_limit=0)
    assert isinstance(error, EngineError), error
    assert "over --reset-limit 0" in str(error)


def test_too_few_slots_for_elastic_timeout_end_the_job_with_the_reason(spark, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(spark_agents, "SparkAgents", _Recording)
    context = spark.sparkContext

    def lose_a_slot_for_good():  # another job takes the lost task's slot
        _hold_a_slot(context)
        _lose_a_task_that_is_not_the_agent()
    try:
        error, _ = _failing_run(spark, tmp_path, lose_a_slot_for_good, min_num_proc=SLOTS,
                                elastic_timeout=4)
    finally:
        context.cancelJobGroup("holder")
    assert isinstance(error, EngineError), error
    assert re.search(r"only 2 usable slots .* for --elastic-timeout 4 s, fewer than --min-np 3",
                     str(error)), error


def test_fewer_tasks_than_num_proc_within_start_timeout_is_a_timeout(spark):
    import hvd_trainer.spark
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^Timed out waiting for Spark tasks to start: "
                                           r"[0-3] of the 4 tasks started within "
                                           r"start_timeout=2 s"):
        hvd_trainer.spark.run_elastic(_wait_at_commits, args=("/nonexistent",), num_proc=4,
                                      start_timeout=2)
    assert time.monotonic() - started < 60
    _wait_for_no_engine_processes()
    assert _left_folders(_our_processes(spark.sparkContext)) == []


def test_ctrl_c_on_the_driver_ends_the_job_and_leaves_nothing(spark, tmp_path):
    import hvd_trainer.spark
    signal_path, seen = str(tmp_path / "signal"), {}

    def interrupt():
        _wait(lambda: os.path.exists(signal_path), why="the first life did not begin")
        seen["ours"] = _our_processes(spark.sparkContext)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        hvd_trainer.spark.run_elastic(_wait_at_commits, args=(signal_path,), num_proc=SLOTS,
                                      start_timeout=120, stderr=_Stream())
    assert time.monotonic() - started < 120  # the ranks wait 120 s: the job was ended
    _wait_for_no_engine_processes()
    assert _left_folders(seen["ours"] | _our_processes(spark.sparkContext)) == []


def _executors_of(application):
    """PIDs of this Spark application's executor JVMs."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                words = cmdline.read().split(b"\0")
        except OSError:
            continue
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in words \
                and application.encode() in words:
            found.append(int(entry))
    return found


def test_every_executor_lost_ends_the_job_with_the_reason(spark, tmp_path, monkeypatch):
    # Last: it takes the session's one executor (its worker starts another).
    monkeypatch.setattr(spark_agents, "SparkAgents", _Recording)
    context = spark.sparkContext
    executors = _executors_of(context.applicationId)
    assert executors, "no executor JVM found"
    # SIGKILL skips the agent's own removal of its commits (one folder is left): the next
    # agent on the host removes them.
    error, ours = _failing_run(spark, tmp_path, lambda: [os.kill(pid, signal.SIGKILL)
                                                         for pid in executors],
                               min_num_proc=1, elastic_timeout=5, left=True)
    assert isinstance(error, EngineError), error
    engine_agent.ElasticAgent().close()
    assert _left_folders(ours) == []
    assert "every host has left the job" in str(error) \
        or "every rank failed" in str(error), error
    _wait(lambda: _executors_of(context.applicationId)
          and context.defaultParallelism >= SLOTS, 120, "no new executor")
