"""The steady-state fast path (agreement.again, plans.Known.again): a host allreduce or
broadcast identical to the calling thread's last one on its communicator skips its plan's
lookup and checks and claims the communicator at once, and falls back to the full path on
anything that differs. Ranks are threads of one process (test_agreement_fallbacks' World);
each test checks the results against NumPy and that the fast path was taken where it says.
"""
import threading

import numpy as np
import pytest

import hvd_trainer as hvd
from hvd_trainer.coordination import agreement, records
from hvd_trainer.coordination.messages import MismatchError
from hvd_trainer.runtime import runtime
from test_agreement_fallbacks import SECONDS, Rank, World, local_world, on_ranks  # noqa: F401


@pytest.fixture
def fast(monkeypatch):
    """Each rank thread's collectives go to its own communicator (the comm its work is given
    in ``comms``); returns a per-thread count of calls that took the fast path."""
    mine = threading.local()
    taken = {}
    original = agreement.again

    def communicator(ps):
        return mine.comm

    def again(comm, kind, name):
        call = original(comm, kind, name)
        if call is not None:
            key = (threading.current_thread().name, comm.rank)
            taken[key] = taken.get(key, 0) + 1
        return call
    monkeypatch.setattr(runtime, "communicator", communicator)
    monkeypatch.setattr(agreement, "again", again)

    def bind(comm):
        mine.comm = comm
    return bind, taken


def values(rank, shape=(4,)):
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 10 * rank


def twice(bind, comm, name):
    """Bind this rank thread to ``comm`` and sum its values twice under ``name`` (the second
    call takes the fast path)."""
    bind(comm)
    for _ in range(2):
        hvd.allreduce(values(comm.rank), op=hvd.Sum, name=name)


def test_a_repeated_allreduce_takes_the_fast_path_and_moves_one_record(fast):
    bind, taken = fast

    def work(comm):
        bind(comm)
        return [hvd.allreduce(values(comm.rank), op=hvd.Sum) for _ in range(5)]
    for size in (2, 3, 5):
        taken.clear()
        results, comms = on_ranks(size, work)
        want = sum(values(r) for r in range(size))
        for rank, outputs in enumerate(results):
            assert all(np.array_equal(o, want) for o in outputs), outputs
            assert taken[("rank", rank)] == 4  # every call after the first
        # Per call and rank: the 208-byte record, whatever the rank count (and the carrier).
        assert all(c.sent == [208] * 5 for c in comms)


def test_a_shape_changed_on_one_rank_falls_back_and_raises_on_every_rank(fast):
    bind, taken = fast

    def work(comm):
        twice(bind, comm, "x")
        try:
            hvd.allreduce(values(comm.rank, (5,) if comm.rank == 1 else (4,)), op=hvd.Sum,
                          name="x")
        except MismatchError as e:
            error = str(e)
        else:
            error = None
        return error, hvd.allreduce(values(comm.rank), op=hvd.Sum, name="x")  # no cascade
    results, _ = on_ranks(3, work)
    want = ("allreduce 'x': ranks disagree on shape of tensor 0 'x' "
            "(rank 0: (4,), rank 1: (5,), rank 2: (4,))")
    assert [r[0] for r in results] == [want] * 3
    assert all(np.array_equal(r[1], sum(values(k) for k in range(3))) for r in results)
    # The second "x" on every rank; the third on ranks 0 and 2, whose records still met rank
    # 1's; the call after the error took the full path.
    assert [taken[("rank", r)] for r in range(3)] == [2, 1, 2]


def test_a_new_name_on_one_rank_falls_back_and_raises_on_every_rank(fast):
    bind, taken = fast

    def work(comm):
        twice(bind, comm, "a")
        with pytest.raises(RuntimeError) as raised:
            hvd.allreduce(values(comm.rank), op=hvd.Sum, name="b" if comm.rank == 2 else "a")
        return type(raised.value), hvd.allreduce(values(comm.rank), op=hvd.Sum, name="c")
    results, _ = on_ranks(3, work)
    for kind, after in results:
        assert issubclass(kind, RuntimeError)
        assert np.array_equal(after, sum(values(k) for k in range(3)))
    assert all(taken[("rank", r)] >= 2 for r in range(3))  # the second "a", the "b" or "a"


