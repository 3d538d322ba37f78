"""The Spark side of hvd_trainer.spark.run_elastic: long-running, non-barrier tasks as the
job's agents, which the driver keeps requested as executors come and go.

A barrier job is all or nothing (a lost task fails the stage, and Spark does not retry it), so
an elastic job cannot be one. Instead the driver keeps ``max_num_proc`` *slots* requested, each
a Spark job of one ordinary task (:class:`SlotJobs`): a task that Spark can place runs at
once, one that it cannot waits in the scheduler until an executor with a free slot comes (and
asks dynamic allocation for one), so the job grows by itself; a task lost with its executor
fails its own job only, and the driver asks for the slot again. (One job of many tasks would
not do: a task that fails for good aborts the job, and Spark kills its other tasks with it.)

Each task dials the driver and keeps a signed link to it (agent_link) for its whole life,
saying its host and the resources Spark gave it; the link's drop tells the driver at once
that the task is gone (its executor killed, its Python worker killed); a slot whose job fails
ends that slot's link too (Spark's word for an executor that vanished from the network, when
no connection closed). A host is in the job while it holds a linked task; its slots are its
linked tasks; one of them per host, the lowest slot, is that life's agent: it runs the MPI
launcher's proxy command for the host's ranks, the others hold their Spark slots and stand in
if it is lost.
"""
import json
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import agent as engine_agent, agent_link
from hvd_trainer_launch.engines.agent_link import Hello, Message
from hvd_trainer_launch.engines.calls import HostOutcome

# After a slot's job fails, how long before it is asked for again: the first wait, doubled
# after each failure in a row, at most the last. A task that cannot run at all (its Python
# cannot import hvd_trainer_launch) does not make a tight loop of failing jobs.
RETRY_FIRST_SECONDS = 0.5
RETRY_MOST_SECONDS = 30.0
# A slot's job that ran at least this long before failing starts the count of failures anew.
_RAN_WELL_SECONDS = 30.0


def agent_task(address: str, secret: bytes, payload: bytes, slot: int) -> Callable:
    """The function a slot's one task runs over its (unused) partition: link up with the
    driver at ``address`` and run the proxy commands it sends, one per life, with the pickled
    (function, args, kwargs) ``payload``, until the driver ends the link. Its one row is None:
    the outcomes travel on the link. It refers to hvd_trainer_launch's modules alone."""

    def task(_partition):
        from pyspark import TaskContext
        context = TaskContext.get()
        resources = {name: list(info.addresses) for name, info in context.resources().items()}
        hello = Hello(slot, uuid.uuid4().hex, engine_agent.hostname(), resources)
        side = agent_link.dial(address, secret, hello)
        agent_link.serve(side, lambda message: engine_agent.run_proxy(
            message.fields["line"], payload, secret, env=message.fields["env"]))
        yield None

    return task


def retry_wait(failures: int) -> float:
    """Seconds before a slot is asked for again after ``failures`` failed jobs in a row."""
    if failures < 1:
        return 0.0
    return min(RETRY_MOST_SECONDS, RETRY_FIRST_SECONDS * 2 ** min(failures - 1, 32))


class SlotFailure(NamedTuple):
    """The last failure of a slot's job: Spark's words, and how many in a row."""

    text: str
    in_a_row: int


class SlotJobs:
    """``count`` slots, each a Spark job of one task running ``task_for(slot)``, asked for
    again whenever it ends while the slots are kept (:meth:`stop` ends that); all in one job
    group, each collected in a thread of its own. ``failed(slot)`` is called when a slot's job
    fails (from its thread)."""

    def __init__(self, context, count: int, task_for: Callable[[int], Callable],
                 failed: Callable[[int], None], name: str = "hvd_trainer.spark.run_elastic"):
        from pyspark import InheritableThread
        self._context, self._task_for, self._failed, self._name = context, task_for, failed, name
        self.group = f"{name}.{uuid.uuid4().hex}"
        self._stopping = False
        self._failures: Dict[int, SlotFailure] = {}
        self._threads = [InheritableThread(target=self._keep, args=(slot,), daemon=True)
                         for slot in range(count)]
        for thread in self._threads:
            thread.start()

    def _keep(self, slot: int) -> None:
        """Ask for ``slot`` until the slots are stopped, waiting after failures."""
        self._context.setJobGroup(self.group, self._name, interruptOnCancel=True)
        in_a_row = 0
        while not self._stopping:
            began = time.monotonic()
            try:
                self._context.parallelize([slot], 1).mapPartitions(self._task_for(slot)) \
                    .collect()
                in_a_row = 0
            except Exception as error:  # Spark's, through Py4J: the task or its executor
                if self._stopping:
                    return
                in_a_row = 1 if time.monotonic() - began >= _RAN_WELL_SECONDS else in_a_row + 1
                self._failures[slot] = SlotFailure(str(error), in_a_row)
                self._failed(slot)
            deadline = time.monotonic() + retry_wait(in_a_row)
            while not self._stopping and time.monotonic() < deadline:
                time.sleep(0.1)

    def failures(self) -> Dict[int, SlotFailure]:
        """The last failure of each slot whose job failed, by slot."""
        return dict(self._failures)

    def stop(self, seconds: float = 30.0) -> None:
        """Ask for no slot again, cancel the slots' jobs (Spark kills their tasks' Python
        workers, and the proxies with them) and wait up to ``seconds`` for their threads."""
        self._stopping = True
        self._context.cancelJobGroup(self.group)
        deadline = time.monotonic() + seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class HostAgent(NamedTuple):
    """A host of the job now: its name, its slots (linked tasks) and the task that is its
    agent (the lowest slot's)."""

    host: str
    slots: int
    agent: Hello


