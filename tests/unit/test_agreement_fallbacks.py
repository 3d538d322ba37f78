"""The fixed-size agreement and its fallbacks to the full descriptions, on ranks played by
threads of one process (no MPI): each rank's communicator meets the others' in one sequence
of collectives, as MPI's do, and counts what it moved.

A call the ranks agree on moves one 208-byte record per rank, whatever the rank count, new
name or shape included (the digests are compared, nothing is cached); the full descriptions
travel only when something differs (a name, a shape) or a rank has joined, and a reset (new
communicators, as an elastic reset makes) starts from nothing kept.
"""
import collections
import functools
import threading

import numpy as np
import pytest

import hvd_trainer as hvd
from hvd_trainer.backends import REDUCE_UFUNCS
from hvd_trainer.backends.local import LocalCommunicator
from hvd_trainer.coordination import agreement, records, rounds, scheduler
from hvd_trainer.coordination.messages import MismatchError

SECONDS = 30  # a generous bound on any wait: a protocol that hangs fails instead


class World:
    """Ranks as threads: each :class:`Rank` meets the others' in one sequence of collectives
    (a rank's k-th collective meets every other rank's k-th); ranks that make different
    collectives at the same step are the protocol under test going wrong, and fail."""

    def __init__(self, size):
        self.size = size
        self.cv = threading.Condition()
        self.steps = {}  # step -> {rank: (kind, value)}
        self.done = collections.Counter()  # step -> ranks that have read its values

    def meet(self, rank, step, kind, value):
        """Every rank's value of collective ``step``, once all have made it."""
        with self.cv:
            self.steps.setdefault(step, {})[rank] = (kind, value)
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(self.steps[step]) == self.size, SECONDS):
                raise TimeoutError(f"rank {rank} waited {SECONDS} s in collective {step} "
                                   f"({kind}) for ranks {sorted(set(range(self.size)) - set(self.steps[step]))}")
            made = self.steps[step]
            kinds = {k for k, _ in made.values()}
            values = [made[r][1] for r in range(self.size)]
            self.done[step] += 1
            if self.done[step] == self.size:
                del self.steps[step]
        assert len(kinds) == 1, f"collective {step}: ranks made {sorted(kinds)}"
        return values


class Rank(LocalCommunicator):
    """One rank's communicator in a :class:`World`; ``moved`` counts its collectives by kind
    and ``sent`` the bytes it sent in each agreement exchange."""

    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size
        self.step = 0
        self.moved = collections.Counter()
        self.sent = []

    def _meet(self, kind, value):
        self.step += 1
        self.moved[kind] += 1
        return self.world.meet(self.rank, self.step, kind, value)

    def repeated_allreduce(self, send, recv, op):
        def start():
            self.sent.append(send.nbytes)
            every = self._meet(("repeated allreduce", op, send.nbytes), send.copy())
            recv[...] = functools.reduce(REDUCE_UFUNCS[op], every)
            return _DONE
        return start

    def repeated_allgather(self, send, recv):
        def start():
            every = self._meet(("repeated allgather", send.nbytes), send.copy())
            recv.reshape(self.size, -1)[...] = np.stack([v.reshape(-1) for v in every])
            return _DONE
        return start

    def allreduce(self, buf, op, out=None, kernels=None):
        every = self._meet(("allreduce", op, buf.nbytes), buf.copy())
        (buf if out is None else out)[...] = functools.reduce(REDUCE_UFUNCS[op], every)

    def allgather_object(self, obj):
        return self._meet(("allgather_object",), obj)


class _Done:
    @staticmethod
    def test():
        return True


_DONE = _Done()


@pytest.fixture(autouse=True)
def local_world():
    hvd.init()  # a size-1 world: the runtime the coordination layer reads (settings, names)
    yield


