"""The engines' pure pieces: the rank layout by host, gathering the ranks' outcomes into
results or an error that names the rank and host, and the signed files between an agent and
its ranks (a tampered or foreign file is refused before it is read)."""
import os
import pickle
import re
import shlex
import socket
import sys
import threading

import cloudpickle
import pytest

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import calls, launch as engine_launch
from hvd_trainer_launch.engines.calls import EngineError, HostOutcome, Outcome
from hvd_trainer_launch.files import signed as signed_files


def test_rank_layout_groups_by_first_appearance():
    assert engine_launch.rank_layout(["b", "a", "b", "c", "a"]) == [("b", 2), ("a", 2), ("c", 1)]
    assert engine_launch.host_of_ranks([("b", 2), ("a", 1)]) == {0: "b", 1: "b", 2: "a"}


def _ok(value):
    return calls.returned(value)


def test_gather_orders_results_by_rank():
    outcomes = {2: _ok("two"), 0: _ok("zero"), 1: _ok("one")}
    assert calls.gather(outcomes, 3, "f", {}, 0, []) == ["zero", "one", "two"]


def test_ranks_that_left_the_world_in_place_have_no_result_and_the_others_keep_their_order():
    # Horovod's test_ray_elastic.py scenario: ranks 0, 1 and 3 left, rank 2 went on alone.
    outcomes = {0: calls.left_job(), 1: calls.left_job(), 2: _ok("two"), 3: calls.left_job()}
    assert calls.gather(outcomes, 4, "f", {}, 0, []) == ["two"]
    # A rank with neither a result nor word that it left is still missing.
    with pytest.raises(EngineError, match="rank 3 ended without a result"):
        calls.gather({0: calls.left_job(), 1: _ok(1), 2: _ok(2)}, 4, "f", {}, 0, [])


def test_gather_names_the_rank_and_host_that_raised():
    error = KeyError("boom")
    outcomes = {0: _ok(0), 1: cloudpickle.dumps(Outcome(raised=error, text="Traceback: KeyError boom"))}
    with pytest.raises(EngineError, match=r"f raised on rank 1 on host h2:\nTraceback") as raised:
        calls.gather(outcomes, 2, "f", {0: "h1", 1: "h2"}, 1, ["rank 1 exited"])
    assert isinstance(raised.value.__cause__, KeyError)


def test_gather_names_missing_ranks_lost_agents_and_failed_proxies():
    with pytest.raises(EngineError, match=r"rank 1 on h2 ended without a result; hvdrun exited "
                                          r"with code 1(.|\n)*proxy on h2 exited with code 5: "
                                          r"cannot connect"):
        calls.gather({0: _ok(0)}, 2, "f", {0: "h1", 1: "h2"}, 1, [],
                     proxies=[HostOutcome("h1", 0, {}),
                              HostOutcome("h2", 5, {}, "cannot connect\n")])
    cause = "ActorDiedError: The actor is dead because it was killed by `ray.kill`."
    with pytest.raises(EngineError, match=r"f: the agent on h2 was lost .*\nh2: " +
                       re.escape(cause)):
        calls.gather({0: _ok(0)}, 2, "f", {}, 0, [],
                             lost=[calls.LostAgent("h2", cause)])


def test_a_long_traceback_is_cut_in_the_message_and_kept_whole_on_the_error():
    text = "Traceback (most recent call last):\n" + "  frame\n" * 20000 + "KeyError: 'end'\n"
    outcomes = {0: cloudpickle.dumps(Outcome(raised=KeyError("end"), text=text))}
    with pytest.raises(EngineError) as raised:
        calls.gather(outcomes, 1, "f", {0: "h1"}, 1, [])
    message = str(raised.value)
    assert len(text) > 2 * calls.MESSAGE_TRACEBACK_CHARS
    assert len(message) < calls.MESSAGE_TRACEBACK_CHARS + 1000
    assert "characters cut here" in message and message.endswith("KeyError: 'end'\n")
    assert raised.value.rank_traceback == text


def test_sys_exit_travels_as_the_systemexit_it_means():
    class _JobsOwnExit(SystemExit):  # as hvd_trainer's, which sys.exit raises in a job
        pass

    def exit_as_a_job_does(status):
        __tracebackhide__ = True  # noqa: F841 (as hvd_trainer's replacement of sys.exit)
        raise _JobsOwnExit(status)

    try:
        exit_as_a_job_does(3)
    except SystemExit as raised:
        outcome = pickle.loads(calls.raised(raised))
    assert (outcome.failed, type(outcome.raised), outcome.raised.code) == (True, SystemExit, 3)
    assert outcome.text.endswith("    exit_as_a_job_does(3)\nSystemExit: 3\n")
    assert "_JobsOwnExit" not in outcome.text