def test_a_joined_rank_gets_the_full_description_while_the_others_repeat(fast):
    # Ranks 0 and 1 repeat an allreduce on the fast path while rank 2 has joined: their
    # records carry the joined bit back, so the call takes the full exchange, rank 2 serves
    # it with zeros, and the sum is theirs alone; then every rank joins, and the next call
    # is the fast path's again.
    bind, taken = fast

    def work(comm):
        bind(comm)
        first = hvd.allreduce(values(comm.rank), op=hvd.Sum)
        if comm.rank == 2:
            hvd.join()
            return first, None, hvd.allreduce(values(comm.rank), op=hvd.Sum)
        served = hvd.allreduce(values(comm.rank), op=hvd.Sum)
        hvd.join()
        return first, served, hvd.allreduce(values(comm.rank), op=hvd.Sum)
    results, _ = on_ranks(3, work)
    every = sum(values(k) for k in range(3))
    for rank, (first, served, after) in enumerate(results):
        assert np.array_equal(first, every) and np.array_equal(after, every)
        if rank < 2:
            assert np.array_equal(served, values(0) + values(1))
    assert taken[("rank", 0)] >= 1 and taken[("rank", 1)] >= 1


def test_a_reset_starts_from_nothing_kept(fast):
    # The same threads make the same Average on 3 ranks, then on a new 2-rank communicator
    # (an elastic reset's): Average's 1/size is the new one's, not the kept plan's.
    bind, taken = fast
    old, new = World(3), World(2)
    comms = [Rank(old, r) for r in range(3)], [Rank(new, r) for r in range(2)]
    results = [None] * 3

    def run(rank):
        try:
            outputs = []
            for world in comms:
                if rank < len(world):
                    bind(world[rank])
                    outputs.append([hvd.allreduce(values(rank)) for _ in range(2)])
            results[rank] = outputs
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            results[rank] = e
    threads = [threading.Thread(target=run, args=(r,), name="rank") for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS * 2)
    mean3 = sum(values(k) for k in range(3)) / 3
    mean2 = (values(0) + values(1)) / 2
    for rank in range(2):
        (a, b), (c, d) = results[rank]
        assert np.allclose(a, mean3) and np.allclose(b, mean3)
        assert np.allclose(c, mean2) and np.allclose(d, mean2), (c, d)
        assert taken[("rank", rank)] == 2  # the second call on each communicator


def test_another_thread_or_an_error_before_takes_the_full_path(fast):
    # A call after one that raised (here an in-place call on a strided array, an argument
    # error raised on every rank) runs its checks again, and so does the same call from
    # another thread; both work.
    bind, taken = fast

    def work(comm):
        bind(comm)
        data = values(comm.rank, (4, 4))
        hvd.allreduce_(data.copy(), op=hvd.Sum)
        with pytest.raises(ValueError, match="C-contiguous"):
            hvd.allreduce_(np.ones((4, 8), np.float32)[:, ::2], op=hvd.Sum)
        before = taken.get(("rank", comm.rank), 0)
        after_error = hvd.allreduce_(data.copy(), op=hvd.Sum)
        other = {}
        helper = threading.Thread(target=lambda: (bind(comm), other.setdefault(
            "out", hvd.allreduce_(data.copy(), op=hvd.Sum))), name="helper")
        helper.start()
        helper.join(SECONDS)
        return before, taken.get(("rank", comm.rank), 0), after_error, other["out"]
    results, _ = on_ranks(3, work)
    want = sum(values(k, (4, 4)) for k in range(3))
    for before, after, after_error, other in results:
        assert before == after == 0
        assert np.array_equal(after_error, want) and np.array_equal(other, want)


