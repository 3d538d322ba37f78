"""hvd_trainer.spark.run_elastic's Spark side on a real local-cluster (one executor JVM, 3
slots): the slots' one-task jobs link up with the driver, each takes a command per life; a
task whose Python worker dies is seen lost at once, its slot is asked for again and its new
task links up; a slot beyond the cluster's waits until one is free; stopping the slots ends
every task and leaves no process behind."""
import os
import sys
import threading
import time

import cloudpickle
import engines
from hvd_trainer_launch.engines import agent_link, spark_agents
from hvd_trainer_launch.engines.agent_link import Message

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SLOTS = 3


class _Driver:
    """Links and slot jobs on the test session's Spark, recording outcomes and failures."""

    def __init__(self, spark, slots):
        context = spark.sparkContext
        self.secret = os.urandom(32)
        self.changed = threading.Condition()
        self.outcomes, self.failed = {}, []
        self.links = agent_link.Links(context.getConf().get("spark.driver.host"), self.secret,
                                      self._changed, self._received,
                                      bind=context.getConf().get("spark.driver.bindAddress"))
        payload = b"unused: the commands here are not ranks"
        self.slots = spark_agents.SlotJobs(
            context, slots, lambda slot: spark_agents.agent_task(self.links.address,
                                                                 self.secret, payload, slot),
            self._failed)

    def _changed(self):
        with self.changed:
            self.changed.notify_all()

    def _received(self, token, message):
        with self.changed:
            self.outcomes[token] = agent_link.outcome_of(message)
            self.changed.notify_all()

    def _failed(self, slot):
        self.failed.append(slot)
        self.links.drop(slot)

    def wait_for(self, what, seconds=120):
        with self.changed:
            assert self.changed.wait_for(what, seconds), \
                (self.links.agents(), self.outcomes, self.failed)

    def close(self):
        self.links.close()
        self.slots.stop()


def _wait_for_no_engine_processes(seconds=30):
    deadline = time.monotonic() + seconds
    while engines.job_processes():
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)


def test_slots_link_up_take_commands_and_a_lost_task_is_replaced(spark):
    driver = _Driver(spark, SLOTS)
    try:
        driver.wait_for(lambda: len(driver.links.agents()) == SLOTS)
        agents = driver.links.agents()
        assert [hello.slot for hello in agents] == list(range(SLOTS))
        host = agents[0].host
        assert spark_agents.hosts_of(agents) == [spark_agents.HostAgent(host, SLOTS, agents[0])]
        # Each task got one of the session's fake GPUs.
        assert sorted(hello.resources["gpu"][0] for hello in agents) == engines.SPARK_GPUS
        for hello in agents:
            assert driver.links.send(hello.token, Message("run", {
                "life": 1, "line": f"sh -c 'echo slot {hello.slot} >&2; exit {hello.slot}'",
                "env": {}}))
        driver.wait_for(lambda: len(driver.outcomes) == SLOTS)
        assert {hello.slot: (driver.outcomes[hello.token].code,
                             driver.outcomes[hello.token].messages.strip())
                for hello in agents} == {slot: (slot, f"slot {slot}") for slot in range(SLOTS)}
        # Slot 1's command kills its task's Python worker, as a lost task.
        lost = agents[1]
        assert driver.links.send(lost.token, Message("run", {
            "life": 2, "line": "sh -c 'kill -9 $PPID; sleep 30'", "env": {}}))
        driver.wait_for(lambda: lost in driver.links.lost())
        assert [hello.slot for hello in driver.links.agents()] == [0, 2]
        assert spark_agents.hosts_of(driver.links.agents())[0].slots == 2
        # Its job fails (the session does not retry tasks) and the slot is asked for again.
        driver.wait_for(lambda: [h.slot for h in driver.links.agents()] == [0, 1, 2])
        assert driver.failed == [1]
        assert "Python worker exited unexpectedly" in driver.slots.failures()[1].text
        assert lost.token not in [hello.token for hello in driver.links.agents()]
    finally:
        driver.close()
    _wait_for_no_engine_processes()


def test_a_slot_beyond_the_cluster_waits_for_a_free_one(spark):
    driver = _Driver(spark, SLOTS + 1)
    try:
        driver.wait_for(lambda: len(driver.links.agents()) == SLOTS)
        time.sleep(2)  # the fourth waits in Spark's scheduler: no slot is free
        assert len(driver.links.agents()) == SLOTS
        first = driver.links.agents()[0]
        driver.links.send(first.token, Message("run", {"life": 1, "line": "sh -c 'kill -9 $PPID'",
                                                       "env": {}}))
        # Its slot frees: the waiting task and the first slot's new one share the three.
        driver.wait_for(lambda: first in driver.links.lost()
                        and len(driver.links.agents()) == SLOTS)
        assert SLOTS in [hello.slot for hello in driver.links.agents()] \
            or first.slot in [hello.slot for hello in driver.links.agents()]
    finally:
        driver.close()
    _wait_for_no_engine_processes()

