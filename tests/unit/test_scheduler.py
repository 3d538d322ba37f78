"""The scheduler's invariants, driven without MPI: rounds decide the same entries everywhere,
decided entries take the turn in order, names are unique while pending; handed work runs in
order unless it parks, deferred work goes first and once, closers run on their own thread."""
import threading
import time

import numpy as np
import pytest

import hvd_trainer as hvd
from hvd_trainer.coordination import jobs, matching, scheduler, work_order


def summary(key, shape=(2,), sync=True, automatic=False, name=None):
    return matching.Summary(key, {"kind": "allreduce", "name": name or key, "shape": shape},
                             sync, automatic)


def failure(every):
    return RuntimeError([None if d is None else d.get("shape") for d in every])


def test_match_runs_common_keys_in_the_lowest_ranks_order_and_leaves_the_rest():
    lists = [[summary("a"), summary("b"), summary("c")], [summary("c"), summary("a")]]
    verdicts = matching.match(lists, failure)
    assert [(v, k) for v, k, _ in verdicts] == [("run", "a"), ("run", "c")]


def test_match_raises_a_key_whose_descriptions_differ_and_skips_joined_ranks():
    lists = [[summary("a", (2,))], None, [summary("a", (3,))]]
    [(verdict, key, error)] = matching.match(lists, failure)
    assert (verdict, key) == ("raise", "a") and error.args[0] == [(2,), None, (3,)]


def test_match_single_decides_at_most_one():
    lists = [[summary("a"), summary("b")], [summary("b"), summary("a")]]
    assert [k for _, k, _ in matching.match(lists, failure, single=True)] == ["a"]


def test_deadlock_runs_drifted_automatic_names_and_raises_differing_names():
    drifted = [[summary("noname.3", automatic=True, name="allreduce.noname.3")],
               [summary("noname.5", automatic=True, name="allreduce.noname.5")]]
    assert matching.deadlock(drifted, 1, failure)[0][:2] == ("run", "noname.5")
    named = [[summary("x")], [summary("y")]]
    assert matching.deadlock(named, 0, failure)[0][:2] == ("raise", "x")


def barrier(key):
    return matching.Summary(key, {"kind": "barrier", "name": f"barrier.{key}"}, True, True)


def test_deadlock_keeps_a_barrier_waiting_and_raises_the_calls_of_the_others():
    lists = [[barrier("noname.7")], [summary("x")], None, [barrier("noname.7")]]  # 2 joined
    assert matching.deadlock(lists, 0, failure) == [("wait", "noname.7", None)]
    assert matching.deadlock(lists, 3, failure) == [("wait", "noname.7", None)]
    [(verdict, key, error)] = matching.deadlock(lists, 1, failure)
    assert (verdict, key) == ("raise", "x")
    assert "ranks 0, 3 wait in a barrier for this rank" in str(error)


def test_match_keeps_a_barrier_waiting_when_another_call_has_its_key():
    other = matching.Summary("noname.2", {"kind": "allgather", "name": "allgather.noname.2"},
                              True, True)
    lists = [[barrier("noname.2")], [other]]
    assert matching.match(lists, failure, me=0) == [("wait", "noname.2", None)]
    [(verdict, key, error)] = matching.match(lists, failure, me=1)
    assert (verdict, key) == ("raise", "noname.2") and "rank 0 waits in a barrier" in str(error)
    both = [[barrier("noname.2")], [barrier("noname.2")]]
    assert [v for v, _, _ in matching.match(both, failure, me=0)] == ["run"]


def test_deadlock_looks_at_each_ranks_oldest_waited_call_only():
    unwaited = summary("early", sync=False)
    lists = [[unwaited, summary("noname.1", automatic=True, name="allreduce.noname.1")],
             [summary("noname.4", automatic=True, name="allreduce.noname.4")]]
    assert matching.deadlock(lists, 0, failure)[0][:2] == ("run", "noname.1")
    assert matching.deadlock_runs(lists) and not matching.deadlock_runs([[unwaited]])


