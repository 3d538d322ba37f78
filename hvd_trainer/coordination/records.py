"""The agreement's wire record, of one size at any rank count, and the gather that carries
a small collective's data after it.

**The record.** Before a collective every rank contributes a record of 208 bytes to one
nonblocking allreduce that ors the records bitwise: the 8-byte digest of what it is about
to do (kind, names, dtypes, shapes, op, root, scale factors), the digest's complement, a
state word (active or joined), flags, and room for a broadcast's small payload. The digests
of the active ranks agree exactly when the or of the digests and the or of the complements
share no bit (a bit on which two ranks differ is set in both); a joined rank contributes
zeros, so it is left out of the comparison but its state bit counts. The reduced record is
the same size as a rank's, at 2 ranks and at 4,096: an agreement moves 208 bytes per rank
and reads one record, whatever the rank count (Horovod's response cache agrees the same
way, by a fixed-size bit vector reduced by allreduce). The full descriptions travel only
when the digests differ, or a rank has joined (rounds.py). Every agreement on a
communicator uses records of the same size, so even ranks that reached different kinds of
collective meet in it: a disagreement never hangs and never reads past a buffer.

**Inline payloads.** A broadcast whose root's payload is at most :data:`INLINE_ROOM` bytes
and that takes the steady-state fast path writes it into the root's record (the other ranks
write zeros there, so the or is the root's bytes): a small broadcast is then one exchange.

**Carried data.** Other small collectives' data (and a broadcast's that did not ride in the
record) then travels in one persistent gather of fixed-size slots (:class:`Carrier`),
started only by calls that agreed at once: allreduce reduces the gathered payloads in rank
order, identically on every rank; broadcast, allgather and the object collectives read
them. Its room is the same on every rank of a communicator (:func:`room`): 4 KiB up to 4
ranks, 16 KiB shared among more, none from 257 ranks on.

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
# A broadcast's payload of at most this many bytes rides in the record (see Records.post).
# On 2 ranks a persistent or-allreduce of the 208-byte record took 0.838 µs against
# 0.812-0.816 µs for the 72 bytes without it (medians of 600 interleaved rounds, two runs,
# MPICH 5.0.2, 2 cores, 2026-12-07).
INLINE_ROOM = 128
# The record, in int64 words: the digest, its complement, the state bits, the inline flags,
# the inline payload's word (its writer and length, see Records.post) and its bytes:
# 208 bytes at any rank count.
DIGEST, INVERSE, STATE, FLAGS_AT = 0, 1, 2, 3
INLINE_AT = FLAGS_AT + INLINE_FLAG_WORDS
RECORD_WORDS = INLINE_AT + 1 + INLINE_ROOM // 8
# Payload room per rank in the carrier: 4 KiB up to 4 ranks, then 16 KiB shared among the
# ranks, and none below 64 bytes. On 2 ranks an allgather of 4 KiB records took 3.9-4.2 µs
# against 2.4-3.1 µs for 72-byte ones, and of 8 KiB ones 9.8-21 µs (MPICH 5.0.2, 2 shared
# cores, 2026-12-02), so the room stops at 4 KiB, the size.
_ROOM_MAX, _ROOM_SHARED, _ROOM_MIN = 4096, 16384, 64
# State bits of a rank: active (it makes the call) or joined (it serves).
ACTIVE, JOINED = 1, 2
# The carrier's slot, in int64 words: the payload's length in bytes (-1: none), the payload.
LENGTH, PAYLOAD_AT = 0, 1


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


class _Named(NamedTuple):
    """A name and the digest of a signature with it."""

    name: Optional[str]
    digest: int


_NO_NAME = _Named(None, 0)


class Signature:
    """A call's kind and signature with its digest's base made once (see
    :func:`signed_digest`): a caller that keeps one for a call it makes again and again
    saves hashing the signature each time."""

    __slots__ = ("base", "last")

    def __init__(self, kind: str, values: Any):
        self.base = hashlib.blake2b(repr((kind, values)).encode(), digest_size=8).digest()
        self.last = _NO_NAME  # the last name digested, with its digest


def signed_digest(kind: str, name: str, signature: Any) -> int:
    """The digest of a call whose description is fixed by its kind, its name and
    ``signature`` (a hashable tuple of plain values, or a :class:`Signature` of them): the
    signature's digest, kept, with the name's, so that neither the description nor its text
    is made for every call."""
    if type(signature) is Signature:
        last = signature.last  # one object: threads may share the signature
        if last.name == name:  # a named call made again: its digest is the same
            return last.digest
        digest = _digest(signature.base, name)
        signature.last = _Named(name, digest)
        return digest
    key = (kind, signature)
    base = _signed.get(key)
    if base is None:
        if len(_signed) >= _SIGNED_KEPT:
            _signed.clear()
        base = _signed[key] = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return _digest(base, name)


def _digest(base: bytes, name: str) -> int:
    """The digest of a signature's digest ``base`` and a call's ``name``."""
    raw = hashlib.blake2b(base + name.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


class Records:
    """A communicator's agreement buffers, reused by each agreement (the communicator's user
    makes one at a time): this rank's record (``send``) and the ranks' reduced one
    (``reduced``), each :data:`RECORD_WORDS` words whatever the rank count; the byte views of
    their inline payloads; this rank's flags and inline payload of the last record, which
    the next one replaces; and ``rank``, this rank's position in the communicator, which an
    inline payload names."""

    __slots__ = ("send", "reduced", "words", "start", "rank", "inlined", "inline_bytes",
                 "inline_reduced")

    def __init__(self, comm: Communicator):
        self.send = np.zeros(RECORD_WORDS, np.int64)
        self.reduced = np.zeros(RECORD_WORDS, np.int64)
        self.words: Optional[np.ndarray] = None  # this rank's flags of the last record, packed
        self.start = comm.repeated_allreduce(self.send, self.reduced, "bor")
        self.rank = comm.rank
        self.inlined = 0  # this rank's last inline payload's length plus one (0: none)
        self.inline_bytes = self.send[INLINE_AT + 1:].view(np.uint8)
        self.inline_reduced = self.reduced[INLINE_AT + 1:].view(np.uint8)

    def post(self, digest: int, state: int, flags: Optional[np.ndarray],
             inline: Optional[np.ndarray] = None) -> None:
        """Write this rank's record: its digest and state (an active rank's digest and its
        complement, a joined rank's zeros), its ``flags`` (booleans; the first
        :data:`INLINE_FLAG_WORDS` words of them, the rest go in a second exchange) and a
        broadcast root's ``inline`` payload (bytes, at most :data:`INLINE_ROOM`).

        The or of the records is the root's payload only where no other rank wrote one:
        the caller makes sure of it (the ranks' digests, which then agree, include the
        root). The payload's word holds its writer's rank and its length plus one, so that
        zero, every other rank's word, means none."""
        send = self.send
        if inline is not None or self.inlined:
            self._post_inline(inline)
        if state == ACTIVE:
            send[DIGEST], send[INVERSE] = digest, ~digest
        else:
            send[DIGEST] = send[INVERSE] = 0
        send[STATE] = state
        if flags is not None and len(flags):
            words = pack_flags(flags)
            first = min(words.size, INLINE_FLAG_WORDS)
            send[FLAGS_AT:INLINE_AT] = 0
            send[FLAGS_AT:FLAGS_AT + first] = words[:first]
            self.words = words
        elif self.words is not None:
            send[FLAGS_AT:INLINE_AT] = 0
            self.words = None

    def _post_inline(self, inline: Optional[np.ndarray]) -> None:
        """Write ``inline`` (None: none), zeroing what of the last record's payload it does
        not cover (the or would mix it into another root's)."""
        length = -1 if inline is None else inline.size
        if length >= 0:
            self.inline_bytes[:length] = inline
        if self.inlined > length + 1:
            self.inline_bytes[max(length, 0):self.inlined - 1] = 0
        self.send[INLINE_AT] = 0 if inline is None else (self.rank << 32) | (length + 1)
        self.inlined = length + 1

    def inline_carried(self) -> Optional["Inline"]:
        """The payload a broadcast root wrote in the reduced record (None: no rank wrote
        one). Read only after an agreement reached at once."""
        word = self.reduced.item(INLINE_AT)
        if not word:
            return None
        return Inline(word >> 32, self.inline_reduced[:(word & 0xFFFFFFFF) - 1])


