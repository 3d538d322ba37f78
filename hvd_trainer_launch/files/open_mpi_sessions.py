"""Open MPI's session folders that its killed launchers left, removed before the next launch.

Open MPI 5's launcher (prterun) and its daemons (prted) keep their PMIx sockets in
``<temporary folder>/ompi.<pid>`` and ``prted.<pid>`` and remove them as they end, which
SIGKILL skips (an elastic job's end or an engine's may kill them so). On a host whose PIDs wrap
soon (``pid_max`` is 32768 on many), a later launcher that gets the same PID finds the old
sockets and stops at once with "The PMIx server's listener thread failed to start"
(reproduced by hand on 2026-12-07). A folder goes only if this user owns it, it is no link,
no process in sight has its PID, and none of its sockets takes a connection: its launcher may
live in a PID namespace we cannot see into (a container sharing the temporary folder).
Standard library only.
"""
import os
import re
import shutil
import socket
import stat
import tempfile
from typing import List, Optional

from hvd_trainer_launch.processes import started_at

__all__ = ["sweep"]

_NAME = re.compile(r"(?:ompi|prted)\.(\d+)")


def _answers(folder: str) -> bool:
    """Whether a Unix socket directly in ``folder`` takes a connection (its server runs)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return False
    for entry in entries:
        try:
            if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(entry.path)
            except OSError:  # refused: nobody listens (or a path too long to reach)
                continue
        return True
    return False


def sweep(folder: Optional[str] = None) -> List[str]:
    """Remove the session folders of ended Open MPI launchers and daemons in ``folder`` (None:
    the temporary folder, where Open MPI keeps them too); return their paths."""
    folder = folder or tempfile.gettempdir()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    removed = []
    for entry in entries:
        found = _NAME.fullmatch(entry.name)
        if found is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:  # removed meanwhile (by another sweep)
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        if started_at(int(found.group(1))) is not None or _answers(entry.path):
            continue  # its launcher runs, or another process has the PID: a later sweep's
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
