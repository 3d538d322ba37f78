"""The engines' launch with no engine: hvdrun's MPI launcher hands each host's proxy command to
the agents (here threads and a child process of the test stand in for Ray actors and Spark
tasks), under whichever MPI this environment has: MPICH's manual launcher, or Open MPI's
mpirun calling the launcher agent (engine_ssh) in place of ssh. Checked: the results against
NumPy, each agent given its own host's command, Horovod's variables, the horovod shim on
ranks without Horovod (and an installed one left alone), a killed agent taking its proxy and
its ranks with it and its folder left to the next agent's sweep, and what an outsider who
takes a proxy's place at MPICH's control port receives: no secret, nothing of the driver's
environment."""
import glob
import io
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle
import numpy as np
import pytest

from hvd_trainer_launch import engine_agent, engine_launch, mpi, owned_folders, protocol
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
    import horovod  # no Horovod here: the shim, which the rank gets without asking
    import hvd_trainer as hvd
    from hvd_trainer_launch import horovod_shim
    hvd.init()
    mine = np.arange(6.0) * (hvd.rank() + 1) * scale
    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_HOSTNAME")
    variables = {name: os.environ.get(name) for name in names}
    return variables, hvd.allreduce(mine, op=hvd.Sum), horovod_shim.is_shim(horovod.__file__)


def _launch(layout, secret, out=None, env=None):
    return engine_launch.AgentLaunch(layout, engine_launch.rank_command(), flavour=FLAVOUR,
                                     secret=secret, env={"OMP_NUM_THREADS": "1", **(env or {})},
                                     start_timeout=60, out=out)


def test_each_agent_runs_its_hosts_proxy():
    secret = os.urandom(32)
    launch = _launch(LAYOUT, secret)
    try:
        lines = launch.proxies(60)
        payload = engine_launch.payload(_collective, (2.0,))
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
    for rank, (variables, summed, shim) in enumerate(results):
        assert shim
        # Open MPI knew each host by another name: the rank puts this host's own back.
        assert variables == {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "3",
                             "HOROVOD_LOCAL_RANK": str(rank % LAYOUT[0][1]),
                             "HOROVOD_HOSTNAME": HOST}
        np.testing.assert_array_equal(summed, want)


def _sleep_long():
    import time
    import horovod  # the "installed" one the test puts on PYTHONPATH
    import hvd_trainer as hvd
    hvd.init()
    print(f"asleep with {horovod.__file__}", flush=True)
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


def _agent_folders(pid):
    """The folders in the temporary folder that the agent ``pid`` made (owned_folders)."""
    return glob.glob(os.path.join(tempfile.gettempdir(),
                                  f"{engine_agent.FOLDER_PREFIX}*-{pid}-*.*"))


def test_a_killed_agent_takes_its_proxy_and_ranks_with_it(tmp_path):
    marker = f"HVD_TEST_AGENTS_{secrets.token_hex(4)}"
    layout = [(HOST, 3)]
    out = io.BytesIO()  # the ranks' output
    secret = os.urandom(32)
    (tmp_path / "horovod").mkdir()  # an installed Horovod, which the ranks must import
    (tmp_path / "horovod" / "__init__.py").write_text("")
    launch = _launch(layout, secret, out, env={"PYTHONPATH": str(tmp_path)})
    agent = None
    try:
        line, = launch.proxies(60)
        agent = subprocess.Popen([sys.executable, "-c", _AGENT, line, secret.hex()],
                                 stdin=subprocess.PIPE, env=dict(os.environ, **{marker: "1"}))
        agent.stdin.write(engine_launch.payload(_sleep_long))
        agent.stdin.close()
        deadline = time.monotonic() + 60
        while out.getvalue().count(b"asleep") < 3:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        folders = _agent_folders(agent.pid)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        code = launch.wait(60)
    finally:
        launch.end()
        if agent is not None and agent.poll() is None:
            agent.kill()
    assert code != 0
    assert out.getvalue().count(f"asleep with {tmp_path / 'horovod' / '__init__.py'}"
                                .encode()) == 3
    deadline = time.monotonic() + 20
    while _processes_with(marker):
        assert time.monotonic() < deadline, "processes left behind the killed agent"
        time.sleep(0.2)
    with pytest.raises(EngineError, match="ended without a result"):
        engine_launch.gather({}, 3, "_sleep_long", engine_launch.host_of_ranks(layout), code,
                             launch.messages)
    # SIGKILL skipped the agent's cleanup: its folder (the pickled function) stays until the
    # next agent on this host sweeps it.
    assert len(folders) == 1 and os.path.isdir(folders[0])
    assert folders[0] in owned_folders.sweep(engine_agent.FOLDER_PREFIX)
    assert not os.path.exists(folders[0])


