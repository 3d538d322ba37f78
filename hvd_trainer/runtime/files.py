"""Safe files: the one place where the package writes whole files and signs what it reads
back.

A planted symlink or a file that another user prepared must never be written through, read
as ours, or unpickled. So whole files are written to a new temporary file in the target's
folder (``mkstemp``: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) and renamed over the target;
outputs written as they go (logs, traces, copies of a rank's output:
:class:`hvd_trainer_launch.files.outputs.Output`, which hvdrun shares) are opened the same way, or
appended to only when the file is our own regular file; folders that hold the job's state
are 0700 and refused when another user owns them or may write into them. Bytes that the job
reads back from disk or a port are signed with the job's secret (HMAC-SHA256), which hvdrun
generates and hands to the ranks in ``HVD_JOB_SECRET`` (:mod:`hvd_trainer_launch.protocol`),
and verified before they are unpickled; the signed format is the launcher's
(:mod:`hvd_trainer_launch.files.signed`), one for every signed file of the job.

Standard library only.
"""
import glob
import os
import stat
import tempfile
from typing import Any, Callable, Sequence

from hvd_trainer_launch.files import signed


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` as the whole of ``path`` (mode 0600): a new temporary file next to it,
    synced, then renamed over it, so ``path`` is always the old file or the new one and a
    symlink planted at either name is never followed. Concurrent writers each use their own
    temporary file."""
    _write_new(path, lambda fd: signed.write_all(fd, data), sync=True)


def write_signed(path: str, secret: bytes, parts: Sequence[Any], sync: bool = True,
                 tag: str = "") -> None:
    """Write ``b"".join(parts)`` signed with ``secret`` (files.signed's format, no label) as the
    whole of ``path``, as :func:`write_atomically` does (``sync``: fsync before the rename),
    without joining the ``parts`` (buffers such as bytes or arrays, possibly large).
    The temporary file's name holds ``tag`` (``.NAME.TAG.RANDOM.tmp``), so that its writer's
    leftovers can be told from others' (:func:`remove_temporaries`)."""
    _write_new(path, lambda fd: signed.fill(fd, secret, parts), sync, f"{tag}." if tag else "")


def remove_temporaries(folder: str, name: str, keep_tag: str) -> None:
    """Remove the temporary files that :func:`write_signed` left in ``folder`` (a writer
    killed before its rename) for targets matching the glob ``name``, unless their tag is
    ``keep_tag`` (files of writers that may still be running)."""
    for path in glob.glob(os.path.join(glob.escape(folder), f".{name}.*.*.tmp")):
        tag = os.path.basename(path).rsplit(".", 3)[1]
        if tag != keep_tag:
            try:
                os.unlink(path)
            except FileNotFoundError:  # another rank of this host removed it first
                pass


def _write_new(path: str, fill: Callable[[int], None], sync: bool, tag: str = "") -> None:
    """A new temporary file next to ``path`` (mkstemp: O_EXCL, O_NOFOLLOW, 0600), filled by
    ``fill(fd)``, synced when ``sync``, renamed over ``path``; removed if anything fails."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{tag}", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            fill(f.fileno())
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def private_folder(path: str) -> str:
    """Create ``path`` (mode 0700) unless it exists; return it. PermissionError when it is
    not a folder of this process's user that only that user may write into: another user
    could have put files there for the job to read."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    fix = "remove it, or give the job another folder"
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path!r} is not a folder (a symlink or a file); {fix}")
    if info.st_uid != os.geteuid():
        raise PermissionError(f"folder {path!r} belongs to user id {info.st_uid}, not to this "
                              f"job's user (id {os.geteuid()}); {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"folder {path!r} may be written by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):o}); {fix}")
    if info.st_mode & 0o077:  # ours, but readable by others (as older versions made it)
        os.chmod(path, 0o700)
    return path