def test_an_entry_of_a_job_counts_as_waited_while_a_thread_waits_for_its_handle():
    job = jobs.Job()
    jobs.set_job(job, None)
    try:
        entry = jobs.Entry("k", {"name": "k"}, None, 0)
    finally:
        jobs.set_job(None, None)
    assert not entry.waited() and not entry.summary().waited
    with jobs.await_job(job):
        assert entry.waited() and entry.summary().waited
    assert not entry.waited()
    assert jobs.Entry("s", {"name": "s"}, None, 0).waited()  # a synchronous call's


def test_a_graph_op_counts_as_a_wait_only_beside_a_rank_that_waits_outside_a_graph():
    job = jobs.Job(in_graph=True)
    jobs.set_job(job, None)
    try:
        entry = jobs.Entry("g", {"kind": "allreduce", "name": "g", "shape": (2,)}, None, 0)
    finally:
        jobs.set_job(None, None)
    with jobs.await_job(job):
        in_graph = entry.summary()
    assert not in_graph.waited and in_graph.in_graph
    eager = summary("noname.2", automatic=True, name="allreduce.noname.2")
    # Ranks that all wait in graph ops may still start others: they wait on (the stall).
    assert not matching.deadlocked([True, True], [[in_graph], [in_graph]])
    assert not matching.deadlocked([True, False], [[eager], [in_graph]])
    assert matching.deadlocked([True, True, False], [[eager], [in_graph], None])  # 2 joined
    [(verdict, key, error)] = matching.deadlock([[eager], [in_graph]], 1, failure)
    assert (verdict, key) == ("raise", "g")


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


def test_a_started_thread_counts_its_own_automatic_names_under_its_name():
    sched = scheduler.Schedule(scheduler._Use())
    keys = {}

    def call(label):
        keys[label] = [sched.name("allreduce", None, object())[1] for _ in range(2)]

    for label in ("b", "a"):  # the other order than their names': each counts from 0
        thread = threading.Thread(target=call, args=(label,), name=f"worker {label}")
        thread.start()
        thread.join()
    assert keys == {"a": ["noname[worker a].0", "noname[worker a].1"],
                    "b": ["noname[worker b].0", "noname[worker b].1"]}
    assert sched.name("allreduce", None, object())[1] == "noname.0"  # the main thread's


def test_deadlock_raises_automatic_names_of_threads_named_apart():
    apart = [[summary("noname[rank0].0", automatic=True, name="allreduce.noname[rank0].0")],
             [summary("noname[rank1].0", automatic=True, name="allreduce.noname[rank1].0")]]
    (verdict, key, error), = matching.deadlock(apart, 1, failure)
    assert (verdict, key) == ("raise", "noname[rank1].0")
    assert "counted per thread" in str(error) and "name=" in str(error)
    drifted = [[summary("noname[w].3", automatic=True, name="allreduce.noname[w].3")],
               [summary("noname[w].0", automatic=True, name="allreduce.noname[w].0")]]
    assert matching.deadlock(drifted, 0, failure)[0][:2] == ("run", "noname[w].3")


def test_a_job_takes_its_automatic_name_at_submission_and_derives_the_rest():
    sched = scheduler.Schedule(scheduler._Use())
    job = jobs.Job()
    sched.reserve_for(job, None)  # submitted first: noname.0
    assert sched.name("barrier", None, object())[1] == "noname.1"  # a later synchronous call
    jobs.set_job(job, None)
    try:
        assert sched.name("allreduce", None, object())[1] == "noname.0"
        assert sched.name("allgather", None, object())[1] == "noname.0.0"
    finally:
        jobs.set_job(None, None)


def _ran_as_job(sched, job, calls):
    """Submit ``job`` and run its ``calls`` (name, ran without error) to the end, as the
    communication thread does: the first name is reserved at submission and claimed, each
    call's name is forgotten after it ran."""
    sched.reserve_for(job, calls[0][0])
    jobs.set_job(job, None)
    try:
        for given, ran in calls:
            owner = object()
            key = sched.name("allreduce", given, owner)[1]
            sched.forget(key, owner, ran=ran)
    finally:
        jobs.set_job(None, None)
    job.release()


