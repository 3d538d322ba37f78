"""After a launch failed before its ranks started, hvdrun names the hosts ssh could not reach
and why (ssh's own message can be lost when mpiexec ends first):
hvd_trainer_launch/job/unreached.py, against a name under .invalid and a port of this machine
that is listened on or not."""
import os
import socket
import stat

import pytest

from hvd_trainer_launch.job import unreached

# RFC 6761: names under .invalid never resolve.
NOWHERE = "nosuchhost.invalid"


def fake_ssh(folder, hostname: str, port: int = 22) -> str:
    """A PATH folder whose `ssh -G` says ``hostname`` and ``port`` for every host, as an
    alias in ~/.ssh/config would."""
    path = os.path.join(folder, "ssh")
    with open(path, "w") as script:
        script.write(f"#!/bin/sh\necho 'user root'\necho 'hostname {hostname}'\n"
                     f"echo 'port {port}'\n")
    os.chmod(path, stat.S_IRWXU)
    return str(folder)


@pytest.fixture
def listening():
    """A port on 127.0.0.2 that takes connections, and one that refuses them."""
    server = socket.create_server(("127.0.0.2", 0))
    closed = socket.create_server(("127.0.0.2", 0))
    refused = closed.getsockname()[1]
    closed.close()
    yield server.getsockname()[1], refused
    server.close()


def test_a_name_that_does_not_resolve_is_named_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, NOWHERE))
    found = unreached.unreached([NOWHERE])
    assert list(found) == [NOWHERE]
    assert found[NOWHERE].startswith("does not resolve on this machine (")
    assert "add it to /etc/hosts or ~/.ssh/config" in found[NOWHERE]


def test_this_machines_names_and_addresses_are_not_looked_up(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, NOWHERE))  # would fail if asked
    assert unreached.unreached(["localhost", "127.0.0.1"]) == {}


def test_an_alias_is_reached_through_its_hostname_and_port(monkeypatch, tmp_path, listening):
    open_port, refused = listening
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, "127.0.0.2", open_port))
    assert unreached.ssh_target("gpu-box") == unreached.SshTarget("127.0.0.2", open_port)
    assert unreached.unreached(["gpu-box"]) == {}
    found = unreached.unreached(["gpu-box"], port=refused)  # -p wins over the configuration
    assert found["gpu-box"].startswith(f"takes no connection on its ssh port {refused} (")
    assert "start its sshd, or give its port with -p" in found["gpu-box"]


def test_without_ssh_the_name_itself_and_port_22_are_tried(monkeypatch, tmp_path, listening):
    open_port, _ = listening
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh here
    assert unreached.ssh_target("gpu-box") == unreached.SshTarget("gpu-box", 22)
    assert list(unreached.unreached([NOWHERE, "127.0.0.2"], port=open_port)) == [NOWHERE]


def test_only_jobs_that_ssh_launches_are_looked_into():
    from argparse import Namespace
    from hvd_trainer_launch.job import watch
    args = Namespace(ssh_port=2222)
    assert watch.ssh_launch(args, {}, engine=False) == watch.SshLaunch(2222)
    assert watch.ssh_launch(args, {}, engine=True) is None  # an engine's agents start the ranks
    assert watch.ssh_launch(args, {"SLURM_JOB_ID": "7"}, engine=False) is None  # srun does


def test_hosts_are_named_when_ranks_that_did_start_failed_too(monkeypatch, tmp_path, listening,
                                                              capsys):
    # mpiexec ends the ranks it started once it cannot reach a host; their exits come first.
    import time
    from hvd_trainer_launch.job import relay as output, watch
    from hvd_trainer_launch.protocol import Exited, Started
    _, refused = listening
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, "127.0.0.2"))
    relay = output.OutputRelay(2, False, None, [("localhost", 1), ("gpu-box", 1)])
    for report in (Started(0, "localhost"), Exited(0, 143, time.time(), killed=True)):
        relay.deliver(report)
    assert watch._exit_code("mpiexec", 255, relay, 2, False, watch.SshLaunch(refused)) == 143
    err = capsys.readouterr().err
    assert f"host gpu-box takes no connection on its ssh port {refused} (" in err
    assert "host localhost" not in err
