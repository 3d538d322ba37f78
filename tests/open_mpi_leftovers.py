"""Open MPI's session folders that its killed launchers left, removed before each test.

prterun and prted keep their PMIx sockets in ``$TMPDIR/ompi.<pid>`` and ``prted.<pid>``; one
ended by SIGKILL (the tests kill launchers on purpose) leaves its folder, and on a host whose
PIDs wrap soon (``pid_max`` 32768 here) a later launcher that gets the same PID finds the old
sockets and stops with "The PMIx server's listener thread failed to start" (reproduced by hand
on 2026-12-07 with a socket left at its PID's path; two CI runs failed on it). A folder is
removed only if this user owns it, it is no link, and no process has its PID.
"""
import os
import re
import shutil
import tempfile
from typing import List

_NAME = re.compile(r"(?:ompi|prted)\.(\d+)")


def sweep(folder: str = "") -> List[str]:
    """Remove the session folders of ended Open MPI launchers in ``folder`` (the temporary
    folder); return their paths."""
    folder = folder or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(folder):
        found = _NAME.fullmatch(entry.name)
        if not found or entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
            continue
        if os.path.exists(f"/proc/{found.group(1)}"):
            continue  # its launcher runs, or another process has the PID: the next sweep
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
