"""Mismatch messages, flag packing and stall reports, checked without other processes."""
import logging

import numpy as np
import pytest

from hvd_trainer.coordination.messages import describe_mismatch, refusal_while_joined
from hvd_trainer.coordination.records import pack_flags, unpack_flags
from hvd_trainer.coordination.stall import StallInspector, drain_posts


def test_names_first_differing_top_level_field():
    every = [{"kind": "broadcast", "name": "w", "root_rank": 0},
             {"kind": "broadcast", "name": "w", "root_rank": 1}]
    assert describe_mismatch(every) == \
        "broadcast 'w': ranks disagree on root_rank (rank 0: 0, rank 1: 1)"


def test_names_a_field_only_some_ranks_have():
    every = [{"kind": "allreduce", "name": "a"},
             {"kind": "broadcast", "name": "a", "root_rank": 0}]
    message = describe_mismatch(every)
    assert message == ("allreduce 'a': ranks disagree on kind "
                       "(rank 0: 'allreduce', rank 1: 'broadcast')")


def test_names_tensor_and_field_inside_a_group():
    t = {"name": "g.0", "dtype": "<f4", "shape": (2,)}
    every = [{"kind": "grouped_allreduce", "name": "g", "tensors": [t, dict(t, name="g.1")]},
             {"kind": "grouped_allreduce", "name": "g",
              "tensors": [t, dict(t, name="g.1", dtype="<f2")]}]
    assert describe_mismatch(every) == ("grouped_allreduce 'g': ranks disagree on dtype of tensor 1 "
                                        "'g.1' (rank 0: '<f4', rank 1: '<f2')")


def test_names_missing_tensors():
    a = {"name": "a", "dtype": "<f4", "shape": (1,)}
    b = dict(a, name="b")
    every = [{"kind": "trainer step", "name": "step", "tensors": [a, b]},
             {"kind": "trainer step", "name": "step", "tensors": [a]},
             {"kind": "trainer step", "name": "step", "tensors": [a]}]
    assert describe_mismatch(every) == (
        "trainer step 'step': ranks disagree on the number of tensors "
        "(rank 0: 2, rank 1: 1, rank 2: 1); tensor 'b' is missing on ranks 1, 2")


@pytest.mark.parametrize("count", [0, 1, 63, 64, 65, 500])
def test_packed_flags_or_like_booleans(count):
    rng = np.random.RandomState(count)
    per_rank = [rng.rand(count) < 0.1 for _ in range(3)]
    words = np.bitwise_or.reduce([pack_flags(f) for f in per_rank]) if count else pack_flags([])
    assert words.dtype == np.int64
    np.testing.assert_array_equal(unpack_flags(words, count), np.logical_or.reduce(per_rank, 0)
                                  if count else np.zeros(0, bool))


class FakeComm:
    """Rank 0 of three; rank 2 has posted that it waits in the same collective."""

    rank, size = 0, 3

    def __init__(self, posts):
        self.posts, self.sent = posts, []

    def collect_posts(self):
        posts, self.posts = self.posts, []
        return posts

    def post(self, dest, message):
        self.sent.append((dest, message))


def test_stall_report_names_the_rank_that_has_not_arrived(caplog):
    comm = FakeComm([(2, (5, "allreduce 'x'"))])
    inspector = StallInspector(comm, "allreduce 'x'", 5, start=100.0, check_seconds=2.0,
                               shutdown_seconds=0.0)
    with caplog.at_level(logging.WARNING, logger="hvd_trainer"):
        inspector.check(100.5)   # rank 2's post arrives: rank 0 answers it
        assert comm.sent == [(1, (5, "allreduce 'x'")), (2, (5, "allreduce 'x'"))]
        assert not caplog.records
        inspector.check(102.5)
    assert [r.getMessage() for r in caplog.records] == [
        "stall: rank 0 has waited 2.5 s for allreduce 'x'; rank 1 has not submitted it "
        "(still computing, stuck, or exited)"]


def test_stall_report_says_where_other_ranks_wait():
    comm = FakeComm([(1, (5, "broadcast 'y'")), (2, (4, "allreduce 'old'"))])
    inspector = StallInspector(comm, "allreduce 'x'", 5, start=0.0, check_seconds=1.0,
                               shutdown_seconds=0.0)
    inspector.check(0.1)
    assert inspector.report(1.0) == (
        "stall: rank 0 has waited 1.0 s for allreduce 'x'; rank 2 has not submitted it "
        "(still computing, stuck, or exited); rank 1 waits for broadcast 'y' instead")


def test_posts_that_an_agreement_round_read_still_reach_the_inspector():
    # Ranks matching calls by name make agreement rounds all through a long wait, and every
    # round empties the mailbox: the posts it read must not be lost to the wait's inspector.
    comm = FakeComm([(1, (5, "allreduce 'x'")), (2, (5, "broadcast 'y'"))])
    inspector = StallInspector(comm, "allreduce 'x'", 5, start=0.0, check_seconds=1.0,
                               shutdown_seconds=0.0)
    drain_posts(comm)  # a round's exchange ends
    inspector.check(0.2)
    assert inspector.report(1.0) == (
        "stall: rank 0 has waited 1.0 s for allreduce 'x'; rank 2 waits for broadcast 'y' "
        "instead")


def test_mismatch_skips_joined_ranks_and_keeps_rank_numbers():
    every = [{"kind": "allreduce", "name": "w", "tensors": [{"name": "w", "shape": (4,)}]},
             None,  # a joined rank makes no call
             {"kind": "allreduce", "name": "w", "tensors": [{"name": "w", "shape": (5,)}]}]
    assert describe_mismatch(every) == ("allreduce 'w': ranks disagree on shape of tensor 0 'w' "
                                        "(rank 0: (4,), rank 2: (5,))")


def test_joined_ranks_serve_host_reductions_only():
    assert refusal_while_joined({"kind": "allreduce", "tensors": [{"memory": "host"}]}) is None
    assert refusal_while_joined({"kind": "trainer step", "tensors": []}) is None
    assert "sparse_as_dense=True" in refusal_while_joined({"kind": "allgather"})
    assert "broadcast" in refusal_while_joined({"kind": "broadcast"})
    assert "GPU" in refusal_while_joined({"kind": "allreduce", "tensors": [{"memory": "gpu"}]})
