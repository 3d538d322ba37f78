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

import cloudpickle
import engines
from hvd_trainer_launch.engines import spark_agents
from hvd_trainer_launch.engines.agent_link import Message

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SLOTS = 3


class _Driver:
    """SparkAgents on the test session's Spark, its changes counted."""

    def __init__(self, spark, slots):
        self.changed = threading.Condition()
        self.agents = spark_agents.SparkAgents(spark.sparkContext, os.urandom(32),
                                               b"unused: the commands here are not ranks",
                                               slots, self._changed)

    def _changed(self):
        with self.changed:
            self.changed.notify_all()

    def linked(self):
        return self.agents.links.agents()

    def wait_for(self, what, seconds=120):
        with self.changed:
            assert self.changed.wait_for(what, seconds), \
                (self.linked(), self.agents.slots.failures())

    def close(self):
        self.agents.close()


def _wait_for_no_engine_processes(seconds=30):
    deadline = time.monotonic() + seconds
    while engines.job_processes():
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)


def test_slots_link_up_take_commands_and_a_lost_task_is_replaced(spark):
    driver = _Driver(spark, SLOTS)
    try:
        driver.wait_for(lambda: len(driver.linked()) == SLOTS)
        agents = driver.linked()
        assert [hello.slot for hello in agents] == list(range(SLOTS))
        host = agents[0].host
        assert driver.agents.hosts() == [spark_agents.HostAgent(host, SLOTS, agents[0])]
        # Each task got one of the session's fake GPUs.
        assert sorted(hello.resources["gpu"][0] for hello in agents) == engines.SPARK_GPUS
        # One host: its agent (slot 0's task) runs the life's command, with every task's
        # resources in slot order for its ranks and the env given.
        handed = driver.agents.hand(1, [(host, SLOTS)], [
            "sh -c 'echo \"$HVD_SPARK_TASK_RESOURCES $GIVEN\" >&2; exit 3'"], {"GIVEN": "yes"})
        assert handed == [spark_agents.Handed(host, agents[0].token)]
        outcome = driver.agents.outcomes(1, handed, 60)[host]
        assert outcome.code == 3 and outcome.host == host
        assert outcome.messages.strip() == \
            json.dumps([hello.resources for hello in agents]) + " yes"
        # The agent's command kills its task's Python worker, as a lost executor would.
        handed = driver.agents.hand(2, [(host, SLOTS)], ["sh -c 'kill -9 $PPID; sleep 30'"], {})
        assert driver.agents.outcomes(2, handed, 60) == {host: None}
        lost = agents[0]
        assert lost in driver.agents.links.lost()
        assert driver.agents.hosts() == [spark_agents.HostAgent(host, 2, agents[1])]
        # Its job fails (the session does not retry tasks) and the slot is asked for again.
        driver.wait_for(lambda: [h.slot for h in driver.linked()] == [0, 1, 2])
        assert "Python worker exited unexpectedly" in driver.agents.slots.failures()[0].text
        assert lost.token not in [hello.token for hello in driver.linked()]
    finally:
        driver.close()
    _wait_for_no_engine_processes()


def test_a_slot_beyond_the_cluster_waits_for_a_free_one(spark):
    driver = _Driver(spark, SLOTS + 1)
    try:
        driver.wait_for(lambda: len(driver.linked()) == SLOTS)
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
                        == everyone - {first.slot})
        time.sleep(2)
        assert {hello.slot for hello in driver.linked()} == everyone - {first.slot}
    finally:
        driver.close()
    _wait_for_no_engine_processes()

