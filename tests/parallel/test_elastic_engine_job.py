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
import os
import signal
import sys
import tempfile
import threading
import time

import cloudpickle
import numpy as np
import pytest

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.engines import agent as engine_agent, calls, elastic
from hvd_trainer_launch.engines import launch as engine_launch
from hvd_trainer_launch.engines.calls import EngineError

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    engine_launch.check_launcher().flavour != mpi.HYDRA,
    reason="three agents on one machine: Open MPI's daemons collide (tests/multihost)")]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
HOSTS = ("node-a", "node-b", "node-c")
STEPS = 24


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

    def join(self, host):
        if host in self.agents:  # the host's earlier agent, gone with its node
            self.agents[host].close()
        self.agents[host] = engine_agent.ElasticAgent()
        self.job.joined(host, 1)

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


def _train(steps, progress):
    """Each step: the ranks' gradients (rank + 1) * (step + 1) summed, w = w / 2 + sum;
    rank 0 notes each commit and, at each life's start, where the life starts."""
    import os
    import time
    import numpy as np
    import hvd_trainer as hvd
    from hvd_trainer import elastic as hvd_elastic
    hvd.init()
    state = hvd_elastic.ObjectState(w=np.zeros(3), step=0, sizes=[])

    def note(text):
        if hvd.rank() == 0:
            with open(progress, "a") as file:
                file.write(text + "\n")

    @hvd_elastic.run
    def loop(state):
        note(f"start {state.step} {hvd.size()}")
        while state.step < steps:
            grad = hvd.allreduce(np.full(3, hvd.rank() + 1.0) * (state.step + 1), op=hvd.Sum)
            state.w = state.w / 2 + grad
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()
            note(f"commit {state.step}")
            time.sleep(0.25)
    loop(state)
    return state.w, state.sizes


def _replay(sizes):
    """The weights of the committed steps, in one process: n ranks sum n (n + 1) / 2."""
    w = np.zeros(3)
    for step, n in enumerate(sizes):
        w = w / 2 + n * (n + 1) / 2 * (step + 1)
    return w


def _lines(path, word):
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [line.split()[1:] for line in file if line.startswith(word)]


def _wait(condition, seconds=120):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_loss_shrinks_and_return_grows_with_no_commit_lost(tmp_path):
    progress = str(tmp_path / "progress")
    engine = ThreadEngine()
    engine.start(calls.payload(_train, (STEPS, progress)),
                 elastic.ElasticSettings(min_np=2, max_np=3, np=3, elastic_timeout=60,
                                         start_timeout=60))
    results = []
    runner = threading.Thread(target=lambda: results.append(engine.job.run()))
    runner.start()
    try:
        _wait(lambda: len(_lines(progress, "commit")) >= 4)
        seen = int(_lines(progress, "commit")[-1][0])
        engine.kill("node-b")
        _wait(lambda: any(size == "2" for _, size in _lines(progress, "start")))
        _wait(lambda: int(_lines(progress, "commit")[-1][0]) >= seen + 4)
        engine.join("node-b")
        runner.join(300)
    finally:
        if runner.is_alive():
            engine.kill("node-a"), engine.kill("node-b"), engine.kill("node-c")
        runner.join(60)
        engine.close()
    (w, sizes), *others = results[0]
    assert len(results[0]) == 3  # grown back: the final life ran on three hosts
    starts = [(int(step), int(size)) for step, size in _lines(progress, "start")]
    assert starts[0] == (0, 3)
    # No commit lost: the life after the loss starts at or after the last commit seen.
    shrunk = [step for step, size in starts if size == 2]
    assert shrunk and shrunk[0] >= seen
    assert len(sizes) == STEPS and 2 in sizes and sizes[-1] == 3
    np.testing.assert_allclose(w, _replay(sizes))
    for other_w, other_sizes in others:
        np.testing.assert_array_equal(other_w, w)
        assert other_sizes == sizes


def test_every_host_gone_ends_the_job_with_the_reason():
    engine = ThreadEngine()
    engine.start(calls.payload(_train, (1000, os.devnull)),
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
    assert not glob.glob(os.path.join(tempfile.gettempdir(), elastic.FOLDER_PREFIX + "*"))
    assert not glob.glob(os.path.join(tempfile.gettempdir(), engine_agent.COMMITS_PREFIX + "*"))
