"""The agreement's records, without a second rank: their fixed size, how the ranks' reduced
record is read, the carrier's payload room and payloads, the digest made from a call's
signature (issue 25), and the repeated exchanges that move them."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hvd_trainer.coordination import records
from hvd_trainer.collectives import arguments
from hvd_trainer.backends import mpi
from hvd_trainer.backends.local import LocalCommunicator
from hvd_trainer.collectives.memory import HOST


class Ranks(LocalCommunicator):
    """A communicator that claims ``size`` ranks; its allgather fills only rank 0's row."""

    def __init__(self, size):
        self.size = size


@pytest.mark.parametrize("size, room", [(2, 4096), (3, 4096), (4, 4096), (5, 3272),
                                        (8, 2048), (64, 256), (256, 64), (257, 0),
                                        (1024, 0)])
def test_the_room_is_4_kib_up_to_4_ranks_then_16_kib_shared_and_none_below_64_bytes(size,
                                                                                      room):
    # 16384 // 5 = 3276, rounded down to whole words; 16384 // 257 = 63 is under 64.
    assert records.room(Ranks(size)) == room


def test_a_single_rank_has_no_room():
    assert records.room(LocalCommunicator()) == 0


class Recording(LocalCommunicator):
    """A communicator of ``size`` ranks that records the repeated exchanges made on it."""

    def __init__(self, size):
        self.size, self.made = size, []

    def repeated_allreduce(self, send, recv, op):
        self.made.append(("allreduce", op, send.nbytes, recv.nbytes))
        return super().repeated_allreduce(send, recv, op)

    def repeated_allgather(self, send, recv):
        self.made.append(("allgather", None, send.nbytes, recv.nbytes))
        return super().repeated_allgather(send, recv)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 64, 257, 1000, 4096])
def test_the_agreement_sends_and_receives_208_bytes_per_rank_at_any_rank_count(size):
    # The exchange is a bitwise-or allreduce of one record: what a rank sends and what it
    # receives are the same 208 bytes at 2 ranks and at 4,096 (the old records were
    # gathered: 72 bytes and a payload room from every rank). 208 = 9 words of digest,
    # complement, state and flags, a word for the inline payload and its 128 bytes.
    comm = Recording(size)
    buffers = records.Records(comm)
    assert comm.made == [("allreduce", "bor", 208, 208)]
    assert buffers.send.nbytes == buffers.reduced.nbytes == 208


def reduced(rows):
    """The agreement's reduced record of ranks ``rows`` (digest, state, flags or None): each
    rank's record as it posts it, or-ed as the allreduce ors them."""
    buffers = records.Records(Ranks(len(rows)))
    every = []
    for digest, state, flags in rows:
        buffers.post(digest, state, flags)
        every.append(buffers.send.copy())
        buffers.send[:] = 0
    buffers.reduced[:] = np.bitwise_or.reduce(every)
    return buffers


ACTIVE, JOINED = records.ACTIVE, records.JOINED


def test_records_agree_when_every_active_digest_is_the_same():
    same = records.Gathered(reduced([(7, ACTIVE, None)] * 3))
    assert same.agreed and same.state == ACTIVE
    other = records.Gathered(reduced([(7, ACTIVE, None), (7, ACTIVE, None), (-7, ACTIVE, None)]))
    assert not other.agreed


def test_the_or_of_digests_and_complements_agrees_exactly_when_the_digests_are_equal():
    # Against the plain comparison: random digests, digests one bit apart (every bit), and
    # the extremes, on 2 to 5 ranks.
    rng = np.random.default_rng(11)
    extremes = [0, -1, 1, -(2**63), 2**63 - 1]
    for _ in range(400):
        count = int(rng.integers(2, 6))
        base = int(rng.integers(-(2**63), 2**63 - 1))
        digests = [base] * count
        if rng.random() < 0.5:
            digests[int(rng.integers(count))] = (
                base ^ (1 << int(rng.integers(63))) if rng.random() < 0.5
                else extremes[int(rng.integers(len(extremes)))])
        got = records.Gathered(reduced([(d, ACTIVE, None) for d in digests])).agreed
        assert got == (len(set(digests)) == 1), digests
    for a in extremes:
        for b in extremes:
            assert records.Gathered(reduced([(a, ACTIVE, None), (b, ACTIVE, None)])).agreed \
                == (a == b)