def hosts_of(agents: List[Hello]) -> List[HostAgent]:
    """The hosts that ``agents`` (linked tasks) are on, in the order of their lowest slot,
    each with its slot count and its agent (the lowest slot's task)."""
    by_host: Dict[str, List[Hello]] = {}
    for hello in sorted(agents, key=lambda hello: hello.slot):
        by_host.setdefault(hello.host, []).append(hello)
    return [HostAgent(host, len(tasks), tasks[0]) for host, tasks in by_host.items()]


def resources_by_local_rank(agents: List[Hello], host: str, ranks: int) -> List[Dict[str, Any]]:
    """The resources of ``host``'s first ``ranks`` tasks by slot: its ranks' in local rank
    order (hvd_trainer.spark.task.get_available_devices reads its own)."""
    mine = sorted((hello for hello in agents if hello.host == host), key=lambda h: h.slot)
    return [hello.resources for hello in mine[:ranks]]



class Handed(NamedTuple):
    """A life's proxy command handed to a host's agent: the host and the agent's token."""

    host: str
    token: str


class SparkAgents:
    """The driver's view of run_elastic's agents: the slots' jobs and their tasks' links; the
    hosts now (:meth:`hosts`), a life's proxy commands handed to each host's agent
    (:meth:`hand`) and their outcomes (:meth:`outcomes`). ``changed`` is called whenever a
    task links up or is lost (from a reader thread)."""

    def __init__(self, context, secret: bytes, payload: bytes, slots: int,
                 changed: Callable[[], None]):
        conf = context.getConf()
        self._changed, self._lock = changed, threading.Condition()
        self._outcomes: Dict[Tuple[int, str], HostOutcome] = {}  # by (life, token)
        self.links = agent_link.Links(conf.get("spark.driver.host"), secret, self._moved,
                                      self._received, bind=conf.get("spark.driver.bindAddress"))
        try:
            self.slots = SlotJobs(context, slots, lambda slot: agent_task(
                self.links.address, secret, payload, slot), self.links.drop)
        except BaseException:
            self.links.close()
            raise

    def _moved(self) -> None:
        with self._lock:
            self._lock.notify_all()
        self._changed()

    def _received(self, token: str, message: Message) -> None:
        outcome = agent_link.outcome_of(message)  # ValueError: the link is dropped
        with self._lock:
            self._outcomes[(int(message.fields["life"]), token)] = outcome
            self._lock.notify_all()

    def hosts(self) -> List[HostAgent]:
        """The hosts now, in the order of their lowest slot, with their slots and agents."""
        return hosts_of(self.links.agents())

    def hand(self, life: int, layout: Sequence[Tuple[str, int]], lines: Sequence[str],
             env: Dict[str, str]) -> List[Handed]:
        """Send each host of ``layout`` ((host, ranks) in rank order) its proxy command of
        ``lines`` through its agent, with ``env`` and, for its ranks, its tasks' resources in
        local rank order; the agents handed one. A host with no agent now is left out: its
        proxy never starts, and the life fails as when its agent is lost."""
        agents = self.links.agents()
        by_host = {host.host: host.agent for host in hosts_of(agents)}
        handed = []
        for (host, ranks), line in zip(layout, lines):
            agent = by_host.get(host)
            if agent is None:
                continue
            resources = resources_by_local_rank(agents, host, ranks)
            fields = {"life": life, "line": line,
                      "env": {**env, protocol.SPARK_RESOURCES_VARIABLE: json.dumps(resources)}}
            if self.links.send(agent.token, Message("run", fields)):
                handed.append(Handed(host, agent.token))
        return handed

    def outcomes(self, life: int, handed: Sequence[Handed], seconds: float) -> \
            Dict[str, Optional[HostOutcome]]:
        """Each handed host's outcome of ``life``, waiting up to ``seconds`` for those whose
        agents are linked still; None for a host whose agent was lost (or is late)."""
        deadline = time.monotonic() + seconds

        def settled() -> bool:
            linked = {hello.token for hello in self.links.agents()}
            return all((life, one.token) in self._outcomes or one.token not in linked
                       for one in handed)

        with self._lock:
            self._lock.wait_for(settled, max(0.0, deadline - time.monotonic()))
            return {one.host: self._outcomes.get((life, one.token)) for one in handed}

    def close(self) -> None:
        """End every task (the links first, then the slots' jobs): nothing is asked for again."""
        self.links.close()
        self.slots.stop()
