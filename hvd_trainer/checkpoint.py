"""The bytes of a checkpoint: a header, a format version and a digest before the pickle; and
optimizer states with the reducer's state (compression residuals) attached, as one value.

A checkpoint's digest is checked before anything in it is unpickled, so a file that is not a
checkpoint, or a truncated or altered one, is refused without running code from it. (The
digest is no signature: anyone who may write the file may write a valid one, so checkpoints
are as trusted as the folder they are kept in; docs/security.md.) Plain optimizer states
(what ``gluon.Trainer`` writes) pass through unchanged, so a file without residuals stays
readable by the framework itself.
"""
import hashlib
import pickle
from typing import Any, Tuple

_MAGIC = b"hvd_trainer residuals 1\n"
_HEADER = b"hvd_trainer checkpoint\n"
FORMAT_VERSION = 2  # 1 was a bare pickle


def pack(checkpoint: Any) -> bytes:
    """The file's bytes for ``checkpoint``: header, format version, SHA-256 of the pickle,
    the pickle."""
    body = pickle.dumps(checkpoint, pickle.HIGHEST_PROTOCOL)
    return _HEADER + b"%d\n" % FORMAT_VERSION + hashlib.sha256(body).digest() + body


def is_checkpoint(data: bytes) -> bool:
    """Whether ``data`` starts like a checkpoint that :func:`pack` wrote (before any check)."""
    return data.startswith(_HEADER)


def unpack(data: bytes, fname: str) -> Any:
    """What :func:`pack` packed, once the header, the version and the digest are right;
    ValueError naming ``fname`` and what is wrong otherwise, before anything is unpickled."""
    if not is_checkpoint(data):
        raise ValueError(f"{fname!r} is not a DistributedTrainer checkpoint (it has no "
                         "checkpoint header); write one with trainer.save_checkpoint()")
    version, newline, rest = data[len(_HEADER):].partition(b"\n")
    if not newline or version != b"%d" % FORMAT_VERSION:
        raise ValueError(f"{fname!r} is a checkpoint of format {version[:20]!r}, this "
                         f"hvd_trainer reads format {FORMAT_VERSION}; write it again with "
                         "this version's trainer.save_checkpoint()")
    digest, body = rest[:hashlib.sha256().digest_size], rest[hashlib.sha256().digest_size:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError(f"{fname!r} is damaged: its digest does not match its contents "
                         "(truncated or altered); load an intact copy")
    return pickle.loads(body)


def attach_residuals(states: bytes, residuals: Any) -> bytes:
    """Optimizer states with the residuals (any picklable value: every rank's, with the
    settings they belong to) appended; ``states`` alone when None."""
    if residuals is None:
        return states
    return _MAGIC + pickle.dumps((states, residuals), pickle.HIGHEST_PROTOCOL)


def detach_residuals(data: bytes) -> Tuple[bytes, Any]:
    """Split what :func:`attach_residuals` wrote; plain optimizer states have no residuals."""
    if not data.startswith(_MAGIC):
        return data, None
    return pickle.loads(data[len(_MAGIC):])
