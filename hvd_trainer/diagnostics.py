"""Agreement between ranks before a collective runs.

Every collective first exchanges an 8-byte digest of what each rank is about to do (kind,
names, dtypes, shapes, op, root, scale factors), in one small allreduce, or in an allgather
that also carries an integer the collective needs anyway (the first dimension for allgather). If the digests differ, the ranks exchange the full
descriptions and every rank raises the same :class:`MismatchError`, naming the tensor, the
field and each rank's value. So a disagreement never hangs and never reads past a buffer.
"""
import hashlib
from typing import Any, Dict, List, Sequence

import numpy as np

from .backends import Communicator


class MismatchError(RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank alike."""


def _digest(description: Dict[str, Any]) -> int:
    raw = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _raise_mismatch(comm: Communicator, description: Dict[str, Any]) -> None:
    every = comm.allgather_object(description)
    raise MismatchError(describe_mismatch(every))


def agree(comm: Communicator, description: Dict[str, Any]) -> None:
    """Check that every rank describes the same collective, in one tiny allreduce.

    ``description`` maps field names to plain values; its ``tensors`` entry, if any, is a
    list of per-tensor dicts. Raise :class:`MismatchError` on all ranks if any differ.
    """
    if comm.size == 1:
        return
    digest = _digest(description)
    # max(d) == -max(-d) exactly when every rank's digest is the same.
    both = np.array([digest, -digest], np.int64)
    comm.allreduce(both, "max")
    if both[0] != -both[1]:
        _raise_mismatch(comm, description)


def agree_gather(comm: Communicator, description: Dict[str, Any], extra: int) -> List[int]:
    """:func:`agree`, also returning every rank's ``extra`` (e.g. its first dimension)."""
    if comm.size == 1:
        return [extra]
    mine = np.array([_digest(description), extra], np.int64)
    gathered = np.empty(2 * comm.size, np.int64)
    comm.allgatherv(mine, gathered, [2] * comm.size)
    digests = gathered[0::2]
    if (digests != digests[0]).any():
        _raise_mismatch(comm, description)
    return gathered[1::2].tolist()


def _differing(values: Sequence[Any]) -> bool:
    return any(v != values[0] for v in values)


def _by_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def describe_mismatch(every: Sequence[Dict[str, Any]]) -> str:
    """One message naming the first field (and tensor) on which the ranks' descriptions differ."""
    first = every[0]
    what = f"{first.get('kind', 'collective')} {first.get('name')!r}"
    for field in first:
        if field == "tensors":
            continue
        values = [d.get(field) for d in every]
        if _differing(values):
            return f"{what}: ranks disagree on {field} ({_by_rank(values)})"
    counts = [len(d.get("tensors", ())) for d in every]
    if _differing(counts):
        return f"{what}: ranks disagree on the number of tensors ({_by_rank(counts)})"
    for i, tensor in enumerate(first.get("tensors", ())):
        for field in tensor:
            values = [d["tensors"][i][field] for d in every]
            if _differing(values):
                return (f"{what}: ranks disagree on {field} of tensor {i} "
                        f"{tensor.get('name')!r} ({_by_rank(values)})")
    return f"{what}: ranks disagree ({_by_rank(every)})"
