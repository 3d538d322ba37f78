"""The elastic engine job (hvd_trainer_launch.engines.elastic) with no engine: threads of the
test stand in for the engine, starting an agent (agent.ElasticAgent) per host, serving each
life's proxy line to it, reporting hosts that join and leave, and killing a host's agent
processes as a lost node would. Checked: results of a job that does not change; a training
that loses a host mid-way, shrinks to the two survivors, grows back to three when the host
returns, and ends with weights equal to the committed steps replayed in one process, having
lost no commit (each life starts at or after the last commit seen before the loss); a job
whose every host is lost ends with the reason; no process or folder
left behind. Three "hosts" on one machine: MPICH only (Open MPI's daemons collide on one
machine; the multi-host bed runs it there)."""
import glob
import io
import os
import signal
import sys
import tempfile
import threading
import time

import cloudpickle
import numpy as np
import pytest

import elastic_loops
from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.engines import agent as engine_agent, calls, elastic
from hvd_trainer_launch.engines import launch as engine_launch
from hvd_trainer_launch.engines.calls import EngineError

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    engine_launch.check_launcher().flavour != mpi.HYDRA,
    reason="three agents on one machine: Open MPI's daemons collide (tests/multihost)")]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
HOSTS = ("node-a", "node-b", "node-c")
LIMIT = 400  # steps at most: the job ends elastic_loops.GROWN_STEPS steps after it grows back


class ThreadEngine:
    """The engine's part: an ElasticAgent per host, each life's line run on a thread."""

    def __init__(self):
        self.agents = {}
        self.job = None

    def start(self, payload, settings, hosts=HOSTS):
        self.job = elastic.ElasticJob(payload, flavour=mpi.HYDRA, settings=settings,
                                      serve=self.serve, env={"OMP_NUM_THREADS": "1"},
                                      name="train")
        for host in hosts:
            self.join(host)

    def join(self, host, slots=1):
        if host in self.agents:  # the host's earlier agent, gone with its node
            self.agents[host].close()
        self.agents[host] = engine_agent.ElasticAgent()
        self.job.joined(host, slots)

    def serve(self, dispatch):
        agent, job = self.agents[dispatch.host], self.job

        def run():
            job.returned(dispatch.life, dispatch.host,
                         agent.run_life(dispatch.line, job.payload, job.secret))
        threading.Thread(target=run, daemon=True).start()

    def kill(self, host):
        """What a lost node does: its agent's launcher proxy dies (as with the agent's
        process: its ranks end with it), and the engine says the host left."""
        wanted = f"{protocol.ENGINE_COMMITS_VARIABLE}={self.agents[host].commits}".encode()
        self.job.left(host)
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    mine = wanted in environ.read().split(b"\0")
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if mine and b"hydra_pmi_proxy" in cmdline.read():
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def close(self):
        for agent in self.agents.values():
            agent.close()

    def finish(self, runner):
        """After a test: the job's proxies killed if ``runner`` (its thread) still runs, then
        every agent closed."""
        if runner.is_alive():
            for host in list(self.agents):
                self.kill(host)
        runner.join(60)
        self.close()


def _sizes(x):
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    return hvd.rank(), hvd.size(), hvd.allreduce(np.ones(2) * x, op=hvd.Sum)


def test_a_job_that_does_not_change():
    engine = ThreadEngine()
    engine.start(calls.payload(_sizes, (2.0,)), elastic.ElasticSettings(min_np=3))
    try:
        results = engine.job.run()
    finally:
        engine.close()
    assert [(rank, size) for rank, size, _ in results] == [(0, 3), (1, 3), (2, 3)]
    for _, _, summed in results:
        np.testing.assert_array_equal(summed, np.full(2, 6.0))