class Carrier:
    """A communicator's gather of small payloads: this rank's slot and every rank's, each a
    length word and :func:`room` bytes, gathered by one persistent request."""

    __slots__ = ("room", "send", "payload", "recv", "carried", "lengths", "start", "gathers")

    def __init__(self, comm: Communicator, room: int):
        self.room = room
        self.gathers = 0  # how many gathers this rank has made (tests count them)
        self.send = np.zeros(PAYLOAD_AT + room // 8, np.int64)
        self.payload = self.send[PAYLOAD_AT:].view(np.uint8)
        self.recv = np.zeros((comm.size, self.send.size), np.int64)
        self.carried = self.recv[:, PAYLOAD_AT:].view(np.uint8)
        self.lengths = self.recv[:, LENGTH]  # a view, made once
        self.start = comm.repeated_allgather(self.send, self.recv)

    def post(self, payload: Optional[np.ndarray]) -> None:
        """Put ``payload`` (bytes) in this rank's slot, or mark it absent (None, or more than
        the room)."""
        if payload is not None and payload.size <= self.room:
            self.send[LENGTH] = payload.size
            self.payload[:payload.size] = payload
        else:
            self.send[LENGTH] = -1
        self.gathers += 1

    def gathered(self) -> "Carried":
        """Every rank's payload, once the gather has completed."""
        return Carried(self.carried, self.lengths.tolist())


class _Buffers(NamedTuple):
    """A communicator's agreement records and its carrier (None: no room)."""

    records: Records
    carrier: Optional[Carrier]


_buffers: "weakref.WeakKeyDictionary[Communicator, _Buffers]" = weakref.WeakKeyDictionary()


class _Last(NamedTuple):
    """The communicator whose buffers were looked up last (weakly), and its buffers."""

    comm: "weakref.ref[Communicator]"
    buffers: Optional[_Buffers]


_last = _Last(weakref.ref(_buffers), None)  # a referent that is never a communicator


def _buffers_of(comm: Communicator) -> _Buffers:
    """``comm``'s buffers, made at its first agreement on every rank alike (making the
    persistent requests is itself collective)."""
    global _last
    last = _last
    if last.comm() is comm:  # most calls use the communicator the last one used
        return last.buffers  # type: ignore[return-value]
    found = _buffers.get(comm)
    if found is None:
        room = min(_ROOM_MAX, _ROOM_SHARED // comm.size) // 8 * 8
        room = room if room >= _ROOM_MIN and comm.size > 1 else 0
        found = _buffers[comm] = _Buffers(Records(comm), Carrier(comm, room) if room else None)
    _last = _Last(weakref.ref(comm), found)
    return found


def records_of(comm: Communicator) -> Records:
    return _buffers_of(comm).records


def carrier_of(comm: Communicator) -> Optional[Carrier]:
    """``comm``'s carrier (None: its ranks have no room for payloads)."""
    return _buffers_of(comm).carrier


def room(comm: Communicator) -> int:
    """How many bytes of payload a small collective on ``comm`` can carry (0 for a single
    rank)."""
    if comm.size == 1:
        return 0
    carrier = _buffers_of(comm).carrier
    return 0 if carrier is None else carrier.room


class Carried:
    """Every rank's payload from one gather: rank r's is the first ``lengths[r]`` bytes
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


class Inline:
    """A broadcast root's payload read from the reduced record, read as a :class:`Carried`
    is: the one rank that sent one, ``writer``, and its bytes (valid until the block of the
    call that made it ends)."""

    __slots__ = ("writer", "payload")

    def __init__(self, writer: int, payload: np.ndarray):
        self.writer, self.payload = writer, payload

    def of(self, rank: int) -> Optional[np.ndarray]:
        """Rank ``rank``'s payload (None: it sent none)."""
        return self.payload if rank == self.writer else None

    def every(self) -> bool:
        """Whether every rank sent a payload: never, only the root sends one."""
        return False


class Gathered:
    """The ranks' reduced record of one exchange: whether the active ranks' digests agree,
    and the or-ed state bits and flags."""

    __slots__ = ("records", "agreed", "state")

    def __init__(self, records: Records):
        self.records = records
        reduced = records.reduced
        self.agreed = not reduced.item(DIGEST) & reduced.item(INVERSE)
        self.state = reduced.item(STATE)

    def flags(self, comm: Communicator, count: int) -> np.ndarray:
        """The or-ed flags (``count`` of them) of the entry whose record this rank sent last,
        which every rank agreed on."""
        words = self.records.words
        if not count:
            return np.zeros(0, bool)
        inline = min(words.size, INLINE_FLAG_WORDS)
        words[:inline] = self.records.reduced[FLAGS_AT:FLAGS_AT + inline]
        if words.size > inline:  # the ranks agree on the count, so this exchange matches
            comm.allreduce(words[inline:], "bor")
        return unpack_flags(words, count)
