"""Why hosts were not reached, looked up after a launch failed before their ranks started: a
name that does not resolve, or nothing accepting ssh connections on the host's port.

ssh says so itself, but mpiexec may end before ssh's message reaches hvdrun's output, so
hvdrun says it in a line of its own. The lookup follows ssh: a ``Host`` alias in
~/.ssh/config is resolved through its ``HostName``, and its ``Port`` is the one tried unless
``-p`` gave another.
"""
import shutil
import socket
import subprocess
from typing import Dict, NamedTuple, Optional, Sequence

from hvd_trainer_launch import mpi

__all__ = ["SshTarget", "ssh_target", "unreached"]

# `ssh -G` only reads configuration; it never connects.
SSH_CONFIG_SECONDS = 5.0
# How long a connection to a host's ssh port may take before it counts as not answered.
CONNECT_SECONDS = 3.0


class SshTarget(NamedTuple):
    """Where ssh connects for a host name: the name it resolves and the port."""

    hostname: str
    port: int


def ssh_target(host: str, port: Optional[int] = None) -> SshTarget:
    """Where ssh connects for ``host``: its configuration's ``HostName`` and ``Port`` (``port``,
    from -p, wins); ``host`` and 22 where ssh is absent or says nothing."""
    found = {"hostname": host, "port": "22"}
    ssh = shutil.which("ssh")
    if ssh is not None:
        try:
            shown = subprocess.run([ssh, "-G", host], capture_output=True, text=True,
                                   timeout=SSH_CONFIG_SECONDS, stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.TimeoutExpired):
            shown = ""
        for line in shown.splitlines():
            key, _, value = line.partition(" ")
            if key in found and value:
                found[key] = value
    return SshTarget(found["hostname"], port if port is not None else int(found["port"]))


def unreached(hosts: Sequence[str], port: Optional[int] = None) -> Dict[str, str]:
    """Of ``hosts`` (names from -H, a hostfile or discovery), those that this machine cannot
    resolve or whose ssh port (``port``: -p's) takes no connection, each with what is wrong
    and the fix. This machine's own names are never looked up."""
    found: Dict[str, str] = {}
    for host in hosts:
        if mpi.this_machine(host):
            continue
        target = ssh_target(host, port)
        try:
            socket.getaddrinfo(target.hostname, target.port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            found[host] = (f"does not resolve on this machine ({error.strerror or error}): "
                           "correct its name in -H, the hostfile or the discovery script, or "
                           "add it to /etc/hosts or ~/.ssh/config")
            continue
        try:
            socket.create_connection((target.hostname, target.port), CONNECT_SECONDS).close()
        except OSError as error:
            found[host] = (f"takes no connection on its ssh port {target.port} "
                           f"({error.strerror or error}): start its sshd, or give its port "
                           "with -p (or Port in ~/.ssh/config)")
    return found