def test_loss_shrinks_and_return_grows_with_no_commit_lost(tmp_path):
    progress = str(tmp_path / "progress")
    engine = ThreadEngine()
    engine.start(calls.payload(elastic_loops.train, (LIMIT, progress)),
                 elastic.ElasticSettings(min_np=2, max_np=3, np=3, elastic_timeout=60,
                                         start_timeout=60))
    results = []
    runner = threading.Thread(target=lambda: results.append(engine.job.run()))
    runner.start()
    try:
        elastic_loops.wait(lambda: len(elastic_loops.notes(progress, "commit")) >= 4)
        seen = int(elastic_loops.notes(progress, "commit")[-1][0])
        engine.kill("node-b")
        elastic_loops.wait(lambda: any(size == "2" for _, size in elastic_loops.notes(progress, "start")))
        elastic_loops.wait(lambda: int(elastic_loops.notes(progress, "commit")[-1][0]) >= seen + 4)
        engine.join("node-b")
        runner.join(300)
    finally:
        engine.finish(runner)
    elastic_loops.check(results[0], progress, seen, grew_in_place=True)


def _grow_then_shrink(progress):
    """Commit until the job has grown to five ranks and shrunk to one (at most 600 steps);
    each process notes its start in ``progress``. Every rank's place, its agent's commits
    folder, a sum and the sizes it went through."""
    import os
    import time
    import numpy as np
    import hvd_trainer as hvd
    from hvd_trainer import elastic as hvd_elastic
    with open(progress, "a") as file:
        file.write(f"started {os.getpid()}\n")
    hvd.init()

    @hvd_elastic.run
    def loop(state):
        while True:
            if hvd.size() not in state.sizes:
                state.sizes = state.sizes + [hvd.size()]
            if (5 in state.sizes and hvd.size() == 1) or state.step == 600:
                break
            state.step += 1
            state.commit()
            time.sleep(0.2)
        summed = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum)
        return hvd.rank(), hvd.size(), os.environ["HVD_ELASTIC_DIR"], summed, state.sizes
    return loop(hvd_elastic.ObjectState(step=0, sizes=[]))


def test_hosts_added_at_once_and_removed_change_the_job_in_place(tmp_path):
    """Horovod's test_ray_elastic.py scenario: node-a's two ranks run; node-b (one slot) and
    node-c (two) join at once: the two ranks go on in their processes and MPI starts three
    more, rank 2 under node-b's agent and ranks 3 and 4 under node-c's (MPICH's Hydra takes
    one host list for a whole spawn: given one host per place, it put every new rank on the
    last). Then node-a and node-c leave: their ranks leave the world at a commit and node-b's
    rank goes on alone, in its process, the only result."""
    progress = str(tmp_path / "progress")
    engine = ThreadEngine()
    engine.start(calls.payload(_grow_then_shrink, (progress,)),
                 elastic.ElasticSettings(min_np=1, start_timeout=60), hosts=())
    engine.join("node-a", 2)
    results = []
    runner = threading.Thread(target=lambda: results.append(engine.job.run()))
    runner.start()
    try:
        elastic_loops.wait(lambda: len(elastic_loops.notes(progress, "started")) >= 2)
        time.sleep(1)
        engine.join("node-b", 1)
        engine.join("node-c", 2)
        elastic_loops.wait(lambda: len(elastic_loops.notes(progress, "started")) >= 5)
        time.sleep(1)
        engine.job.left("node-a")
        engine.job.left("node-c")
        runner.join(300)
    finally:
        engine.finish(runner)
    assert results, "the job did not end"
    [(rank, size, folder, summed, sizes)] = results[0]
    assert (rank, size, folder, sizes) == (0, 1, engine.agents["node-b"].commits, [2, 5, 1])
    np.testing.assert_array_equal(summed, np.full(2, 1.0))
    assert len(elastic_loops.notes(progress, "started")) == 5  # no rank started twice


class DeafEngine(ThreadEngine):
    """An engine whose agent on ``deaf`` takes the first life's growth line and never runs it,
    as when its proxy cannot reach the launcher: the running ranks wait in the spawn."""

    def __init__(self, deaf):
        super().__init__()
        self.deaf = deaf

    def serve(self, dispatch):
        if not (dispatch.host == self.deaf and dispatch.life == 0):
            super().serve(dispatch)


