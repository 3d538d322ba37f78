"""hvd_trainer.elastic in a one-process world: the sampler's split against hand-made
expectations, commits on disk, restore, run()'s exit for new hosts, and the host notice."""
import os
import pickle
import socket
import stat
import threading

import numpy as np
import pytest

from hvd_trainer import elastic
from hvd_trainer.elastic import store
from hvd_trainer.runtime import files
from hvd_trainer_launch import protocol
from hvd_trainer_launch.elastic import Generation

SECRET = "0123456789abcdef"


@pytest.fixture
def job(tmp_path, monkeypatch):
    """An elastic job's variables, as hvdrun sets them: the commit folder and the secret."""
    folder = tmp_path / "commits"
    monkeypatch.setenv(protocol.ELASTIC_DIR_VARIABLE, str(folder))
    monkeypatch.setenv(protocol.SECRET_VARIABLE, SECRET)
    return folder


class _Planted:
    """A pickle that makes a folder when it is loaded: proof that code from a file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def every_rank(sampler, size):
    return [sampler.batches(rank, size) for rank in range(size)]


@pytest.mark.parametrize("num_samples, batch, size", [(12, 2, 3), (13, 2, 3), (7, 3, 2),
                                                      (2, 4, 3), (30, 1, 1)])
def test_sampler_gives_each_sample_once_and_every_rank_the_same_number_of_batches(
        num_samples, batch, size):
    sampler = elastic.ElasticSampler(num_samples, batch, shuffle=True, seed=4)
    split = every_rank(sampler, size)
    seen = [i for batches in split for part in batches for i in part]
    assert sorted(seen) == list(range(num_samples))
    assert len({len(batches) for batches in split}) == 1


def test_sampler_split_by_hand():
    sampler = elastic.ElasticSampler(13, 2, shuffle=False)
    # Rounds of 3 ranks x 2: [0..5], [6..11], and the lone 12 joins the round before it.
    assert every_rank(sampler, 3) == [[[0, 3], [6, 9, 12]], [[1, 4], [7, 10]], [[2, 5], [8, 11]]]


def test_sampler_spreads_what_is_left_over_the_new_ranks():
    sampler = elastic.ElasticSampler(20, 2, shuffle=True, seed=1)
    done = [i for rank in range(3) for i in sampler.batches(rank, 3)[0]]  # one round on 3 ranks
    sampler.record(done)
    split = every_rank(sampler, 2)
    left = [i for batches in split for part in batches for i in part]
    assert sorted(left) == sorted(set(range(20)) - set(done))
    rest = [i for i in sampler.order() if i not in done]  # the epoch's order, minus the done
    assert [split[0][0], split[1][0]] == [rest[0:4:2], rest[1:4:2]]


def test_record_batch_marks_the_batch_at_that_position_of_the_iteration():
    sampler = elastic.ElasticSampler(9, 4, shuffle=False)
    with pytest.raises(ValueError, match="no iteration has started"):
        sampler.record_batch(0)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    sampler.record_batch(1)
    assert list(sampler) == [[0, 1, 2, 3], [8]]
    with pytest.raises(ValueError, match="the current iteration has 2 batches"):
        sampler.record_batch(2)


def test_sampler_epoch_changes_the_order_and_clears_the_record():
    sampler = elastic.ElasticSampler(50, 5, shuffle=True, seed=2)
    first = sampler.order()
    sampler.record(range(10))
    sampler.set_epoch(1)
    assert not sampler.processed.any()
    assert not np.array_equal(first, sampler.order())
    np.testing.assert_array_equal(np.sort(sampler.order()), np.arange(50))


def test_commit_survives_the_process_and_restore_goes_back(job):
    sampler = elastic.ElasticSampler(10, 2, shuffle=False)
    state = elastic.ObjectState(epoch=0, weights=np.zeros(3), sampler=sampler)
    state.recover()
    state.epoch, state.weights = 1, np.array([1.0, 2.0, 3.0])
    sampler.record([0, 1, 2])
    state.commit()
    state.epoch, state.weights = 2, np.array([9.0, 9.0, 9.0])
    sampler.record([3])
    state.commit()
    state.epoch = 3
    store.writer.wait()  # commits reach the folder in the background
    assert len(list(job.glob("rank0.*.commit"))) == 2  # the newest and the one before
    state.restore()
    assert state.epoch == 2
    # A new process: a fresh state object finds the newest commit on the disk.
    again = elastic.ElasticSampler(10, 2, shuffle=False)
    fresh = elastic.ObjectState(epoch=0, weights=np.zeros(3), sampler=again)
    fresh.recover()
    assert fresh.epoch == 2 and fresh.sampler is again
    np.testing.assert_array_equal(fresh.weights, [9.0, 9.0, 9.0])
    assert again.batches(0, 1) == [[4, 5], [6, 7], [8, 9]]


def test_restore_before_anything_is_committed_says_what_to_do():
    with pytest.raises(ValueError, match="nothing committed yet"):
        elastic.ObjectState(step=0).restore()


def test_reset_callbacks_run_after_a_restart_only(job, monkeypatch):
    calls = []
    for restart, expected in (("0", []), ("2", ["reset"])):
        monkeypatch.setenv(protocol.RESTART_VARIABLE, restart)
        state = elastic.ObjectState(step=0)
        state.register_reset_callbacks([lambda: calls.append("reset")])
        calls.clear()
        state.recover()
        assert calls == expected


def test_new_hosts_end_the_process_for_a_restart_with_the_state_committed(job, monkeypatch):
    server = Generation(SECRET.encode())
    try:
        monkeypatch.setenv(protocol.NOTIFY_VARIABLE, f"127.0.0.1:{server.port}")
        monkeypatch.setenv(protocol.GENERATION_VARIABLE, "0")
        state = elastic.ObjectState(step=0)

        @elastic.run
        def train(state):
            for state.step in range(1, 100):
                state.check_host_updates()  # nothing new yet
                if state.step == 5:
                    server.number += 1  # hvdrun's discovery found other hosts
                    state.check_host_updates()

        with pytest.raises(SystemExit) as leave:
            train(state)
        assert leave.value.code == protocol.RESET_EXIT_CODE
        (commit,) = job.glob("rank0.*.commit")
        data = files.verify(SECRET.encode(), commit.read_bytes(), "commit")
        assert pickle.loads(data) == {"step": 5}
    finally:
        server.close()


def test_a_commit_does_not_wait_for_hvdrun_and_a_later_commit_takes_its_answer(job,
                                                                                monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    answer_now, told = threading.Event(), threading.Event()

    def hvdrun():  # answers rank 0's first question (new hosts: generation 1) when let
        conn, _ = server.accept()
        with conn:
            answer_now.wait(30)
            if protocol.answer_notice(conn, SECRET.encode(), 1) is not None:
                told.set()

    threading.Thread(target=hvdrun, daemon=True).start()
    try:
        monkeypatch.setenv(protocol.NOTIFY_VARIABLE, f"127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv(protocol.GENERATION_VARIABLE, "0")
        state = elastic.ObjectState(step=0)
        state.recover()
        state.step = 1
        state.commit()  # returns while hvdrun has not answered
        answer_now.set()
        assert told.wait(30), "the question of the first commit was not waiting for hvdrun"
        with pytest.raises(elastic.HostsUpdatedInterrupt):
            for state.step in range(2, 300):  # the answer counts at a commit after it came
                state.commit()
                told.wait(0.1)
    finally:
        server.close()


def test_an_unreachable_hvdrun_is_no_host_change(monkeypatch, caplog):
    monkeypatch.setenv(protocol.NOTIFY_VARIABLE, "127.0.0.1:1")
    state = elastic.ObjectState(step=0)
    state.check_host_updates()
    state.check_host_updates()
    assert sum("cannot ask hvdrun" in r.message for r in caplog.records) == 1


def test_commits_are_signed_owner_only_files_in_an_owner_only_folder(job):
    state = elastic.ObjectState(step=1)
    state.recover()
    state.commit()
    store.writer.wait()
    (commit,) = job.glob("rank0.*.commit")
    assert stat.S_IMODE(job.stat().st_mode) == 0o700
    assert stat.S_IMODE(commit.stat().st_mode) == 0o600
    assert pickle.loads(files.verify(SECRET.encode(), commit.read_bytes(), "commit")) == {"step": 1}


def test_a_commit_folder_of_another_user_is_refused_and_nothing_in_it_runs(job):
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root (run the tests as root, e.g. with sudo)")
    job.mkdir(mode=0o700)
    marker = job.parent / "code ran"
    (job / "rank7.999999999999.commit").write_bytes(pickle.dumps(_Planted(str(marker))))
    os.chown(job, 65534, 65534)
    with pytest.raises(OSError, match="rank 0: folder .* belongs to user id 65534"):
        elastic.ObjectState(step=0).recover()
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["unsigned pickle", "another job's", "truncated"])
def test_a_bad_newest_commit_falls_back_to_the_one_before_naming_the_file(job, damage, caplog):
    state = elastic.ObjectState(step=0)
    state.recover()
    for state.step in (1, 2):
        state.commit()
    store.writer.wait()
    marker = job.parent / "code ran"
    newest = job / "rank0.000000000002.commit"
    if damage == "unsigned pickle":
        newest = job / "rank3.000000000009.commit"
        newest.write_bytes(pickle.dumps(_Planted(str(marker))))
    elif damage == "another job's":
        newest.unlink()
        files.write_signed(str(newest), b"another secret", [pickle.dumps({"step": 99})],
                           sync=False)
    else:
        newest.write_bytes(newest.read_bytes()[:-4])
    fresh = elastic.ObjectState(step=0)
    fresh.recover()
    assert fresh.step == (2 if damage == "unsigned pickle" else 1)
    assert not marker.exists()
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and str(newest) in warned[0]