def test_a_repeated_broadcast_takes_the_fast_path_and_a_changed_root_falls_back(fast,
                                                                                monkeypatch):
    bind, taken = fast
    monkeypatch.setattr(hvd.global_process_set, "ranks", [0, 1, 2])  # roots of the 3 ranks

    def work(comm):
        bind(comm)
        out = [hvd.broadcast(values(comm.rank), 1) for _ in range(3)]
        try:
            hvd.broadcast(values(comm.rank), 2 if comm.rank == 0 else 1)
        except MismatchError as e:
            error = str(e)
        objects = [hvd.broadcast_object({"rank": comm.rank}, 2) for _ in range(2)]
        return out, error, hvd.broadcast_(values(comm.rank), 2), objects
    results, _ = on_ranks(3, work)
    for rank, (out, error, last, objects) in enumerate(results):
        assert all(np.array_equal(o, values(1)) for o in out)
        assert objects == [{"rank": 2}] * 2
        assert "root_rank" in error and "rank 0: 2, rank 1: 1" in error, error
        assert np.array_equal(last, values(2))
        # The repeats; and ranks 1 and 2 made the call that raised on the fast path too.
        assert taken[("rank", rank)] == (2 if rank == 0 else 3) + 2  # and broadcast_object


def gathers(comm):
    """How many carrier gathers ``comm`` made."""
    return sum(n for kind, n in comm.moved.items() if kind[0] == "repeated allgather")


def test_a_small_broadcast_rides_in_the_roots_record_whatever_the_root(fast, monkeypatch):
    # broadcast_object and broadcast of at most 128 bytes on the fast path: one exchange, no
    # gather; roots and lengths change from call to call (a byte left from a longer payload
    # of another root would corrupt the next), each result the root's own object.
    bind, taken = fast
    monkeypatch.setattr(hvd.global_process_set, "ranks", [0, 1, 2])

    def mine(rank, k):
        return {"rank": rank, "k": k, "pad": "x" * (40 - 9 * k)}

    def work(comm):
        bind(comm)
        hvd.broadcast_object(None, 0)  # a first call: its exchange makes the buffers
        gathered, sent = gathers(comm), len(comm.sent)
        objects = [hvd.broadcast_object(mine(comm.rank, k), k % 3) for k in range(5)]
        phase = (gathers(comm) - gathered, comm.sent[sent:])
        small = [hvd.broadcast(values(comm.rank, (8,)), 2)]  # the full path: gathered
        gathered, sent = gathers(comm), len(comm.sent)
        small += [hvd.broadcast(values(comm.rank, (8,)), 2) for _ in range(3)]
        return objects, small, [phase, (gathers(comm) - gathered, comm.sent[sent:])]
    results, _ = on_ranks(3, work)
    for rank, (objects, small, phases) in enumerate(results):
        assert objects == [mine(k % 3, k) for k in range(5)]
        assert all(np.array_equal(s, values(2, (8,))) for s in small)
        # One record exchange a call, no gather.
        assert phases == [(0, [208] * 5), (0, [208] * 3)]
        assert taken[("rank", rank)] == 1 + 5 + 3  # all but the first broadcast's


def test_a_broadcast_over_128_bytes_goes_on_through_the_carrier(fast):
    bind, _ = fast

    def work(comm):
        bind(comm)
        big = {"rank": comm.rank, "pad": "y" * 300}
        got = [hvd.broadcast_object(big, 0) for _ in range(3)]
        return got, gathers(comm)
    results, _ = on_ranks(3, work)
    for got, gathered in results:
        assert got == [{"rank": 0, "pad": "y" * 300}] * 3
        assert gathered == 3


def test_a_small_broadcast_rides_in_the_record_where_the_carrier_has_no_room(fast,
                                                                             monkeypatch):
    # 300 ranks: the carrier has no room from 257 ranks on, the record's 128 bytes are the
    # same at any rank count. Only the record can give the other ranks the root's values
    # here (the threads' communicators have no data phase of their own that would).
    bind, _ = fast
    size = 300
    monkeypatch.setattr(hvd.global_process_set, "ranks", list(range(size)))

    def work(comm):
        bind(comm)
        hvd.broadcast_object(None, 0)
        got = [hvd.broadcast(values(comm.rank, (8,)), 7) for _ in range(3)]
        return got, hvd.broadcast_object({"from": comm.rank}, 299), gathers(comm)
    results, comms = on_ranks(size, work)
    assert records.room(comms[0]) == 0
    for got, obj, gathered in results:  # each first broadcast took the full path
        assert all(np.array_equal(g, values(7, (8,))) for g in got[1:])
        assert obj == {"from": 299} and gathered == 0
