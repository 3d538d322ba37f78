"""hvdrun names the hosts that do not resolve after a launch failed before its ranks started
(ssh's own message can be lost when mpiexec ends first): hvd_trainer_launch/job/host_names.py."""
import os
import stat

from hvd_trainer_launch.job import host_names

# RFC 6761: names under .invalid never resolve.
NOWHERE = "nosuchhost.invalid"


def fake_ssh(folder, hostname: str) -> str:
    """A PATH folder whose `ssh -G` says ``hostname`` for every host, as an alias would."""
    path = os.path.join(folder, "ssh")
    with open(path, "w") as script:
        script.write(f"#!/bin/sh\necho 'user root'\necho 'hostname {hostname}'\necho 'port 22'\n")
    os.chmod(path, stat.S_IRWXU)
    return str(folder)


def test_a_name_that_does_not_resolve_is_found_with_the_resolvers_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, NOWHERE))
    found = host_names.unresolved([NOWHERE])
    assert list(found) == [NOWHERE]
    assert found[NOWHERE]


def test_this_machines_names_and_addresses_are_not_looked_up(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, NOWHERE))  # would fail if asked
    assert host_names.unresolved(["localhost", "127.0.0.1"]) == {}


def test_an_ssh_alias_is_resolved_through_its_hostname(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", fake_ssh(tmp_path, "127.0.0.1"))
    assert host_names.ssh_hostname("gpu-box") == "127.0.0.1"
    assert host_names.unresolved(["gpu-box"]) == {}


def test_without_ssh_the_name_itself_is_looked_up(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh here
    assert host_names.ssh_hostname("gpu-box") == "gpu-box"
    assert list(host_names.unresolved([NOWHERE, "127.0.0.2"])) == [NOWHERE]