def test_a_named_async_call_that_ran_holds_its_name_until_waited_on():
    """Horovod's duplicate-name check: reusing a name back to back raises even when the
    first call already finished (the peers were waiting for it)."""
    sched = scheduler.Schedule(scheduler._Use())
    job = jobs.Job(hold=True)
    _ran_as_job(sched, job, [("dup", True)])
    with pytest.raises(scheduler.DuplicateNameError, match="'dup'.*not waited on"):
        sched.reserve_for(jobs.Job(hold=True), "dup")
    with pytest.raises(scheduler.DuplicateNameError, match="'dup'"):
        sched.name("allreduce", "dup", object())  # a synchronous call too
    job.unhold()  # its handle was waited on
    owner = object()
    assert sched.name("allreduce", "dup", owner)[1] == "dup"
    sched.forget("dup", owner)


def test_another_call_starting_or_ending_frees_a_held_name_but_the_same_jobs_do_not():
    sched = scheduler.Schedule(scheduler._Use())
    # The job's own further (derived) call does not free its name.
    _ran_as_job(sched, jobs.Job(hold=True), [("x", True), (None, True)])
    with pytest.raises(scheduler.DuplicateNameError):
        sched.reserve_for(jobs.Job(hold=True), "x")
    other = object()
    sched.forget(sched.name("barrier", None, other)[1], other)  # another name: "x" is free
    earlier = object()  # a synchronous call that started before "x" ran, and ends after
    key = sched.name("allreduce", "y", earlier)[1]
    _ran_as_job(sched, jobs.Job(hold=True), [("x", True)])
    assert "x" in sched.held
    sched.forget(key, earlier)
    assert not sched.held


def test_only_a_named_call_that_ran_of_a_holding_job_holds_its_name():
    sched = scheduler.Schedule(scheduler._Use())
    _ran_as_job(sched, jobs.Job(hold=False), [("graph", True)])  # a TF graph op's
    _ran_as_job(sched, jobs.Job(hold=False), [("graph", True)])
    _ran_as_job(sched, jobs.Job(hold=True), [(None, True)])  # automatic names: never reused
    _ran_as_job(sched, jobs.Job(hold=True), [("failed", False)])  # it raised
    assert not sched.held


def test_a_handle_polled_done_or_waited_on_frees_its_name():
    for wait in (lambda f: f.done(), lambda f: f.result()):
        sched = scheduler.Schedule(scheduler._Use())
        job = jobs.Job(hold=True)
        _ran_as_job(sched, job, [("h", True)])
        future = work_order._Submitted(job)
        assert not future.done() and "h" in sched.held  # not finished: still held
        future.set_result(1)
        wait(future)
        assert not sched.held


def test_decided_entries_take_the_turn_one_at_a_time_in_the_rounds_order():
    sched = scheduler.Schedule(scheduler._Use())
    order, rounds = [], []

    def run_round(entries):
        rounds.append([e.key for e in entries])
        if len(entries) < 2:
            return []  # wait until both threads' entries are pending
        # the other ranks' order
        return [matching.Verdict("run", "b", None), matching.Verdict("run", "a", None)]

    def call(key):
        entry = jobs.Entry(key, {"name": key}, None, 0)
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
        sched.settle(jobs.Entry("a", {}, np.zeros(1, bool), 0), broken, lambda s: 0.0)
    assert not sched.pending and sched.use.free()


def test_a_claim_takes_the_turn_only_where_nothing_else_waits_or_runs():
    sched = scheduler.Schedule(scheduler._Use())
    assert sched.claim() and sched.holds()
    sched.give()
    assert sched.use.free()
    sched.pending.append(jobs.Entry("a", {}, None, 0))
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
        return [matching.Verdict("run", "a", "flags")]

    assert sched.claim()
    entry = jobs.Entry("a", {}, None, 0)
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
        sched.settle(jobs.Entry("a", {}, None, 0), broken, lambda s: 0.0, broken)
    assert not sched.pending and sched.use.free()


def _recorder(seen):
    def record(label):
        def work():
            seen.append((label, threading.current_thread().name))
            return label
        return work
    return record


def _idle():
    work_order.start(lambda: None).result(10)  # the thread has nothing left
    while work_order._busy:
        pass


