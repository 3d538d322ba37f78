"""Private temporary folders that name the process that made them, so that a later job on
the same host removes those whose maker died without removing them.

A folder's maker removes it in a ``finally``, which SIGKILL skips: an engine agent (a Ray
actor, a Spark task) killed with its job left its folder, holding the pickled function and
its arguments, for good. Each folder here is made by ``tempfile.mkdtemp`` (mode 0700) under a
name that carries its maker's PID namespace, PID and start time; :func:`sweep`, which the next
job with the same prefix calls, removes those of this user whose maker is no longer running,
and never one whose maker it cannot see (another PID namespace: a container sharing the
temporary folder) nor anything that is not a private folder of this user. Standard library
only.
"""
import os
import shutil
import stat
import tempfile
from typing import List, NamedTuple, Optional

from hvd_trainer_launch.processes import started_at


class Maker(NamedTuple):
    """The process a folder's name records."""

    namespace: int  # the inode of its PID namespace
    pid: int
    started: bytes  # processes.started_at


def _namespace() -> Optional[int]:
    """This process's PID namespace (the inode of /proc/self/ns/pid); None without /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _maker_of(name: str, prefix: str) -> Optional[Maker]:
    """The maker recorded in folder ``name`` (``prefix`` + ``NS-PID-START.`` + random), or
    None when the name is not of that form."""
    tag, dot, _ = name[len(prefix):].partition(".")
    fields = tag.split("-")
    if not dot or len(fields) != 3 or not all(field.isdigit() for field in fields):
        return None
    return Maker(int(fields[0]), int(fields[1]), fields[2].encode())


def make(prefix: str, root: Optional[str] = None) -> str:
    """A new private folder (mode 0700) in ``root`` (None: the temporary folder), named after
    ``prefix`` and this process; the caller removes it, or a later :func:`sweep` once this
    process is gone."""
    namespace, pid = _namespace(), os.getpid()
    start = started_at(pid)
    if namespace is None or start is None:  # no /proc: nothing could tell the maker's end
        return tempfile.mkdtemp(prefix=prefix, dir=root)
    return tempfile.mkdtemp(prefix=f"{prefix}{namespace}-{pid}-{start.decode()}.", dir=root)


def sweep(prefix: str, root: Optional[str] = None) -> List[str]:
    """Remove the folders that :func:`make` (``prefix``) left in ``root`` (None: the temporary
    folder) whose maker, a process of this PID namespace, has ended; return their paths."""
    namespace = _namespace()
    if namespace is None:
        return []
    root, removed = root or tempfile.gettempdir(), []
    try:
        entries = [name for name in os.listdir(root) if name.startswith(prefix)]
    except OSError:
        return []
    for name in entries:
        maker = _maker_of(name, prefix)
        if maker is None or maker.namespace != namespace or \
                started_at(maker.pid) == maker.started:
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:  # removed meanwhile (by another sweep)
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and \
                not stat.S_IMODE(info.st_mode) & 0o077:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
