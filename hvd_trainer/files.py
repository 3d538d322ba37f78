"""Safe files and the per-job secret: the one place where the package and hvdrun write files,
sign what they read back, and authenticate the elastic notice port.

A planted symlink or a file that another user prepared must never be written through, read
as ours, or unpickled. So whole files are written to a new temporary file in the target's
folder (``mkstemp``: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) and renamed over the target;
outputs written as they go (logs, traces, copies of a rank's output) are opened the same way,
or appended to only when the file is our own regular file; folders that hold the job's state
are 0700 and refused when another user owns them or may write into them. Bytes that the job
reads back from disk or a port are signed with the job's secret (HMAC-SHA256), which hvdrun
generates and hands to the ranks in ``HVD_JOB_SECRET``, and verified before they are unpickled;
both ends of hvdrun's notice port prove that they hold it (:func:`notice_reply`).

Standard library only: hvdrun imports it without the rest of the package's dependencies.
"""
import glob
import hashlib
import hmac
import logging
import os
import socket
import stat
import tempfile
from typing import Any, BinaryIO, Callable, NamedTuple, Optional, Sequence, Tuple, Union

from hvd_trainer_launch.protocol import SECRET_VARIABLE, receive

log = logging.getLogger("hvd_trainer")

_SIGNED = b"hvd_trainer signed 1\n"
_MAC_BYTES = hashlib.sha256().digest_size
_NONCE_BYTES = 16


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` as the whole of ``path`` (mode 0600): a new temporary file next to it,
    synced, then renamed over it, so ``path`` is always the old file or the new one and a
    symlink planted at either name is never followed. Concurrent writers each use their own
    temporary file."""
    _write_new(path, lambda fd: _write_all(fd, data), sync=True)


def write_signed(path: str, secret: bytes, parts: Sequence[Any], sync: bool = True,
                 tag: str = "") -> None:
    """Write what ``sign(secret, b"".join(parts))`` returns as the whole of ``path``, as
    :func:`write_atomically` does (``sync``: fsync before the rename), without joining the
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


MEMORY_ROOT = "/dev/shm"  # a tmpfs on Linux: its files live in memory


def memory_root() -> Optional[str]:
    """:data:`MEMORY_ROOT` when this user may make folders there, else None (no such
    folder, as on macOS, or a read-only one)."""
    usable = os.path.isdir(MEMORY_ROOT) and os.access(MEMORY_ROOT, os.W_OK | os.X_OK)
    return MEMORY_ROOT if usable else None


def job_folders(folder: str, on_disk: Optional[str] = None) -> Tuple[str, ...]:
    """The folders that may hold the elastic commits of a job whose folder (hvdrun's
    ``HVD_ELASTIC_DIR``) is ``folder``: ``folder`` itself and, when it is in memory (under
    :data:`MEMORY_ROOT`), ``on_disk`` (``HVD_ELASTIC_DISK_DIR``) for commits that do not fit
    in memory. hvdrun names the two at random, each on its own, so that the name in memory,
    which every user can list, does not give away the one on disk."""
    if os.path.dirname(os.path.abspath(folder)) != MEMORY_ROOT or not on_disk:
        return (folder,)
    return folder, on_disk


def job_secret() -> Optional[bytes]:
    """The job's secret from ``HVD_JOB_SECRET`` (set by hvdrun), or None outside hvdrun."""
    value = os.environ.get(SECRET_VARIABLE)
    return value.encode() if value else None


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``secret``; each part's length is bound in, so parts
    cannot be shifted from one into the next."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(memoryview(part).nbytes.to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def sign(secret: bytes, data: bytes) -> bytes:
    """``data`` with a header and its MAC under ``secret`` in front."""
    return _SIGNED + mac(secret, data) + data


def verify(secret: bytes, signed: Any, what: str) -> memoryview:
    """The data of what :func:`sign` returned (bytes or any buffer; a view of it, without a
    copy); ValueError naming ``what`` when it is not whole or was not signed with ``secret``
    (truncated, altered, another job's, or no signature at all)."""
    signed = memoryview(signed).cast("B")
    start = len(_SIGNED) + _MAC_BYTES
    if signed[:len(_SIGNED)] != _SIGNED or signed.nbytes < start:
        raise ValueError(f"{what} is not signed (truncated, or not written by this job)")
    if not hmac.compare_digest(signed[len(_SIGNED):start], mac(secret, signed[start:])):
        raise ValueError(f"{what} does not match its signature (truncated, altered, or "
                         "signed by another job)")
    return signed[start:]


def notice_challenge() -> bytes:
    """hvdrun's first message of a notice exchange: a fresh random challenge."""
    return os.urandom(_NONCE_BYTES)


# What a rank sends back: its own challenge, the newest commit it has written, the MAC.
NOTICE_QUESTION_BYTES = _NONCE_BYTES + 8 + _MAC_BYTES


class NoticeReply(NamedTuple):
    """hvdrun's answer to a proved question (:func:`notice_reply`)."""
    data: bytes  # what to send back
    written: int  # the newest commit that rank 0 had written when it asked


def notice_reply(secret: bytes, challenge: bytes, question: bytes,
                 number: int) -> Optional[NoticeReply]:
    """hvdrun's side of the notice exchange, without the socket: given the ``challenge`` it
    sent and the rank's ``question`` (NOTICE_QUESTION_BYTES), the reply that tells ``number``
    (the hosts' generation), bound to both challenges so that it cannot be replayed or forged;
    None when the question does not prove that its sender holds ``secret``."""
    theirs = question[:_NONCE_BYTES]
    written = question[_NONCE_BYTES:_NONCE_BYTES + 8]
    if not hmac.compare_digest(question[_NONCE_BYTES + 8:],
                               mac(secret, b"ask", challenge, theirs, written)):
        return None
    told = number.to_bytes(8, "big")
    return NoticeReply(told + mac(secret, b"tell", challenge, theirs, told),
                       int.from_bytes(written, "big"))


def answer_notice(conn: socket.socket, secret: bytes, number: int,
                  deadline: Optional[float] = None) -> Optional[int]:
    """:func:`notice_reply` over a blocking ``conn``, the whole exchange by ``deadline``:
    the newest commit the rank reported, or None when it did not prove that it holds
    ``secret`` (then it is told nothing)."""
    mine = notice_challenge()
    conn.sendall(mine)
    reply = notice_reply(secret, mine, receive(conn, NOTICE_QUESTION_BYTES, deadline), number)
    if reply is None:
        return None
    conn.sendall(reply.data)
    return reply.written


def ask_notice(conn: socket.socket, secret: bytes, written: int = 0,
               deadline: Optional[float] = None) -> int:
    """A rank's side of :func:`notice_reply`, telling hvdrun the newest commit this rank has
    ``written`` (so that a restart that finds none knows that commits were lost), the whole
    exchange by ``deadline`` (time.monotonic()): the number hvdrun told; ValueError when the
    reply does not prove that it comes from the holder of ``secret``."""
    theirs = receive(conn, _NONCE_BYTES, deadline)
    mine = os.urandom(_NONCE_BYTES)
    reported = written.to_bytes(8, "big")
    conn.sendall(mine + reported + mac(secret, b"ask", theirs, mine, reported))
    told = receive(conn, 8, deadline)
    if not hmac.compare_digest(receive(conn, _MAC_BYTES, deadline),
                               mac(secret, b"tell", theirs, mine, told)):
        raise ValueError("the reply is not signed with this job's secret")
    return int.from_bytes(told, "big")


class Output:
    """A file written as the job goes (a log, a trace, a copy of a rank's output) that can
    never end the job: a failure to open or write it (folder missing, disk full) warns once,
    naming the file, and stops that output; writes after it do nothing.

    A new output replaces ``path`` with a fresh 0600 file (made like :func:`write_atomically`'s
    temporary file, then renamed into place). With ``append``, ``path`` is opened without
    following a symlink, created 0600 when missing, and used only when it is a regular file
    of this process's user. ``warn`` receives the one message (the 'hvd_trainer' logger's
    warning by default).
    """

    def __init__(self, path: str, append: bool = False, what: str = "output",
                 warn: Optional[Callable[[str], None]] = None):
        self.path, self.what = path, what
        self._warn = warn or log.warning
        self._file: Optional[BinaryIO] = None
        self.was_empty = False  # whether the file held nothing when it was opened
        try:
            fd = self._open_append() if append else self._open_new()
            self._file = os.fdopen(fd, "wb")
            self.was_empty = os.fstat(fd).st_size == 0
        except OSError as error:
            self._stop(error)

    @property
    def active(self) -> bool:
        """Whether the output is still written (it opened and no write has failed)."""
        return self._file is not None

    def _open_new(self) -> int:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(self.path)))
        try:
            os.replace(tmp, self.path)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def _open_append(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise PermissionError(f"it is not a regular file of this job's user (id {os.geteuid()})")
        return fd

    def write(self, data: Union[bytes, str]) -> None:
        """Write ``data`` (text as UTF-8); buffered until :meth:`flush`."""
        if self._file is None:
            return
        try:
            self._file.write(data.encode() if isinstance(data, str) else data)
        except OSError as error:
            self._stop(error)

    def flush(self) -> None:
        """Hand what was written to the operating system."""
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as error:
            self._stop(error)

    def close(self) -> None:
        """Flush and close; the output stops."""
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError as error:
            self._stop(error)
        self._file = None

    def _stop(self, error: OSError) -> None:
        """Warn once, naming the file and the error, and drop the file without raising."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # the buffer that failed to write fails again; it is dropped
                pass
            self._file = None
        self._warn(f"cannot write the {self.what} {self.path!r} ({error}); this output stops "
                   "here and the job goes on")
