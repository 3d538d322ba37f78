"""Signed, owner-only files through which a launching process and its ranks pass a function
and its results: hvd_trainer.run's folder, and an engine agent's on its host
(hvd_trainer.spark, hvd_trainer.ray).

Each lives in a folder private to one host (``tempfile.mkdtemp``: mode 0700) that its user
makes and removes; across hosts an engine itself carries them (Ray's object store, Spark's
task results). Each file is created with O_EXCL and O_NOFOLLOW, mode 0600, and holds an
HMAC-SHA256 over its label and contents under the job's secret, checked before anything reads
(or unpickles) the contents, so that no file can stand in for another. Standard library only.
"""
import hashlib
import hmac
import os
import stat

from hvd_trainer_launch import protocol

_MAC_BYTES = hashlib.sha256().digest_size


def write_signed(folder: str, label: str, payload: bytes, secret: bytes) -> None:
    """Create ``folder/label`` (never an existing file or link), owner-only, holding the
    signature then ``payload``."""
    fd = os.open(os.path.join(folder, label),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(protocol.mac(secret, label.encode(), payload) + payload)


def read_signed(folder: str, label: str, secret: bytes) -> bytes:
    """The contents of ``folder/label`` once its owner, mode and signature check out;
    ValueError names what did not."""
    path = os.path.join(folder, label)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as source:
        info = os.fstat(source.fileno())
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(f"{path} is not an owner-only file of this user; refusing to read it")
        data = source.read()
    payload = data[_MAC_BYTES:]
    if len(data) < _MAC_BYTES or not hmac.compare_digest(
            data[:_MAC_BYTES], protocol.mac(secret, label.encode(), payload)):
        raise ValueError(f"{path} fails its signature check: it was not written whole by this "
                         "job; refusing to read it")
    return payload