def _grow_to_two():
    """Commit until the job has two ranks (at most 600 steps); each rank's place."""
    import time
    import hvd_trainer as hvd
    from hvd_trainer import elastic as hvd_elastic
    hvd.init()

    @hvd_elastic.run
    def loop(state):
        while hvd.size() < 2 and state.step < 600:
            state.step += 1
            state.commit()
            time.sleep(0.2)
        return hvd.rank(), hvd.size()
    return loop(hvd_elastic.ObjectState(step=0))


def test_a_growth_whose_ranks_never_start_ends_its_life_after_the_start_timeout():
    """node-b joins; its agent never runs the growth's proxy line. Its rank does not start
    within the start timeout (5 s) of the line's handing out: hvdrun ends the life, in which
    node-a's rank waited in the spawn, and the next life starts on both (node-b's agent runs
    that one), rather than the job waiting for ever."""
    engine = DeafEngine("node-b")
    engine.start(calls.payload(_grow_to_two),
                 elastic.ElasticSettings(min_np=1, start_timeout=5), hosts=("node-a",))
    said, results = io.BytesIO(), []
    runner = threading.Thread(target=lambda: results.append(engine.job.run(err=said)))
    runner.start()
    try:
        time.sleep(3)
        engine.join("node-b")
        runner.join(120)
    finally:
        engine.finish(runner)
    text = said.getvalue().decode(errors="replace")
    assert results, f"the job did not end:\n{text[-3000:]}"
    assert results[0] == [(0, 2), (1, 2)]
    assert "rank 1 did not start within --start-timeout 5 s" in text, text[-3000:]


class LosingEngine(ThreadEngine):
    """An engine whose agent on ``lost`` is known lost as the first life is handed to it
    (Ray's actor died, Spark's task failed): it runs no line, and says so."""

    def __init__(self, lost):
        super().__init__()
        self.lost = lost

    def serve(self, dispatch):
        if dispatch.host == self.lost and dispatch.life == 0:
            self.job.lost(dispatch.life, dispatch.host, "its actor died")
        else:
            super().serve(dispatch)


def test_an_agent_lost_ends_its_life_at_once_not_at_the_start_timeout():
    """The lost agent's ranks never start: hvdrun ends the life on the engine's word and the
    next starts on the others, long before the start timeout (set far larger than the wait
    here) would have ended it."""
    engine = LosingEngine("node-c")
    engine.start(calls.payload(_sizes, (2.0,)),
                 elastic.ElasticSettings(min_np=2, max_np=3, np=3, start_timeout=3600))
    said, results = io.BytesIO(), []
    runner = threading.Thread(target=lambda: results.append(engine.job.run(err=said)),
                              daemon=True)
    runner.start()
    runner.join(600)
    engine.close()
    text = said.getvalue().decode(errors="replace")
    assert results, f"the life waited for the lost agent's ranks:\n{text[-3000:]}"
    assert "the engine lost the agent of rank 2 on hvd-agent2-node-c (its actor died); " \
           "ending this life" in text, text[-3000:]
    assert [(rank, size) for rank, size, _ in results[0]] == [(0, 2), (1, 2)]
    for _, _, summed in results[0]:
        np.testing.assert_array_equal(summed, np.full(2, 4.0))


def test_every_host_gone_ends_the_job_with_the_reason():
    engine = ThreadEngine()
    engine.start(calls.payload(elastic_loops.train, (1000, os.devnull)),
                 elastic.ElasticSettings(min_np=2, elastic_timeout=3, start_timeout=60))
    errors = []

    def run():
        try:
            engine.job.run()
        except EngineError as error:
            errors.append(str(error))
    runner = threading.Thread(target=run)
    runner.start()
    try:
        time.sleep(4)
        for host in HOSTS:
            engine.kill(host)
        runner.join(120)
    finally:
        engine.close()
    # hvdrun's reason (every rank failed at once, or no slots left for elastic_timeout,
    # whichever came first) and the engine's: every host is gone.
    assert errors and ("every rank failed in this life" in errors[0]
                       or "fewer than --min-np 2; ending the job" in errors[0])
    assert "every host has left the job" in errors[0]
    # This process made both (owned_folders names the maker); other sessions' share /tmp.
    for prefix in (elastic.FOLDER_PREFIX, engine_agent.COMMITS_PREFIX):
        assert not glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*-{os.getpid()}-*"))