def on_ranks(size, work):
    """Run ``work(comm)`` on ``size`` ranks (threads named alike, as the ranks' main threads
    are, so that their automatic names pair); returns each rank's result or exception and
    its communicator."""
    world = World(size)
    comms = [Rank(world, r) for r in range(size)]
    results = [None] * size

    def run(r):
        try:
            results[r] = work(comms[r])
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            results[r] = e
    threads = [threading.Thread(target=run, args=(r,), name="rank") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS * 2)
    assert not any(t.is_alive() for t in threads), "a rank still waits"
    return results, comms


def allreduce_call(comm, name, shape=(4,), dtype="<f4"):
    """An allreduce's agreement as ops.py makes it: a call agreed on from its signature."""
    with agreement.collective(comm, "allreduce", name) as call:
        call.agree(lambda: {"tensors": [{"name": call.name, "shape": shape, "dtype": dtype}]},
                   signature=(shape, dtype))
        return call.name


def full_exchanges(comm):
    """How many times ``comm`` exchanged full descriptions (a round's lists, or a call's
    description for joined ranks)."""
    return comm.moved[("allgather_object",)]


def agreements(comm):
    return comm.moved[("repeated allreduce", "bor", 208)]


def test_calls_agreed_at_once_move_one_208_byte_record_per_rank_at_any_rank_count():
    # Ten calls, new names and a new shape among them: each is one exchange of 208 bytes per
    # rank, at 2, 3 and 5 ranks, and nothing else (no description, no gathered records).
    def work(comm):
        names = [allreduce_call(comm, None) for _ in range(4)]
        names += [allreduce_call(comm, f"new.{i}") for i in range(4)]
        names += [allreduce_call(comm, "w", shape=(2, 3)) for _ in range(2)]
        return names
    for size in (2, 3, 5):
        results, comms = on_ranks(size, work)
        assert all(r == results[0] for r in results), results
        for comm in comms:
            assert comm.sent == [208] * 10
            assert sum(comm.moved.values()) == agreements(comm) == 10


def test_a_training_steps_agreement_with_flags_moves_the_same_208_bytes():
    # A step's agreement (82 freshness flags, or-ed) at 2 and 5 ranks: 208 bytes each.
    step = {"kind": "trainer step", "name": "step",
            "tensors": [{"name": f"g{i}", "shape": (8,)} for i in range(82)]}

    def work(comm):
        fresh = np.zeros(82, bool)
        fresh[comm.rank] = True
        return [agreement.agree(comm, lambda: step, fresh).tolist() for _ in range(3)]
    for size in (2, 5):
        results, comms = on_ranks(size, work)
        want = [r < size for r in range(82)]
        assert all(r == [want] * 3 for r in results)
        assert all(c.sent == [208] * 3 and sum(c.moved.values()) == 3 for c in comms)


def test_a_name_that_differs_on_one_rank_falls_back_to_the_full_exchange_and_raises():
    # Rank 2 names its call "b" where the others name it "a": the digests differ, so the
    # ranks exchange their pending lists; no key is pending everywhere, every rank waits,
    # and each raises (naming what it waited for); the next call agrees at once again.
    def work(comm):
        try:
            allreduce_call(comm, "b" if comm.rank == 2 else "a")
        except Exception as e:  # noqa: BLE001
            error = e
        else:
            error = None
        before = full_exchanges(comm)
        allreduce_call(comm, "next")
        return error, before, full_exchanges(comm)
    results, comms = on_ranks(3, work)
    for error, before, after in results:
        assert isinstance(error, RuntimeError), error
        assert before >= 1 and after == before  # the next call needed no fallback
    assert str(results[0][0]) == str(results[1][0])
    # Every exchange of a record was the 208-byte one, the rounds' and the next call's.
    assert all(set(c.sent) == {208} and agreements(c) == len(c.sent) >= 2 for c in comms)


