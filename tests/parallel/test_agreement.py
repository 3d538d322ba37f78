"""Every rank agrees: one rank's bad argument, setting, name or thread never desynchronises
or silently hangs the job (issue 12), on 2 and 3 ranks.

Each job is bounded in time, and its stall shutdown ends a hang with a non-zero exit, so a
hang fails the test instead of holding the suite.
"""
import pytest

from runner import run_ranks

# A job that hangs ends itself (and says where it waited) rather than waiting for the timeout.
BOUNDED = {"HVD_STALL_CHECK_TIME_SECONDS": "5", "HVD_STALL_SHUTDOWN_TIME_SECONDS": "20"}


@pytest.mark.parametrize("np_", [2, 3])
def test_a_bad_argument_on_one_rank_raises_on_every_rank_and_the_next_call_works(np_):
    out = run_ranks("bad_argument_worker.py", np_, timeout=120, env=BOUNDED).stdout
    assert out.count("bad arguments raised on every rank") == np_


@pytest.mark.parametrize("np_", [2, 3])
def test_messages_over_the_count_limit_go_in_pieces(np_):
    env = dict(BOUNDED, HVD_ALLREDUCE_ALGO="auto", HVD_RING_THRESHOLD="20000")
    out = run_ranks("count_limit_worker.py", np_, timeout=120, env=env).stdout
    assert out.count("collectives in pieces match NumPy") == np_
