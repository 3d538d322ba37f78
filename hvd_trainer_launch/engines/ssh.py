"""What Open MPI's mpirun runs in place of ssh in an engine job (hvd_trainer.spark,
hvd_trainer.ray): ``python -m hvd_trainer_launch.engines.ssh SOCKET HOST COMMAND...``.

Open MPI has no manual launcher, but it calls a launcher agent of our choosing
(``--mca plm_rsh_agent``) with the host and the command line that starts its daemon there, as
it would call ssh. This agent does not run the command: it hands it to the engine launch that
started mpirun (hvd_trainer_launch.engines.launch, over the Unix socket in that launch's
private folder, signed with the launch's secret), which gives it to the engine's agent on that
host (a Ray actor, a Spark barrier task), and exits once the launch has taken it. The command
is wrapped as ssh's remote side would run it: by the shell whose syntax mpirun wrote it in,
its last command (the daemon) run by ``exec``, so that the daemon is the process the agent
starts and dies with it. Standard library only, as it starts once per host and job.
"""
import os
import shlex
import socket
import sys
from typing import List, Optional

from hvd_trainer_launch import protocol

# What ssh exits with when it cannot reach the host: mpirun then reports the daemon's failure.
_FAILED = 255
# The shells whose syntax (setenv) differs from sh's; mpirun writes the command for the shell
# it finds in $SHELL (or the user's login shell) when it assumes the same shell everywhere.
_CSH_SHELLS = ("csh", "tcsh")


def proxy_line(command: List[str], shell: Optional[str] = None) -> str:
    """The command line an agent runs for ``command`` (ssh's remote command, word by word):
    ``SHELL -c TEXT``, TEXT being the words joined as ssh joins them, with ``exec`` before
    the daemon. mpirun's first word sets its variables and names the daemon after the last
    ``;`` (its later words, the daemon's arguments, may hold quoted ``;``)."""
    head, separator, daemon = command[0].rpartition(";")
    text = " ".join([f"{head}{separator}exec {daemon.lstrip()}", *command[1:]])
    return shlex.join([shell or _shell(), "-c", text])


def _shell() -> str:
    """The shell whose syntax mpirun used: csh or tcsh when that is the user's, else sh."""
    name = os.environ.get("SHELL") or _login_shell()
    return name if os.path.basename(name) in _CSH_SHELLS else "/bin/sh"


def _login_shell() -> str:
    import pwd
    try:
        return pwd.getpwuid(os.getuid()).pw_shell
    except KeyError:
        return ""


def main(argv: Optional[List[str]] = None) -> int:
    """Hand HOST's command to the launch at SOCKET; 0 once it has taken it, else 255 (as ssh
    when it cannot connect), with the reason on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        print("hvd_trainer_launch.engines.ssh: usage: python -m hvd_trainer_launch.engines.ssh SOCKET HOST COMMAND...", file=sys.stderr)
        return _FAILED
    path, host, command = argv[0], argv[1], argv[2:]
    secret = os.environ.get(protocol.ENGINE_LAUNCH_SECRET_VARIABLE, "")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(protocol.REPORT_SECONDS)
            conn.connect(path)
            protocol.send_proxy_line(conn, bytes.fromhex(secret), host, proxy_line(command))
    except (OSError, ValueError) as error:
        print(f"hvd_trainer_launch.engines.ssh: could not hand the command for {host} to the engine launch at "
              f"{path}: {error}", file=sys.stderr)
        return _FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