def test_signed_files_round_trip_and_refuse_tampering(tmp_path):
    secret = os.urandom(32)
    folder = str(tmp_path)
    os.chmod(folder, 0o700)
    signed_files.write_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), secret, b"payload")
    function = os.path.join(folder, protocol.ENGINE_FUNCTION)
    assert signed_files.read_signed(function, secret) == b"payload"
    with pytest.raises(FileExistsError):  # never over an existing file
        signed_files.write_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), secret, b"other")
    with pytest.raises(ValueError, match="fails its signature check"):
        signed_files.read_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), os.urandom(32))
    # A file's signature binds its label: a result cannot stand in for the function.
    os.rename(os.path.join(folder, protocol.ENGINE_FUNCTION),
              os.path.join(folder, protocol.ENGINE_RESULT.format(rank=0)))
    with pytest.raises(ValueError, match="fails its signature check"):
        signed_files.read_signed(os.path.join(folder, protocol.ENGINE_RESULT.format(rank=0)),
                                 secret)
    path = os.path.join(folder, "loose")
    with open(path, "wb") as f:
        f.write(b"x" * 40)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="not an owner-only file"):
        signed_files.read_signed(os.path.join(folder, "loose"), secret)


def test_engine_rank_runs_the_function_and_leaves_its_outcome(tmp_path, monkeypatch):
    from hvd_trainer_launch.engines import rank as engine_rank
    secret, folder = os.urandom(32), str(tmp_path)
    signed_files.write_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), secret,
                              calls.payload(lambda a, b=0: a + b, (2,), {"b": 3}))
    monkeypatch.setenv(protocol.ENGINE_FOLDER_VARIABLE, folder)
    monkeypatch.setenv(protocol.ENGINE_SECRET_VARIABLE, secret.hex())
    monkeypatch.setenv("HOROVOD_RANK", "4")
    monkeypatch.setenv("HOROVOD_HOSTNAME", "hvd-agent0-elsewhere")  # Open MPI's name for it
    monkeypatch.setenv("PYTHONPATH", "")  # engine_rank may offer the horovod shim on both
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(folder)
    engine_rank.main()
    label = protocol.ENGINE_RESULT.format(rank=4)
    assert pickle.loads(signed_files.read_signed(os.path.join(folder, label), secret)) == \
        Outcome(value=5)
    assert os.environ["HOROVOD_HOSTNAME"] == socket.gethostname()


def test_launcher_agent_line_execs_the_daemon_in_the_shell_of_mpiruns_syntax():
    from hvd_trainer_launch.engines import ssh as engine_ssh
    command = ["A=1;export A;/opt/bin/prted", "--uri", '"x@0;tcp://10.0.0.1:5"']
    # The daemon replaces the shell; the quoted ';' in a later word stays as it was.
    assert shlex.split(engine_ssh.proxy_line(command, "/bin/sh")) == \
        ["/bin/sh", "-c", 'A=1;export A;exec /opt/bin/prted --uri "x@0;tcp://10.0.0.1:5"']
    assert shlex.split(engine_ssh.proxy_line(["/opt/bin/prted", "-v"], "/bin/sh"))[2] == \
        "exec /opt/bin/prted -v"


def test_agent_names_are_distinct_and_dotless():
    assert engine_launch.agent_names(["h1.example.org", "h_2", "h1"]) == \
        ["hvd-agent0-h1", "hvd-agent1-h-2", "hvd-agent2-h1"]


def test_proxy_line_exchange_is_signed_both_ways():
    secret = os.urandom(32)
    for sender_secret, taken in ((secret, True), (os.urandom(32), False)):
        agent, launch = socket.socketpair()
        got = {}

        def serve():
            try:
                got["line"] = protocol.receive_proxy_line(launch, secret)
            except ValueError as error:
                got["error"] = error
            launch.close()
        server = threading.Thread(target=serve)
        server.start()
        if taken:
            protocol.send_proxy_line(agent, sender_secret, "hvd-agent0-h1", "sh -c 'exec d'")
        else:  # the launch refuses a line it cannot verify, and the agent hears no receipt
            with pytest.raises(ConnectionError):
                protocol.send_proxy_line(agent, sender_secret, "hvd-agent0-h1", "evil")
        server.join()
        agent.close()
        if taken:
            assert got["line"] == protocol.ProxyLine("hvd-agent0-h1", "sh -c 'exec d'")
        else:
            assert "not signed" in str(got["error"])