def test_a_shape_changed_on_one_rank_falls_back_and_every_rank_names_the_ranks():
    def work(comm):
        try:
            allreduce_call(comm, "x", shape=(5,) if comm.rank == 1 else (4,))
        except MismatchError as e:
            error = str(e)
        else:
            error = None
        fallbacks = full_exchanges(comm)
        allreduce_call(comm, "x")  # the same name again: no cascade
        return error, fallbacks, full_exchanges(comm)
    results, comms = on_ranks(3, work)
    want = ("allreduce 'x': ranks disagree on shape of tensor 0 'x' "
            "(rank 0: (4,), rank 1: (5,), rank 2: (4,))")
    assert [r[0] for r in results] == [want] * 3
    assert all(fallbacks == 1 and after == 1 for _, fallbacks, after in results)
    # Two 208-byte records (the call's and the next one's) and the one full exchange.
    assert all(c.sent == [208, 208] and sum(c.moved.values()) == 3 for c in comms)


def test_a_joined_rank_gets_the_full_description_and_the_others_go_on():
    # Rank 2 has joined: its record carries the joined bit and no digest; the others'
    # digests agree, and one more exchange tells rank 2 what they call (then it would serve
    # it with zeros). Without a joined rank the same call needs none.
    def work(comm):
        if comm.rank == 2:
            sched = scheduler.of(comm)
            sched.take()  # a joined rank holds its turn (see joined.py)
            try:
                record = rounds.JoinedRecord(comm)
                assert record.done()
                return record.read()
            finally:
                sched.give()
        return allreduce_call(comm, "j", shape=(3,))
    results, comms = on_ranks(3, work)
    assert results[:2] == ["j", "j"]
    assert results[2] == {"kind": "allreduce", "name": "j",
                          "tensors": [{"name": "j", "shape": (3,), "dtype": "<f4"}]}
    assert [full_exchanges(c) for c in comms] == [1, 1, 1]
    assert all(agreements(c) == 1 for c in comms)


def test_a_reset_keeps_nothing_of_the_communicators_it_replaces():
    # An elastic reset makes new communicators (here of another size): their schedules,
    # records and automatic names start afresh, and their first calls agree at once.
    def work(comm):
        return [allreduce_call(comm, None) for _ in range(3)]
    first, old = on_ranks(3, work)
    again, new = on_ranks(2, work)
    assert first[0] == again[0] == ["allreduce.noname[rank].0", "allreduce.noname[rank].1",
                                    "allreduce.noname[rank].2"]
    for before, after in zip(old, new):
        assert scheduler.of(after) is not scheduler.of(before)
        assert records.records_of(after) is not records.records_of(before)
    assert all(c.sent == [208] * 3 and sum(c.moved.values()) == 3 for c in new)


def test_a_shutdown_forgets_the_known_reductions_of_its_communicators():
    # plans.py keeps what a repeated allreduce's arguments fix, by communicator (Average's
    # 1/size among it): a reset's new communicator must not meet the old one's.
    from hvd_trainer.collectives import plans
    hvd.allreduce(np.ones(3, np.float32))
    hvd.broadcast(np.ones(3, np.float32), 0)
    for known in (plans.reductions, plans.broadcasts):
        assert any(held[0]() is hvd.global_process_set.comm for held in known.plans.values())
    hvd.shutdown()
    assert not plans.reductions.plans and not plans.broadcasts.plans
    hvd.init()
    assert hvd.allreduce(np.ones(3, np.float32)).tolist() == [1.0, 1.0, 1.0]


def test_a_known_reduction_still_checks_what_can_change_between_calls():
    # The kept plan stands for the checks its key decides (op, factors, dtype, shape), not
    # for the array's layout: an in-place call on a strided array of a known kind raises.
    contiguous = np.ones((4, 4), np.float32)
    hvd.allreduce_(contiguous, op=hvd.Sum)
    with pytest.raises(ValueError, match="C-contiguous"):
        hvd.allreduce_(np.ones((4, 8), np.float32)[:, ::2], op=hvd.Sum)
    with pytest.raises(ValueError, match="is not a reduction operator"):
        hvd.allreduce(contiguous, op="mean")
    assert hvd.allreduce_(contiguous, op=hvd.Sum).tolist() == contiguous.tolist()
