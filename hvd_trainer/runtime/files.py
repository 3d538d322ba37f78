"""Safe files: the one place where the package writes whole files and signs what it reads
back.

A planted symlink or a file that another user prepared must never be written through, read
as ours, or unpickled. So whole files are written to a new temporary file in the target's
folder (``mkstemp``: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) and renamed over the target;
outputs written as they go (logs, traces, copies of a rank's output:
:class:`hvd_trainer_launch.outputs.Output`, which hvdrun shares) are opened the same way, or
appended to only when the file is our own regular file; folders that hold the job's state
are 0700 and refused when another user owns them or may write into them. Bytes that the job
reads back from disk or a port are signed with the job's secret (HMAC-SHA256), which hvdrun
generates and hands to the ranks in ``HVD_JOB_SECRET`` (:mod:`hvd_trainer_launch.protocol`),
and verified before they are unpickled.

Standard library only.
"""
import glob
import hashlib
import hmac
import os
import stat
import tempfile
from typing import Any, Callable, Sequence

from hvd_trainer_launch.protocol import mac

_SIGNED = b"hvd_trainer signed 1\n"
_MAC_BYTES = hashlib.sha256().digest_size


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` as the whole of ``path`` (mode 0600): a new temporary file next to it,
    synced, then renamed over it, so ``path`` is always the old file or the new one and a
    symlink planted at either name is never followed. Concurrent writers each use their own
    temporary file."""
    _write_new(path, lambda fd: _write_all(fd, data), sync=True)


def write_signed(path: str, secret: bytes, parts: Sequence[Any], sync: bool = True,
                 tag: str = "") -> None:
    """Write ``b"".join(parts)`` signed with ``secret`` (a header, its MAC under ``secret``,
    the data) as the whole of ``path``, as :func:`write_atomically` does (``sync``: fsync before the rename), without joining the
    ``parts`` (buffers such as bytes or arrays, possibly large): each is hashed and written in
    pieces that stay in the processor's cache, and the MAC goes into its place at the end.
    The temporary file's name holds ``tag`` (``.NAME.TAG.RANDOM.tmp``), so that its writer's
    leftovers can be told from others' (:func:`remove_temporaries`)."""
    views = [memoryview(part).cast("B") for part in parts]
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    digest.update(sum(view.nbytes for view in views).to_bytes(8, "big"))

    def fill(fd: int) -> None:
        _write_all(fd, _SIGNED + bytes(_MAC_BYTES))
        for view in views:
            for start in range(0, view.nbytes, _PIECE):
                piece = view[start:start + _PIECE]
                digest.update(piece)
                _write_all(fd, piece)
        os.pwrite(fd, digest.digest(), len(_SIGNED))

    _write_new(path, fill, sync, f"{tag}." if tag else "")


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


_PIECE = 1 << 20  # bytes hashed and written at a time: they stay in the cache in between


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


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


def verify(secret: bytes, signed: Any, what: str) -> memoryview:
    """The data of a signed file's contents, as :func:`write_signed` wrote them (bytes or any
    buffer; a view of it, without a copy); ValueError naming ``what`` when it is not whole or was not signed with ``secret``
    (truncated, altered, another job's, or no signature at all)."""
    signed = memoryview(signed).cast("B")
    start = len(_SIGNED) + _MAC_BYTES
    if signed[:len(_SIGNED)] != _SIGNED or signed.nbytes < start:
        raise ValueError(f"{what} is not signed (truncated, or not written by this job)")
    if not hmac.compare_digest(signed[len(_SIGNED):start], mac(secret, signed[start:])):
        raise ValueError(f"{what} does not match its signature (truncated, altered, or "
                         "signed by another job)")
    return signed[start:]
