"""The agreement's wire record: what each rank puts into the one small exchange before a
collective, and how the gathered records are read.

Before a collective every rank contributes a record to one small nonblocking allgather: an
8-byte digest of what it is about to do (kind, names, dtypes, shapes, op, root, scale
factors), a state word (active or joined), optional flags, and room for a small payload.
Every agreement on a communicator uses records of the same size, so even ranks that reached
different kinds of collective meet in it: a disagreement never hangs and never reads past a
buffer. The room is the same on every rank of a communicator (:func:`room`): 4 KiB up to 4
ranks, 16 KiB shared among more, none from 257 ranks on, so an agreement moves at most 16 KiB
plus 72 bytes per rank.

**Digests from signatures.** A call that knows what fixes its description (kind, name, op,
scale factors, dtypes, shapes, root: its *signature*, a tuple) has its digest made from that
(:func:`signed_digest`), and its description is made only if the records differ; the
description and its text would cost more than the exchange of a small call.
"""
import hashlib
import weakref
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np

from . import matching
from ..backends import Communicator


# Flags that travel inside the agreement record; more go in a second exchange once agreed.
INLINE_FLAG_WORDS = 6
# The record, in int64 words: digest, state bits, the payload's length in bytes (-1: none),
# inline flags (72 bytes up to here), then room for the payload.
DIGEST, STATE, LENGTH, FLAGS_AT = 0, 1, 2, 3
HEADER_WORDS = FLAGS_AT + INLINE_FLAG_WORDS
# Payload room per rank: 4 KiB up to 4 ranks, then 16 KiB shared among the ranks, and none
# below 64 bytes. Every agreement moves the whole record: on 2 ranks an allgather of 4 KiB
# records took 3.9-4.2 µs against 2.4-3.1 µs for 72-byte ones, and of 8 KiB ones 9.8-21 µs
# (MPICH 5.0.2, 2 shared cores, 2026-12-02), so the room stops at 4 KiB, the size.
_ROOM_MAX, _ROOM_SHARED, _ROOM_MIN = 4096, 16384, 64
# State bits of a rank: active (it makes the call) or joined (it serves).
ACTIVE, JOINED = 1, 2
def description_digest(description: Dict[str, Any]) -> int:
    raw = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


class RoundShare(NamedTuple):
    """What each active rank shares in a round whose records differed (a joined rank shares
    None): whether it is stuck (:meth:`scheduler.Schedule.stuck`), its pending entries, and
    its counts of automatic names."""

    stuck: bool
    pending: List[matching.Summary]
    counts: Any  # scheduler.Counts; 0 where a disagreement is raised in step


class Agreed(NamedTuple):
    """What an agreement returns: the or-ed flags, and every rank's payload where the
    payloads travelled with it."""

    flags: Optional[np.ndarray]
    carried: Optional["Carried"]


class Signed(NamedTuple):
    """A call whose digest comes from its signature (see :meth:`Call.agree`)."""

    kind: str
    name: str
    signature: Any


def pack_flags(flags: np.ndarray) -> np.ndarray:
    """Booleans as bits in int64 words, so that a bitwise-or allreduce ors them."""
    bits = np.packbits(np.asarray(flags, bool))
    words = np.zeros(-(-bits.size // 8) * 8, np.uint8)
    words[:bits.size] = bits
    return words.view(np.int64)


def unpack_flags(words: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` booleans of :func:`pack_flags`' words."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8))[:count].astype(bool)


# Digests of signatures without the call's name (see signed_digest), bounded.
_signed: Dict[Any, bytes] = {}
_SIGNED_KEPT = 4096


def signed_digest(kind: str, name: str, signature: Any) -> int:
    """The digest of a call whose description is fixed by its kind, its name and
    ``signature`` (a hashable tuple of plain values): the signature's digest, kept, with
    the name's, so that neither the description nor its text is made for every call."""
    key = (kind, signature)
    base = _signed.get(key)
    if base is None:
        if len(_signed) >= _SIGNED_KEPT:
            _signed.clear()
        base = _signed[key] = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    raw = hashlib.blake2b(base + name.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


class Records:
    """A communicator's agreement buffers: this rank's record and every rank's, reused by
    each agreement (the communicator's user makes one at a time)."""

    __slots__ = ("room", "send", "payload", "recv", "carried", "words", "start")

    def __init__(self, comm: Communicator):
        room = min(_ROOM_MAX, _ROOM_SHARED // comm.size) // 8 * 8
        self.room = room if room >= _ROOM_MIN else 0
        self.send = np.zeros(HEADER_WORDS + self.room // 8, np.int64)
        self.payload = self.send[HEADER_WORDS:].view(np.uint8)
        self.recv = np.zeros((comm.size, self.send.size), np.int64)
        self.carried = self.recv[:, HEADER_WORDS:].view(np.uint8)
        self.words: Optional[np.ndarray] = None  # this rank's flags of the last record, packed
        self.start = comm.repeated_allgather(self.send, self.recv)


_records: "weakref.WeakKeyDictionary[Communicator, Records]" = weakref.WeakKeyDictionary()


def records_of(comm: Communicator) -> Records:
    found = _records.get(comm)
    if found is None:
        found = _records[comm] = Records(comm)
    return found


def room(comm: Communicator) -> int:
    """How many bytes of payload an agreement on ``comm`` can carry (0 for a single rank)."""
    return 0 if comm.size == 1 else records_of(comm).room


class Carried:
    """Every rank's payload from one agreement: rank r's is the first ``lengths[r]`` bytes
    of ``rows[r]`` (-1: it sent none). Valid until the block of the call that made it ends."""

    __slots__ = ("rows", "lengths")

    def __init__(self, rows: np.ndarray, lengths: List[int]):
        self.rows, self.lengths = rows, lengths

    def of(self, rank: int) -> Optional[np.ndarray]:
        """Rank ``rank``'s payload (None: it sent none)."""
        length = self.lengths[rank]
        return None if length < 0 else self.rows[rank, :length]

    def every(self) -> bool:
        """Whether every rank sent a payload."""
        return min(self.lengths) >= 0


class Gathered:
    """Every rank's record of one exchange: whether the active ranks' digests agree, the
    or-ed state bits, and what else the ranks sent."""

    __slots__ = ("records", "agreed", "state", "lengths")

    def __init__(self, records: Records):
        self.records = records
        self.state, first, self.agreed, self.lengths = 0, None, True, []
        for digest, state, length in records.recv[:, :FLAGS_AT].tolist():
            self.state |= state
            self.lengths.append(length)
            if state & ACTIVE:  # a joined rank has no digest: the others' are compared
                if first is None:
                    first = digest
                elif digest != first:
                    self.agreed = False

    def carried(self) -> "Carried":
        """Every rank's payload."""
        return Carried(self.records.carried, self.lengths)

    def flags(self, comm: Communicator, count: int) -> np.ndarray:
        """The or-ed flags (``count`` of them) of the entry whose record this rank sent last,
        which every rank agreed on."""
        words = self.records.words
        if not count:
            return np.zeros(0, bool)
        inline = min(words.size, INLINE_FLAG_WORDS)
        ored = [0] * inline
        for row in self.records.recv[:, FLAGS_AT:FLAGS_AT + inline].tolist():
            for i, word in enumerate(row):
                ored[i] |= word
        words[:inline] = ored
        if words.size > inline:  # the ranks agree on the count, so this exchange matches
            comm.allreduce(words[inline:], "bor")
        return unpack_flags(words, count)
