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
saying its host, its executor and the resources Spark gave it; the link's drop tells the
driver at once that the task is gone (its executor killed, its Python worker killed); a slot
whose job fails ends that slot's link too (Spark's word for an executor that vanished from
the network, when no connection closed). Each executor with a linked task is one of the job's
hosts (engines.elastic), the unit that is lost as one: its slots are its linked tasks, and one
of them is its agent for as long as it lives (at first the lowest slot's), which runs the MPI
launcher's proxy command of each life for the executor's ranks and keeps their commits; the
other tasks hold their Spark slots.
"""
import json
import os
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import agent as engine_agent, agent_link
from hvd_trainer_launch.engines.agent_link import Hello, Message

# After a slot's job fails, how long before it is asked for again: the first wait, doubled
# after each failure in a row, at most the last. A task that cannot run at all (its Python
# cannot import hvd_trainer_launch) does not make a tight loop of failing jobs.
RETRY_FIRST_SECONDS = 0.5
RETRY_MOST_SECONDS = 30.0
# How long the linked tasks get to end by themselves when the job is over.
END_GRACE_SECONDS = 10.0
# A slot's job that ran at least this long before failing starts the count of failures anew.
_RAN_WELL_SECONDS = 30.0


def agent_task(address: str, secret: bytes, slot: int) -> Callable:
    """The function a slot's one task runs over its (unused) partition: link up with the
    driver at ``address`` (``secret``: the link's) and run the proxy commands it sends, one
    per life, each with the job's pickled (function, args, kwargs) and secret, until the
    driver ends the link. The first command makes the task its executor's agent
    (engines.agent.ElasticAgent: the folder where the executor's ranks keep their commits
    across lives, removed when the task ends). Its one row is None: the outcomes travel on
    the link. It refers to hvd_trainer_launch's modules alone."""

    def task(_partition):
        from pyspark import TaskContext
        context = TaskContext.get()
        resources = {name: list(info.addresses) for name, info in context.resources().items()}
        # The executor: the process that started this task's Python worker (PySpark's
        # daemon, or the executor JVM itself), which dies with the executor.
        hello = Hello(slot, uuid.uuid4().hex, engine_agent.hostname(), str(os.getppid()),
                      resources)
        side = agent_link.dial(address, secret, hello)
        kept: List[engine_agent.ElasticAgent] = []

        def run(message: Message):
            if not kept:
                kept.append(engine_agent.ElasticAgent())
            payload, job_secret = message.blobs
            return kept[0].run_life(message.fields["line"], payload, job_secret,
                                    message.fields["env"], bool(message.fields.get("ulfm")))

        try:
            agent_link.serve(side, run)
        finally:
            for agent in kept:
                agent.close()
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

    def release(self) -> None:
        """Ask for no slot again (the jobs that run go on)."""
        self._stopping = True

    def wait(self, slots: Sequence[int], seconds: float) -> None:
        """Wait up to ``seconds`` for the jobs of ``slots`` to end by themselves (after
        :meth:`release`)."""
        deadline = time.monotonic() + seconds
        for slot in slots:
            self._threads[slot].join(max(0.0, deadline - time.monotonic()))

    def stop(self, seconds: float = 30.0) -> None:
        """Ask for no slot again, cancel the slots' jobs (Spark kills their tasks' Python
        workers, and the proxies with them) and wait up to ``seconds`` for their threads."""
        self.release()
        self._context.cancelJobGroup(self.group)
        deadline = time.monotonic() + seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class Executor(NamedTuple):
    """An executor of the job now, as the job's host: the ``name`` the job knows it by (its
    host's, or ``host/N`` beside another executor of the same host), its ``host``, its
    ``slots`` (linked tasks, one rank each) and its ``agent`` (the lowest slot's task)."""

    name: str
    host: str
    slots: int
    agent: Hello


def executors_of(agents: Sequence[Hello], names: Dict[Tuple[str, str], str],
                 chosen: Dict[Tuple[str, str], str]) -> List[Executor]:
    """The executors that ``agents`` (linked tasks) run in, in the order of their lowest slot.
    ``names`` (by (host, executor)) keeps each executor's name for as long as it lives: a
    new one gets its host's name where no other executor holds it, else ``host/N`` with the
    lowest N >= 2 free. ``chosen`` keeps each executor's agent (a token) for as long as it is
    linked, since its commits live with it: a new one is the lowest slot's task. Those of
    executors gone are dropped from both."""
    by_executor: Dict[Tuple[str, str], List[Hello]] = {}
    for hello in sorted(agents, key=lambda hello: hello.slot):
        by_executor.setdefault((hello.host, hello.executor), []).append(hello)
    for kept in (names, chosen):
        for key in [key for key in kept if key not in by_executor]:
            del kept[key]
    found = []
    for key, tasks in by_executor.items():
        if key not in names:
            taken = set(names.values())
            number = 1
            while (key[0] if number == 1 else f"{key[0]}/{number}") in taken:
                number += 1
            names[key] = key[0] if number == 1 else f"{key[0]}/{number}"
        agent = next((task for task in tasks if task.token == chosen.get(key)), tasks[0])
        chosen[key] = agent.token
        found.append(Executor(names[key], key[0], len(tasks), agent))
    return found


def resources_in_slot_order(agents: Sequence[Hello], executor: Executor) -> List[Dict[str, Any]]:
    """The resources of ``executor``'s tasks by slot: its ranks' in local rank order
    (hvd_trainer.spark.task.get_available_devices reads its own)."""
    mine = sorted((hello for hello in agents
                   if (hello.host, hello.executor) == (executor.host, executor.agent.executor)),
                  key=lambda hello: hello.slot)
    return [hello.resources for hello in mine]


class SparkAgents:
    """The Spark side of an elastic engine job: ``slots`` slots' jobs and their tasks' links
    (signed with a secret of the links' own). Once :meth:`attach` gives it the job
    (engines.elastic's ElasticJob: ``joined(host, slots)``, ``left(host)``,
    ``returned(life, host, outcome)``, ``lost(life, host, cause)``, its ``payload``,
    ``secret`` and ``settings``), it tells the job as executors join and leave, each executor one of the
    job's hosts, and :meth:`serve` hands a life's proxy command to an executor's agent, with
    the job's payload and secret (which travel on the links alone)."""

    def __init__(self, context, slots: int):
        conf = context.getConf()
        secret = os.urandom(32)
        self._job, self._lock = None, threading.Lock()
        self._names: Dict[Tuple[str, str], str] = {}
        self._agents: Dict[Tuple[str, str], str] = {}  # each executor's agent's token
        self._reported: Dict[str, int] = {}  # what the job was told: slots by executor name
        # The lives handed out and not yet returned: (agent's token, life) -> executor name.
        self._running: Dict[Tuple[str, int], str] = {}
        self.links = agent_link.Links(conf.get("spark.driver.host"), secret, self._moved,
                                      self._received, bind=conf.get("spark.driver.bindAddress"))
        try:
            self.slots = SlotJobs(context, slots, lambda slot: agent_task(
                self.links.address, secret, slot), self.links.drop)
        except BaseException:
            self.links.close()
            raise

    def executors(self) -> List[Executor]:
        """The job's executors now, in the order of their lowest slot."""
        with self._lock:
            return executors_of(self.links.agents(), self._names, self._agents)

    def attach(self, job) -> None:
        """Tell ``job`` of the executors from now on, starting with those there now."""
        with self._lock:
            self._job = job
        self._moved()

    def _moved(self) -> None:
        """A task linked up or was lost: tell the job which executors joined, changed or
        left, and which life's agents were lost before they returned."""
        with self._lock:
            if self._job is None:
                return
            job = self._job
            linked = {hello.token for hello in self.links.agents()}
            now = {executor.name: executor.slots
                   for executor in executors_of(self.links.agents(), self._names, self._agents)}
            lost = [(token, life, name) for (token, life), name in self._running.items()
                    if token not in linked]
            for token, life, _ in lost:
                del self._running[(token, life)]
            told = {name for _, _, name in lost}
            gone = [name for name in self._reported if name not in now and name not in told]
            joined = [(name, slots) for name, slots in now.items()
                      if self._reported.get(name) != slots or name in told]
            self._reported = now
        for _, life, name in lost:
            job.lost(life, name, "its Spark task's link to the driver closed (the executor "
                                 "or the task's Python worker died)")
        for name in gone:
            job.left(name)
        for name, slots in joined:
            job.joined(name, slots)

    def _received(self, token: str, message: Message) -> None:
        outcome = agent_link.outcome_of(message)  # ValueError: the link is dropped
        life = int(message.fields["life"])
        with self._lock:
            name = self._running.pop((token, life), None)
        if name is not None:
            self._job.returned(life, name, outcome)

    def serve(self, dispatch) -> None:
        """Hand ``dispatch`` (engines.elastic's Dispatch: life, host, line) to the agent of
        the executor it names, with its tasks' resources for its ranks; an executor with no
        linked task is reported lost at once."""
        with self._lock:
            agents = self.links.agents()
            found = [executor for executor in executors_of(agents, self._names, self._agents)
                     if executor.name == dispatch.host]
            if found:
                self._running[(found[0].agent.token, dispatch.life)] = dispatch.host
        if found:
            resources = resources_in_slot_order(agents, found[0])
            fields = {"life": dispatch.life, "line": dispatch.line,
                      "env": {protocol.SPARK_RESOURCES_VARIABLE: json.dumps(resources)},
                      "ulfm": self._job.settings.ulfm}
            message = Message("run", fields, (self._job.payload, self._job.secret))
            if self.links.send(found[0].agent.token, message):
                return
            with self._lock:
                self._running.pop((found[0].agent.token, dispatch.life), None)
        self._job.lost(dispatch.life, dispatch.host, "no Spark task of it is linked to the "
                                                     "driver", absent=True)

    def close(self) -> None:
        """End every task: ask for no slot again, end the links, give the linked tasks
        END_GRACE_SECONDS to end by themselves (each agent removes its commits), then cancel
        the slots' jobs (those still waiting for a slot, and any task that lingers)."""
        self.slots.release()
        linked = [hello.slot for hello in self.links.agents()]
        self.links.close()
        self.slots.wait(linked, END_GRACE_SECONDS)
        self.slots.stop()
