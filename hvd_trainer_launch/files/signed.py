"""Signed files: the one format in which the job's processes hand each other bytes that will
be unpickled, and the owner-only files that carry them between a launching process and its
ranks (hvd_trainer.run's folder, an engine agent's on its host).

The format: a header line, an HMAC-SHA256 under the job's (or call's) secret over a label and
the data (protocol.mac: each part's length bound in), then the data. The label is the file's
name for the call files here, so that no file can stand in for another (rank 1's result for
rank 2's); hvd_trainer.runtime.files writes elastic commits in the same format, atomically,
with an empty label. Nothing reads (or unpickles) the data before :func:`verify` has checked
it. The call files live in folders private to one host (files.owned_folders: mode 0700); each
is created with O_EXCL and O_NOFOLLOW, mode 0600, and read only when this user owns it and
nobody else may write it. Standard library only.
"""
import hashlib
import hmac
import os
import stat
from typing import Any, Sequence

from hvd_trainer_launch import protocol

HEADER = b"hvd_trainer signed 1\n"
MAC_BYTES = hashlib.sha256().digest_size
_PIECE = 1 << 20  # bytes hashed and written at a time: they stay in the cache in between


def write_all(fd: int, data: Any) -> None:
    """Write the buffer ``data`` whole to ``fd``."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


def fill(fd: int, secret: bytes, parts: Sequence[Any], label: bytes = b"") -> None:
    """Write the signed form of ``b"".join(parts)`` to the new file ``fd`` without joining the
    ``parts`` (buffers such as bytes or arrays, possibly large): each is hashed and written in
    pieces that stay in the processor's cache, and the MAC goes into its place at the end."""
    views = [memoryview(part).cast("B") for part in parts]
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    digest.update(len(label).to_bytes(8, "big") + label)
    digest.update(sum(view.nbytes for view in views).to_bytes(8, "big"))
    write_all(fd, HEADER + bytes(MAC_BYTES))
    for view in views:
        for start in range(0, view.nbytes, _PIECE):
            piece = view[start:start + _PIECE]
            digest.update(piece)
            write_all(fd, piece)
    os.pwrite(fd, digest.digest(), len(HEADER))


def verify(secret: bytes, signed: Any, what: str, label: bytes = b"") -> memoryview:
    """The data of a signed file's contents (bytes or any buffer; a view of it, without a
    copy); ValueError naming ``what`` when it is not whole or was not signed with ``secret``
    and ``label`` (truncated, altered, another job's or file's, or no signature at all)."""
    signed = memoryview(signed).cast("B")
    start = len(HEADER) + MAC_BYTES
    if signed[:len(HEADER)] != HEADER or signed.nbytes < start:
        raise ValueError(f"{what} is not signed (truncated, or not written by this job)")
    if not hmac.compare_digest(signed[len(HEADER):start],
                               protocol.mac(secret, label, signed[start:])):
        raise ValueError(f"{what} does not match its signature (truncated, altered, or "
                         "signed by another job)")
    return signed[start:]


def write_signed(path: str, secret: bytes, data: bytes) -> None:
    """Create ``path`` (never an existing file or link), owner-only, holding ``data`` signed
    under ``secret`` with the file's name as its label."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fill(fd, secret, [data], os.path.basename(path).encode())
    finally:
        os.close(fd)


def read_signed(path: str, secret: bytes) -> bytes:
    """The data of ``path`` once its owner, mode and signature (with the file's name as its
    label) check out; ValueError names what did not."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as source:
        info = os.fstat(source.fileno())
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(f"{path} is not an owner-only file of this user; refusing to read it")
        data = source.read()
    try:
        return bytes(verify(secret, data, "its content", os.path.basename(path).encode()))
    except ValueError as error:
        raise ValueError(f"{path} fails its signature check: it was not written whole by this "
                         f"job; refusing to read it ({error})") from None