def test_deferred_work_runs_where_it_is_needed_if_nothing_comes_first():
    _idle()
    seen = []
    record = _recorder(seen)
    future = work_order.defer(record("step"))
    assert not future.done() and seen == []  # queued, the thread not woken
    work_order.run_deferred(future)
    assert future.result(0) == "step"
    assert seen == [("step", threading.current_thread().name)]
    work_order.run_deferred(future)  # once only
    assert len(seen) == 1


def test_what_starts_after_deferred_work_goes_behind_it():
    _idle()
    seen = []
    record = _recorder(seen)
    step = work_order.defer(record("step"))
    later = work_order.start(record("async collective"))
    assert later.result(10) == "async collective" and step.result(10) == "step"
    assert [label for label, _ in seen] == ["step", "async collective"]
    assert len({name for _, name in seen}) == 1
    assert seen[0][1].startswith("hvd_trainer-comm")
    work_order.run_deferred(step)  # already ran on the thread: nothing more
    assert len(seen) == 2

    _idle()
    seen.clear()
    step = work_order.defer(record("step"))
    work_order.flush(here=True)  # a synchronous collective on this thread: the step first, here
    assert step.result(0) == "step"
    assert seen == [("step", threading.current_thread().name)]


def test_deferring_while_the_thread_has_work_hands_it_over_in_order():
    seen = []
    record = _recorder(seen)
    release = threading.Event()
    busy = work_order.start(lambda: release.wait(10))
    step = work_order.defer(record("step"))
    assert work_order._deferred is None  # handed to the thread behind the busy work
    release.set()
    busy.result(10)
    assert step.result(10) == "step" and seen[0][1].startswith("hvd_trainer-comm")


def test_a_synchronous_collective_runs_a_deferred_step_first():
    _idle()
    x = np.arange(3.0)
    results = []
    step = work_order.defer(lambda: results.append(hvd.allreduce(x, op=hvd.Sum)))
    assert hvd.allreduce(x, op=hvd.Max) is not None  # runs the step first, on this thread
    assert step.done() and np.array_equal(results[0], x)


def test_a_closer_runs_before_its_own_threads_next_collective_only():
    _idle()
    seen = []
    answers = [False, True]  # declines once (as inside a backward), then closes

    def closer():
        seen.append("closer")
        return answers.pop(0)

    work_order.on_own_collective(closer)
    other = threading.Thread(
        target=lambda: work_order.start(lambda: seen.append("other")).result(10))
    other.start()
    other.join()
    assert seen == ["other"]  # another thread's collective does not run it
    work_order.start(lambda: seen.append("first")).result(10)
    work_order.start(lambda: seen.append("second")).result(10)
    work_order.start(lambda: seen.append("third")).result(10)
    assert seen == ["other", "closer", "first", "closer", "second", "third"]

    def forgotten():
        seen.append("forgotten")
        return True

    work_order.on_own_collective(forgotten)
    work_order.forget_closer(forgotten)
    work_order.flush(here=True)
    assert "forgotten" not in seen


def test_work_that_parks_lets_the_next_start_on_another_thread():
    _idle()
    seen = []
    matched = threading.Event()

    def waits_for_a_match():
        jobs._context.park()  # as a round that matched nothing parks its job
        matched.wait(10)
        seen.append(("first", threading.get_ident()))

    def meets_it():
        seen.append(("second", threading.get_ident()))
        matched.set()

    first = work_order.start(waits_for_a_match)
    second = work_order.start(meets_it)
    second.result(10)
    first.result(10)
    assert [label for label, _ in seen] == ["second", "first"]
    assert seen[0][1] != seen[1][1]


def test_a_second_deferred_work_hands_the_first_to_the_thread_ahead_of_it():
    _idle()
    seen = []
    record = _recorder(seen)
    first = work_order.defer(record("first"))
    second = work_order.defer(record("second"))
    assert work_order._deferred is None  # both handed to the thread, in order
    work_order.run_deferred(second)  # not deferred any more: nothing to run here
    assert first.result(10) == "first" and second.result(10) == "second"
    assert [label for label, _ in seen] == ["first", "second"]
