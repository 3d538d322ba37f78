"""How a rank waits for other ranks without holding its core.

MPI's blocking calls busy-wait: a rank whose peer is late spins at full speed on its core.
In a training step the reductions run on a communication thread while backward still computes
(and a host often runs more ranks than it has free cores), so a spinning wait takes the core
from the computation that the peer waits for. Every wait here polls without a pause at first,
as MPI's do (nearly every wait in a step is shorter), then gives the core away: a yield for the
first moments, then sleeps of at most 1/20 of the time waited so far (so sleeping adds at most
5% to a wait), up to 20 ms. For its first 100 µs it keeps its core between polls: on a busy
host a yield hands the core to another process for a time slice while the peer is about to
answer, and a small collective's wait is a few microseconds.
"""
import os
import time
from typing import Callable

KEEP_SECONDS = 0.0001
SPIN_SECONDS = 0.1
PAUSE_SHARE, MAX_PAUSE = 0.05, 0.02


def pause(start: float) -> None:
    """Between polls of a wait that began at ``start`` (monotonic): nothing for the first
    100 µs, then give the core away, by a yield for the first moments, then by sleeps of a
    small share of the time waited."""
    waited = time.monotonic() - start
    if waited < KEEP_SECONDS:
        return
    if waited < SPIN_SECONDS:
        os.sched_yield()
    else:
        time.sleep(min(PAUSE_SHARE * waited, MAX_PAUSE))


def wait_until(done: Callable[[], bool]) -> None:
    """Poll ``done()`` (which drives the MPI progress of what it tests) until it is True,
    pausing between polls as :func:`pause` does."""
    if done():
        return
    start = time.monotonic()
    while not done():
        pause(start)