def test_a_joined_ranks_record_is_left_out_of_the_comparison_but_its_state_counts():
    joined = records.Gathered(reduced([(7, ACTIVE, None), (0, JOINED, None), (7, ACTIVE, None)]))
    assert joined.agreed and joined.state == ACTIVE | JOINED
    everyone = records.Gathered(reduced([(0, JOINED, None), (0, JOINED, None)]))
    assert everyone.agreed and everyone.state == JOINED
    # A joined rank's record is zeros but for its state, whatever digest it was given.
    buffers = records.Records(Ranks(2))
    buffers.post(12345, JOINED, None)
    assert buffers.send.tolist()[:3] == [0, 0, JOINED]


def gathered_payloads(payloads):
    """The carrier of ranks that sent ``payloads`` (bytes, or None), as gathered."""
    carrier = records.Carrier(Ranks(len(payloads)), 64)
    for r, payload in enumerate(payloads):
        carrier.post(None if payload is None else np.frombuffer(payload, np.uint8))
        carrier.recv[r] = carrier.send
    return carrier.gathered()


def test_carried_payloads_are_each_ranks_bytes_and_none_where_a_rank_sent_none():
    carried = gathered_payloads([b"abc", None, b"", bytes(65)])
    assert carried.of(0).tobytes() == b"abc" and carried.of(1) is None
    assert carried.of(2).tobytes() == b"" and carried.of(3) is None  # 65 bytes: no room
    assert not carried.every()
    assert gathered_payloads([b"xy", b"z"]).every()


DIGEST = ("import sys; from hvd_trainer.coordination import records; "
          "print(records.signed_digest('allreduce', sys.argv[1], (3, 0.5, (True, (('<f4', "
          "(2, 3)),)))))")


def test_a_signed_digest_is_the_same_in_every_process_and_differs_with_name_or_signature():
    mine = records.signed_digest("allreduce", "w", (3, 0.5, (True, (("<f4", (2, 3)),))))
    # Another process, whose str hashes differ (the digest must not depend on them).
    env = dict(os.environ, PYTHONHASHSEED="12345")
    theirs = subprocess.run([sys.executable, "-c", DIGEST, "w"], capture_output=True,
                            text=True, env=env, check=True).stdout.strip()
    assert int(theirs) == mine
    assert records.signed_digest("allreduce", "v", (3, 0.5, (True, (("<f4", (2, 3)),)))) \
        != mine
    assert records.signed_digest("allreduce", "w", (3, 0.5, (True, (("<f8", (2, 3)),)))) \
        != mine
    assert records.signed_digest("broadcast", "w", (3, 0.5, (True, (("<f4", (2, 3)),)))) \
        != mine


def variants():
    """Tensors, ops and scale factors that differ in one thing at a time."""
    shapes, dtypes = [(2,), (3,), (2, 1), (1, 2), ()], [np.float32, np.float64, np.int32]
    for shape in shapes:
        for dtype in dtypes:
            yield [np.zeros(shape, dtype)], arguments.Sum, 1.0, 1.0
    yield [np.zeros(2, np.float32), np.zeros(3, np.float32)], arguments.Sum, 1.0, 1.0
    yield [np.zeros(3, np.float32), np.zeros(2, np.float32)], arguments.Sum, 1.0, 1.0
    for op in (arguments.Average, arguments.Max):
        yield [np.zeros(2, np.float32)], op, 1.0, 1.0
    yield [np.zeros(2, np.float32)], arguments.Sum, 0.5, 1.0
    yield [np.zeros(2, np.float32)], arguments.Sum, 1.0, 0.5


def test_equal_reduction_signatures_are_equal_descriptions_but_for_the_names():
    # The digest of a call with a signature is made from the signature alone: two calls
    # that describe themselves differently must have different signatures.
    calls = list(variants())
    for a in calls:
        for b in calls:
            described = [arguments.describe_reduction("x", tensors, op, pre, post)
                         for tensors, op, pre, post in (a, b)]
            signed = [arguments.reduction_signature(HOST, tensors, op, pre, post)
                      for tensors, op, pre, post in (a, b)]
            assert (signed[0] == signed[1]) == (described[0] == described[1]), (a, b)


def test_equal_tensor_signatures_are_equal_tensor_descriptions_with_or_without_dim_0():
    tensors = [np.zeros(shape, dtype) for shape in [(2, 3), (4, 3), (2, 4), (5,)]
               for dtype in (np.float32, np.uint8)]
    for dim0 in (True, False):
        for a in tensors:
            for b in tensors:
                same_signature = (arguments.tensor_signature(HOST, [a], dim0)
                                  == arguments.tensor_signature(HOST, [b], dim0))
                same_description = (arguments.describe_tensor(a, "x", dim0)
                                    == arguments.describe_tensor(b, "x", dim0))
                assert same_signature == same_description, (a.shape, b.shape, dim0)


