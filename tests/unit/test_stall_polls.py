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


def _started(local_ranks: int) -> None:
    """stall's setup at init, as on a host of ``local_ranks`` ranks (one rank in the world,
    so no watchdog starts)."""
    stall._start(types.SimpleNamespace(local=types.SimpleNamespace(size=local_ranks),
                                       world=types.SimpleNamespace(size=1)))


@pytest.mark.parametrize("waited, crowded, gives", [
    (0.00005, False, None), (0.001, False, "yield"), (0.05, False, "yield"),
    (0.2, False, 0.01), (0.0005, True, "yield"), (0.05, True, 0.0025), (1.0, True, 0.02)])
def test_a_wait_yields_then_sleeps_a_share_of_its_wait_and_sooner_where_ranks_outnumber_cores(
        monkeypatch, waited, crowded, gives):
    cores = len(stall.os.sched_getaffinity(0))
    calls = []
    monkeypatch.setattr(stall.os, "sched_yield", lambda: calls.append("yield"))
    monkeypatch.setattr(stall.time, "sleep", calls.append)
    monkeypatch.setattr(stall.time, "monotonic", lambda: 100.0 + waited)
    try:
        _started(cores + 1 if crowded else 1)
        stall.pause(100.0)
    finally:
        _started(1)
    # Kept for 100 µs (not where crowded), yields until 0.1 s (1 ms crowded), then sleeps
    # 1/20 of the time waited, at most 20 ms.
    assert calls == ([] if gives is None else
                     [gives if isinstance(gives, str) else pytest.approx(gives)])
