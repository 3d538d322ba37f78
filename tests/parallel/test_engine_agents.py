"""The engines' launch with no engine: hvdrun's MPI launcher hands each host's proxy command to
the agents (here threads and a child process of the test stand in for Ray actors and Spark
tasks), under whichever MPI this environment has: MPICH's manual launcher, or Open MPI's
mpirun calling the launcher agent (engine_ssh) in place of ssh. Checked: the results against
NumPy, each agent given its own host's command, Horovod's variables, and a killed agent
taking its proxy and its ranks with it."""
import io
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest

from hvd_trainer_launch import engine_agent, engine_launch, mpi
from hvd_trainer_launch.engine_launch import EngineError

pytestmark = pytest.mark.mpi

# The ranks cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
HOST = socket.gethostname()
FLAVOUR = engine_launch.check_launcher().flavour
# Under MPICH two hosts as the launcher sees them, both this machine (Hydra makes each entry a
# node): 2 ranks, then 1. Open MPI's daemons collide on one machine: one host of 3 there (the
# multi-host test bed gives it several).
LAYOUT = [(HOST, 2), ("localhost", 1)] if FLAVOUR == mpi.HYDRA else [(HOST, 3)]


def _collective(scale):
    import os
    import numpy as np
    import hvd_trainer as hvd
    hvd.init()
    mine = np.arange(6.0) * (hvd.rank() + 1) * scale
    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_HOSTNAME")
    return {name: os.environ.get(name) for name in names}, hvd.allreduce(mine, op=hvd.Sum)


def _launch(layout, out=None):
    return engine_launch.AgentLaunch(layout, engine_launch.rank_command(), flavour=FLAVOUR,
                                     env={"OMP_NUM_THREADS": "1"}, start_timeout=60, out=out)


def test_each_agent_runs_its_hosts_proxy():
    launch = _launch(LAYOUT)
    try:
        lines = launch.proxies(60)
        payload, secret = engine_launch.payload(_collective, (2.0,)), os.urandom(32)
        found = [None] * len(lines)

        def agent(place):
            found[place] = engine_agent.run_proxy(lines[place], payload, secret)
        agents = [threading.Thread(target=agent, args=(place,)) for place in range(len(lines))]
        for thread in agents:
            thread.start()
        for thread in agents:
            thread.join(120)
        code = launch.wait(60)
    finally:
        launch.end()
    assert code == 0, launch.messages
    # Each host's agent carried back the ranks of its host.
    assert [sorted(outcome.outcomes) for outcome in found] == \
        [[r for r, h in engine_launch.host_of_ranks(LAYOUT).items() if h == host]
         for host, _ in LAYOUT]
    outcomes = {rank: data for outcome in found for rank, data in outcome.outcomes.items()}
    results = engine_launch.gather(outcomes, 3, "_collective",
                                   engine_launch.host_of_ranks(LAYOUT), code, launch.messages)
    want = sum(np.arange(6.0) * (rank + 1) * 2.0 for rank in range(3))
    for rank, (variables, summed) in enumerate(results):
        # Open MPI knew each host by another name: the rank puts this host's own back.
        assert variables == {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "3",
                             "HOROVOD_LOCAL_RANK": str(rank % LAYOUT[0][1]),
                             "HOROVOD_HOSTNAME": HOST}
        np.testing.assert_array_equal(summed, want)


def _sleep_long():
    import time
    import hvd_trainer as hvd
    hvd.init()
    print("asleep", flush=True)
    time.sleep(120)


# An agent in a process of its own, which the test kills: it runs the proxy line argv[1]
# with the function read from stdin, as a Ray actor or a Spark task would.
_AGENT = ("import sys\nfrom hvd_trainer_launch import engine_agent\n"
          "engine_agent.run_proxy(sys.argv[1], sys.stdin.buffer.read(), bytes.fromhex(sys.argv[2]))\n")


def _processes_with(variable):
    """PIDs of this user's processes whose environment sets ``variable``."""
    wanted, found = f"{variable}=".encode(), []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if any(item.startswith(wanted) for item in environ.read().split(b"\0")):
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def test_a_killed_agent_takes_its_proxy_and_ranks_with_it():
    marker = f"HVD_TEST_AGENTS_{secrets.token_hex(4)}"
    layout = [(HOST, 3)]
    out = io.BytesIO()  # the ranks' output
    launch = _launch(layout, out)
    agent = None
    try:
        line, = launch.proxies(60)
        agent = subprocess.Popen([sys.executable, "-c", _AGENT, line, os.urandom(32).hex()],
                                 stdin=subprocess.PIPE, env=dict(os.environ, **{marker: "1"}))
        agent.stdin.write(engine_launch.payload(_sleep_long))
        agent.stdin.close()
        deadline = time.monotonic() + 60
        while out.getvalue().count(b"asleep") < 3:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        code = launch.wait(60)
    finally:
        launch.end()
        if agent is not None and agent.poll() is None:
            agent.kill()
    assert code != 0
    deadline = time.monotonic() + 20
    while _processes_with(marker):
        assert time.monotonic() < deadline, "processes left behind the killed agent"
        time.sleep(0.2)
    with pytest.raises(EngineError, match="ended without a result"):
        engine_launch.gather({}, 3, "_sleep_long", engine_launch.host_of_ranks(layout), code,
                             launch.messages)
