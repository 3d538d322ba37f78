"""The agreement's records, without a second rank: their payload room, how every rank's
records are read, the digest made from a call's signature (issue 25), and the repeated
allgather that carries them."""
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


def gathered(rows):
    """The records of ``rows`` (digest, state, payload length, payload bytes) as read."""
    buffers = records.Records(Ranks(len(rows)))
    for r, (digest, state, length, payload) in enumerate(rows):
        buffers.recv[r, :3] = digest, state, length
        buffers.carried[r, :len(payload)] = np.frombuffer(payload, np.uint8)
    return records.Gathered(buffers)


ACTIVE, JOINED = records.ACTIVE, records.JOINED


def test_records_agree_when_every_active_digest_is_the_same():
    same = gathered([(7, ACTIVE, -1, b""), (7, ACTIVE, -1, b""), (7, ACTIVE, -1, b"")])
    assert same.agreed and same.state == ACTIVE
    other = gathered([(7, ACTIVE, -1, b""), (7, ACTIVE, -1, b""), (-7, ACTIVE, -1, b"")])
    assert not other.agreed


def test_a_joined_ranks_record_is_left_out_of_the_comparison_but_its_state_counts():
    joined = gathered([(7, ACTIVE, -1, b""), (0, JOINED, -1, b""), (7, ACTIVE, -1, b"")])
    assert joined.agreed and joined.state == ACTIVE | JOINED
    everyone = gathered([(0, JOINED, -1, b""), (0, JOINED, -1, b"")])
    assert everyone.agreed and everyone.state == JOINED


def test_carried_payloads_are_each_ranks_bytes_and_none_where_a_rank_sent_none():
    carried = gathered([(7, ACTIVE, 3, b"abc"), (7, ACTIVE, -1, b""),
                        (7, ACTIVE, 0, b"")]).carried()
    assert carried.of(0).tobytes() == b"abc" and carried.of(1) is None
    assert carried.of(2).tobytes() == b"" and not carried.every()
    assert gathered([(1, ACTIVE, 2, b"xy"), (1, ACTIVE, 1, b"z")]).carried().every()


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


def test_the_local_repeated_allgather_copies_this_ranks_record_each_time():
    send, recv = np.arange(3, dtype=np.int64), np.zeros((1, 3), np.int64)
    start = LocalCommunicator().repeated_allgather(send, recv)
    assert start().test() and recv.tolist() == [[0, 1, 2]]
    send[:] = 7
    assert start().test() and recv.tolist() == [[7, 7, 7]]


@pytest.mark.parametrize("version", [None, (3, 1)])
def test_the_mpi_repeated_allgather_gathers_again_on_the_same_buffers(monkeypatch, version):
    # None: this library's own version (MPI-4: a persistent request); 3.1: MPI_Iallgather.
    if version is not None:
        monkeypatch.setattr(mpi.MPI, "Get_version", lambda: version)
    comm = mpi.MPICommunicator(mpi.MPI.COMM_SELF)
    send, recv = np.arange(4, dtype=np.int64), np.zeros((1, 4), np.int64)
    start = comm.repeated_allgather(send, recv)
    for value in (1, 2):
        send[:] = value
        request = start()
        while not request.test():
            pass
        assert recv.tolist() == [[value] * 4]
    comm.free()  # frees the persistent request, if any, before MPI_Finalize
    assert comm._persistent == []


def test_inline_flags_are_or_ed_over_every_ranks_record():
    rng = np.random.default_rng(5)
    every = [rng.random(70) < 0.2 for _ in range(3)]  # two inline words each
    buffers = records.Records(Ranks(3))
    for r, flags in enumerate(every):
        words = records.pack_flags(flags)
        buffers.recv[r, :3] = 7, ACTIVE, -1
        buffers.recv[r, records.FLAGS_AT:records.FLAGS_AT + words.size] = words
    buffers.words = records.pack_flags(every[0])  # this rank's, as its exchange left them
    got = records.Gathered(buffers).flags(None, 70)
    assert got.tolist() == np.logical_or.reduce(every).tolist()
    assert records.Gathered(buffers).flags(None, 0).size == 0
