"""A wait's first polls (coordination/stall.py): a wait that ends within them is not followed
by a read of the mailbox (nor registered with the stall watchdog, in the same branch); one
that goes on is. Checked with a request that completes at a given poll and a communicator
that counts its mailbox reads, in one process."""
import types

import pytest

from hvd_trainer.coordination import stall


class CountingComm:
    """A communicator whose mailbox is read (and found empty) ``reads`` times."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.reads = 0

    def collect_posts(self) -> list:
        self.reads += 1
        return []


class CompletesAt:
    """A request that completes at its ``polls``-th test."""

    def __init__(self, polls: int) -> None:
        self.left = polls

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0


SCHEDULE = types.SimpleNamespace(abandoned=False)


@pytest.mark.parametrize("polls, reads", [(1, 0), (10, 0), (64, 0), (65, 1), (500, 1)])
def test_a_wait_reads_the_mailbox_only_after_its_first_64_polls(polls, reads):
    comm, request = CountingComm(), CompletesAt(polls)
    stall.poll(request, SCHEDULE, comm, "allreduce 'x'", "agreement", exchange=1)
    assert request.left == 0  # polled until it completed, no further
    assert comm.reads == reads


def test_a_wait_that_ends_within_its_first_polls_reads_the_mailbox_every_64_exchanges():
    comm = CountingComm()
    for exchange in range(128):
        stall.poll(CompletesAt(10), SCHEDULE, comm, "allreduce 'x'", "agreement", exchange)
    assert comm.reads == 2  # exchanges 0 and 64
