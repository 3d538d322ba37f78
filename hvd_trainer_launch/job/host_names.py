"""Host names that do not resolve, looked up after a launch failed before its ranks started.

ssh says so itself ("Could not resolve hostname"), but mpiexec may end before ssh's message
reaches hvdrun's output, so hvdrun names such hosts in a line of its own. The lookup follows
ssh: a ``Host`` alias in ~/.ssh/config is resolved through its ``HostName``.
"""
import shutil
import socket
import subprocess
from typing import Dict, Sequence

from hvd_trainer_launch import mpi

__all__ = ["unresolved"]

# `ssh -G` only reads configuration; it never connects.
SSH_CONFIG_SECONDS = 5.0


def ssh_hostname(host: str) -> str:
    """The name ssh connects to for ``host`` (its ``HostName`` in ssh's configuration), or
    ``host`` itself where ssh is absent or says nothing."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return host
    try:
        shown = subprocess.run([ssh, "-G", host], capture_output=True, text=True,
                               timeout=SSH_CONFIG_SECONDS, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in shown.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value
    return host


def unresolved(hosts: Sequence[str]) -> Dict[str, str]:
    """Of ``hosts`` (names from -H, a hostfile or discovery), those this machine cannot resolve,
    each with the resolver's reason. This machine's own names are never looked up."""
    found: Dict[str, str] = {}
    for host in hosts:
        if mpi.this_machine(host):
            continue
        name = ssh_hostname(host)
        try:
            socket.getaddrinfo(name, None)
        except socket.gaierror as error:
            found[host] = error.strerror or str(error)
    return found