def test_a_missing_executable_and_bad_launcher_arguments_are_named():
    # Issue 46: "exited with code 127", and "its messages above say why" with none of them.
    secret = os.urandom(32)
    missing = engine_launch.AgentLaunch(
        [(HOST, 1)], engine_launch.rank_command("/no/such/python"), flavour=FLAVOUR,
        secret=secret, start_timeout=60, err=io.BytesIO())
    try:
        line, = missing.proxies(60)
        outcome = engine_agent.run_proxy(line, engine_launch.payload(len, ([],)), secret)
        code = missing.wait(60)
    finally:
        missing.end()
    with pytest.raises(EngineError, match=r"rank 0: cannot run '/no/such/python': No such "
                                          r"file or directory"):
        engine_launch.gather(outcome.outcomes, 1, "len", {0: HOST}, code, missing.messages)
    bad = engine_launch.AgentLaunch([(HOST, 1)], engine_launch.rank_command(), flavour=FLAVOUR,
                                    secret=secret, mpi_args=["--no-such-launcher-flag"],
                                    start_timeout=60, err=io.BytesIO())
    try:
        with pytest.raises(EngineError, match=r"the MPI launcher said: .*no-such-launcher-flag"):
            bad.proxies(60)
    finally:
        bad.end()


def _control_port_relay(address, received):
    """Listen on the loopback for one connection, which it joins to ``address`` (MPICH's
    control port), keeping in ``received`` what the port sends; the relay's address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(source, target, kept):
        while True:
            data = source.recv(65536)
            if not data:
                target.shutdown(socket.SHUT_WR)
                return
            kept += data
            target.sendall(data)

    def serve():
        with listener:
            outsider, _ = listener.accept()
        host, _, port = address.rpartition(":")
        port_side = socket.create_connection((host, int(port)))
        threading.Thread(target=pump, args=(outsider, port_side, bytearray()),
                         daemon=True).start()
        try:
            pump(port_side, outsider, received)
        except OSError:  # the job ended
            pass
    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.skipif(FLAVOUR != mpi.HYDRA, reason="MPICH's control port (Open MPI's daemons "
                    "take their command from the launcher agent, docs/security.md)")
def test_an_outsider_at_the_control_port_gets_no_secret_and_nothing_of_the_drivers_environment(
        monkeypatch):
    # Issue 46: a connection with the proxy line received HVD_JOB_SECRET, the reports' address
    # and the driver's whole environment.
    driver_only, job_variable = secrets.token_hex(8), secrets.token_hex(8)
    monkeypatch.setenv("HVD_TEST_DRIVER_SECRET", driver_only)
    secret = os.urandom(32)
    launch = _launch([(HOST, 1)], secret, env={"HVD_TEST_JOB_VARIABLE": job_variable})
    received = bytearray()
    try:
        line, = launch.proxies(60)
        words = shlex.split(line)
        place = words.index("--control-port") + 1
        words[place] = _control_port_relay(words[place], received)
        # The outsider runs the proxy with what it has: its own environment, no agent's.
        outsider = subprocess.run(words, env=dict(os.environ), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=60)
        code = launch.wait(60)
    finally:
        launch.end()
    assert job_variable.encode() in received  # the relay saw the ranks' environment go by
    for kept in (secret.hex(), protocol.engine_job_secret(secret), driver_only,
                 protocol.SECRET_VARIABLE, protocol.ENGINE_SECRET_VARIABLE):
        assert kept.encode() not in received, kept
    assert code != 0, outsider  # its ranks, without the agent's folder, have nothing to run