def test_the_local_repeated_exchanges_copy_this_ranks_buffer_each_time():
    send, recv = np.arange(3, dtype=np.int64), np.zeros((1, 3), np.int64)
    start = LocalCommunicator().repeated_allgather(send, recv)
    assert start().test() and recv.tolist() == [[0, 1, 2]]
    send[:] = 7
    assert start().test() and recv.tolist() == [[7, 7, 7]]
    reduced = np.zeros(3, np.int64)
    start = LocalCommunicator().repeated_allreduce(send, reduced, "bor")
    assert start().test() and reduced.tolist() == [7, 7, 7]


@pytest.mark.parametrize("version", [None, (3, 1)])
def test_the_mpi_repeated_exchanges_run_again_on_the_same_buffers(monkeypatch, version):
    # None: this library's own version (MPI-4: persistent requests); 3.1: MPI_Iallgather
    # and MPI_Iallreduce.
    if version is not None:
        monkeypatch.setattr(mpi.MPI, "Get_version", lambda: version)
    comm = mpi.MPICommunicator(mpi.MPI.COMM_SELF)
    send, recv = np.arange(4, dtype=np.int64), np.zeros((1, 4), np.int64)
    reduced = np.zeros(4, np.int64)
    starts = [(comm.repeated_allgather(send, recv), recv),
              (comm.repeated_allreduce(send, reduced, "bor"), reduced)]
    for value in (1, 2):
        send[:] = value
        for start, into in starts:
            request = start()
            while not request.test():
                pass
            assert into.reshape(-1).tolist() == [value] * 4
    comm.free()  # frees the persistent requests, if any, before MPI_Finalize
    assert comm._persistent == []


def test_inline_flags_are_or_ed_over_every_ranks_record():
    rng = np.random.default_rng(5)
    every = [rng.random(70) < 0.2 for _ in range(3)]  # two inline words each
    buffers = reduced([(7, ACTIVE, flags) for flags in every])
    buffers.words = records.pack_flags(every[0])  # this rank's, as its exchange left them
    got = records.Gathered(buffers).flags(None, 70)
    assert got.tolist() == np.logical_or.reduce(every).tolist()
    assert records.Gathered(buffers).flags(None, 0).size == 0


class Rank(LocalCommunicator):
    """Rank ``rank`` of a communicator of ``size`` ranks (for its own records)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def or_of(buffers, payloads):
    """Each rank of ``buffers`` posts an active record with its payload of ``payloads``
    (bytes or None); the reduced record, or-ed as the allreduce ors them, lands in each."""
    for b, payload in zip(buffers, payloads):
        b.post(7, ACTIVE, None, None if payload is None else np.frombuffer(payload, np.uint8))
    total = np.bitwise_or.reduce([b.send for b in buffers])
    for b in buffers:
        b.reduced[:] = total


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 100, 128])
def test_a_roots_inline_payload_is_read_back_from_the_or_of_the_records(length):
    buffers = [records.Records(Rank(r, 3)) for r in range(3)]
    payload = bytes(np.random.default_rng(length).integers(0, 256, length, np.uint8))
    or_of(buffers, [None, payload, None])
    for b in buffers:
        carried = b.inline_carried()
        assert carried.of(1).tobytes() == payload
        assert carried.of(0) is None and carried.of(2) is None
        assert not carried.every()


def test_no_inline_payload_reads_as_none():
    buffers = [records.Records(Rank(r, 2)) for r in range(2)]
    or_of(buffers, [None, None])
    assert buffers[0].inline_carried() is None


def test_an_earlier_inline_payload_leaves_nothing_in_a_later_record():
    # Rank 0 was the root of a long payload, then of a short one, then none; rank 2 then
    # roots a payload of its own: each or must be exactly the root's bytes (a stale byte of
    # rank 0's would be or-ed into rank 2's).
    buffers = [records.Records(Rank(r, 3)) for r in range(3)]
    long, short, other = b"\xff" * 128, b"\x01\x02\x03", b"\x10" * 20
    or_of(buffers, [long, None, None])
    assert buffers[1].inline_carried().of(0).tobytes() == long
    or_of(buffers, [short, None, None])
    assert buffers[1].inline_carried().of(0).tobytes() == short
    or_of(buffers, [None, None, other])
    assert buffers[1].inline_carried().of(2).tobytes() == other
    assert not buffers[0].send[records.INLINE_AT:].any()  # rank 0's part is zeros again
    or_of(buffers, [None, None, None])
    assert buffers[0].inline_carried() is None
    # A joined rank's record has no payload either.
    buffers[2].post(0, JOINED, None)
    assert not buffers[2].send[records.INLINE_AT:].any()
