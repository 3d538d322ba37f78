"""The schedule's invariants, driven without MPI: rounds decide the same entries everywhere,
decided entries take the turn in order, names are unique while pending."""
import threading
import time

import numpy as np
import pytest

from hvd_trainer import scheduler


def summary(key, shape=(2,), sync=True, automatic=False, name=None):
    return (key, {"kind": "allreduce", "name": name or key, "shape": shape}, sync, automatic)


def failure(every):
    return RuntimeError([None if d is None else d["shape"] for d in every])


def test_match_runs_common_keys_in_the_lowest_ranks_order_and_leaves_the_rest():
    lists = [[summary("a"), summary("b"), summary("c")], [summary("c"), summary("a")]]
    verdicts = scheduler.match(lists, failure)
    assert [(v, k) for v, k, _ in verdicts] == [("run", "a"), ("run", "c")]


def test_match_raises_a_key_whose_descriptions_differ_and_skips_joined_ranks():
    lists = [[summary("a", (2,))], None, [summary("a", (3,))]]
    [(verdict, key, error)] = scheduler.match(lists, failure)
    assert (verdict, key) == ("raise", "a") and error.args[0] == [(2,), None, (3,)]


def test_match_single_decides_at_most_one():
    lists = [[summary("a"), summary("b")], [summary("b"), summary("a")]]
    assert [k for _, k, _ in scheduler.match(lists, failure, single=True)] == ["a"]


def test_deadlock_runs_drifted_automatic_names_and_raises_differing_names():
    drifted = [[summary("noname.3", automatic=True, name="allreduce.noname.3")],
               [summary("noname.5", automatic=True, name="allreduce.noname.5")]]
    assert scheduler.deadlock(drifted, 1, failure)[0][:2] == ("run", "noname.5")
    named = [[summary("x")], [summary("y")]]
    assert scheduler.deadlock(named, 0, failure)[0][:2] == ("raise", "x")


def test_a_pending_name_is_unique_and_freed_afterwards():
    sched = scheduler.Schedule(scheduler._Use())
    owner = object()
    assert sched.name("allreduce", "w", owner) == ("w", "w")
    with pytest.raises(scheduler.DuplicateNameError, match="'w'"):
        sched.name("allreduce", "w", object())
    sched.forget("w", owner)
    assert sched.name("allgather", "w", object())[1] == "w"
    assert [sched.name("barrier", None, object()) for _ in range(2)] == [
        ("barrier.noname.0", "noname.0"), ("barrier.noname.1", "noname.1")]


def test_a_job_takes_its_automatic_name_at_submission_and_derives_the_rest():
    sched = scheduler.Schedule(scheduler._Use())
    job = scheduler.Job()
    sched.reserve_for(job, None)  # submitted first: noname.0
    assert sched.name("barrier", None, object())[1] == "noname.1"  # a later synchronous call
    scheduler.set_job(job, None)
    try:
        assert sched.name("allreduce", None, object())[1] == "noname.0"
        assert sched.name("allgather", None, object())[1] == "noname.0.0"
    finally:
        scheduler.set_job(None, None)


def test_decided_entries_take_the_turn_one_at_a_time_in_the_rounds_order():
    sched = scheduler.Schedule(scheduler._Use())
    order, rounds = [], []

    def run_round(entries):
        rounds.append([e.key for e in entries])
        if len(entries) < 2:
            return []  # wait until both threads' entries are pending
        return [("run", "b", None), ("run", "a", None)]  # the other ranks' order

    def call(key):
        entry = scheduler.Entry(key, {"name": key}, None, 0)
        sched.settle(entry, run_round, lambda since: 0.001)
        order.append(key)
        assert sched.holds()
        time.sleep(0.05)  # holding the turn: the other entry must wait
        order.append(key)
        sched.give()

    threads = [threading.Thread(target=call, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["b", "b", "a", "a"]
    assert rounds[-1] in (["a", "b"], ["b", "a"])


def test_a_failed_round_fails_its_entries():
    sched = scheduler.Schedule(scheduler._Use())

    def broken(entries):
        raise OSError("link down")

    with pytest.raises(OSError, match="link down"):
        sched.settle(scheduler.Entry("a", {}, np.zeros(1, bool), 0), broken, lambda s: 0.0)
    assert not sched.pending and sched.use.free()


def test_a_claim_takes_the_turn_only_where_nothing_else_waits_or_runs():
    sched = scheduler.Schedule(scheduler._Use())
    assert sched.claim() and sched.holds()
    sched.give()
    assert sched.use.free()
    sched.pending.append(scheduler.Entry("a", {}, None, 0))
    assert not sched.claim() and sched.use.free()
    sched.pending.clear()
    other = threading.Thread(target=sched.take)
    other.start()
    other.join(10)
    assert not sched.claim() and not sched.holds()  # the other thread holds the turn


def test_a_claimed_round_that_decides_nothing_goes_on_as_rounds_do():
    sched = scheduler.Schedule(scheduler._Use())
    rounds = []

    def later(entries):  # the next rounds, made by settle
        rounds.append([e.key for e in entries])
        return [("run", "a", "flags")]

    assert sched.claim()
    entry = scheduler.Entry("a", {}, None, 0)
    # The claim's first exchange matched nothing: its round ends with no verdict.
    assert sched.settle(entry, later, lambda since: 0.0, lambda entries: []) == "flags"
    assert rounds == [["a"]] and sched.holds()
    sched.give()
    assert sched.use.free() and not sched.pending


def test_a_claimed_round_that_fails_frees_the_communicator():
    sched = scheduler.Schedule(scheduler._Use())

    def broken(entries):
        raise OSError("link down")

    assert sched.claim()
    with pytest.raises(OSError, match="link down"):
        sched.settle(scheduler.Entry("a", {}, None, 0), broken, lambda s: 0.0, broken)
    assert not sched.pending and sched.use.free()
