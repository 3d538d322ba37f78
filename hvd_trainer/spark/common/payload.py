"""Bytes that the estimators write and unpickle later (checkpoints in the store, models and
parameters of a saved Spark ML writable) carry a SHA-256 digest, verified before they are
unpickled: a truncated or altered file is refused with its name, never half-loaded.

A digest guards against damage, not against someone who can write the store: loading a saved
model trusts its folder as ``torch.load`` or ``pickle.load`` would (docs/security.md).
"""
import base64
import hashlib

__all__ = ["pack", "unpack", "to_text", "from_text"]

_MAGIC = b"hvd_trainer payload 1\n"
_DIGEST = hashlib.sha256().digest_size


def pack(data: bytes) -> bytes:
    """``data`` with its header and digest."""
    return _MAGIC + hashlib.sha256(data).digest() + data


def unpack(blob: bytes, what: str) -> bytes:
    """The data of a pack()ed ``blob``; ValueError naming ``what`` when it is not one or its
    digest does not match."""
    head = len(_MAGIC) + _DIGEST
    if not blob.startswith(_MAGIC) or len(blob) < head:
        raise ValueError(f"{what} is not a file that hvd_trainer wrote (no header): refusing "
                         "to load it")
    data = blob[head:]
    if hashlib.sha256(data).digest() != blob[len(_MAGIC):head]:
        raise ValueError(f"{what} does not match its digest (truncated or altered): refusing "
                         "to load it")
    return data


def to_text(data: bytes) -> str:
    """pack()ed ``data`` as ASCII, for a JSON field."""
    return base64.b64encode(pack(data)).decode("ascii")


def from_text(text: str, what: str) -> bytes:
    """The data of to_text()."""
    return unpack(base64.b64decode(text.encode("ascii")), what)
