"""hvd_trainer.spark.run_elastic's Spark side on a real local-cluster (one executor JVM, 3
slots): the slots' one-task jobs link up with the driver, each takes a command per life; a
task whose Python worker dies is seen lost at once, its slot is asked for again and its new
task links up; a slot beyond the cluster's waits until one is free; stopping the slots ends
every task and leaves no process behind."""
import json
import os
import sys
import threading
import time
from typing import NamedTuple

import cloudpickle
import engines
from hvd_trainer_launch.engines import spark_agents
from hvd_trainer_launch.engines.agent_link import Message

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SLOTS = 3


class _Dispatch(NamedTuple):
    life: int
    host: str
    line: str


class _Job:
    """What an elastic job hears from SparkAgents, recorded: the hosts now, each life's
    outcomes and losses."""

    def __init__(self):
        self.changed = threading.Condition()
        self.hosts, self.outcomes, self.losses = {}, {}, []

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

    def lost(self, life, host, cause):
        self._note(lambda: (self.losses.append((life, host, cause)), self.hosts.pop(host, None)))

    def wait_for(self, what, seconds=120):
        with self.changed:
            assert self.changed.wait_for(what, seconds), (self.hosts, self.outcomes, self.losses)


class _Driver:
    """SparkAgents on the test session's Spark, telling a _Job."""

    def __init__(self, spark, slots):
        self.job = _Job()
        self.agents = spark_agents.SparkAgents(spark.sparkContext, os.urandom(32),
                                               b"unused: the commands here are not ranks",
                                               slots, self.job)

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
        # One executor: one host of the job, named by its host, its agent slot 0's task.
        host = agents[0].host
        assert job.hosts == {host: SLOTS}
        assert driver.agents.executors() == [spark_agents.Executor(host, host, SLOTS, agents[0])]
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
        # life's agent is lost, and the executor stays with its two other tasks.
        driver.agents.serve(_Dispatch(2, host, "sh -c 'kill -9 $PPID; sleep 30'"))
        driver.wait_for(lambda: job.losses and job.hosts == {host: SLOTS - 1})
        assert [(life, name) for life, name, _ in job.losses] == [(2, host)]
        assert "link to the driver closed" in job.losses[0][2]
        assert driver.agents.executors()[0].agent == agents[1]
        # Its job fails (the session does not retry tasks) and the slot is asked for again.
        driver.wait_for(lambda: job.hosts == {host: SLOTS})
        assert [hello.slot for hello in driver.linked()] == [0, 1, 2]
        assert "Python worker exited unexpectedly" in driver.agents.slots.failures()[0].text
        assert agents[0].token not in [hello.token for hello in driver.linked()]
        # A life handed to an executor that is gone is lost at once.
        driver.agents.serve(_Dispatch(3, "elsewhere", "true"))
        assert job.losses[-1][:2] == (3, "elsewhere")
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

