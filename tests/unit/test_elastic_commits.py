"""Elastic commits in a one-process world: arrays copied out of the pickle and back exactly,
and the folders commits go to (memory, or disk when memory has no room or the host has no
/dev/shm), against values and files made by hand."""
import errno
import os
import shutil
import tempfile

import numpy as np
import pytest

from hvd_trainer import elastic
from hvd_trainer.elastic import store
from hvd_trainer.runtime import files
from hvd_trainer_launch import protocol

SECRET = "0123456789abcdef"


@pytest.fixture
def hosts_folders(tmp_path, monkeypatch):
    """A /dev/shm and a temporary folder of the test's own, and the job's folder in the
    first, as hvdrun makes it: returns (memory folder, disk folder)."""
    memory, disk = tmp_path / "shm", tmp_path / "tmp"
    memory.mkdir()
    disk.mkdir()
    monkeypatch.setattr(protocol, "MEMORY_ROOT", str(memory))
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    monkeypatch.setenv(protocol.ELASTIC_DIR_VARIABLE, str(memory / "hvd_elastic.job"))
    monkeypatch.setenv(protocol.ELASTIC_DISK_DIR_VARIABLE, str(disk / "hvd_elastic_disk.job"))
    monkeypatch.setenv(protocol.SECRET_VARIABLE, SECRET)
    return memory / "hvd_elastic.job", disk / "hvd_elastic_disk.job"


def commits(folder):
    return sorted(p.name for p in folder.glob("rank0.*.commit")) if folder.exists() else []


def commit(state, step):
    state.step = step
    state.commit()
    store.writer.wait()


def recovered_step():
    fresh = elastic.ObjectState(step=0)
    fresh.recover()
    return fresh.step


def test_commits_go_to_memory_and_to_disk_while_memory_has_no_room(hosts_folders, monkeypatch,
                                                                    caplog):
    memory, disk = hosts_folders
    state = elastic.ObjectState(step=0)
    state.recover()
    commit(state, 1)
    assert commits(memory) == ["rank0.000000000001.commit"] and commits(disk) == []
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(
        free=100 if str(path) == str(memory) else usage(path).free))
    for step in (2, 3):
        commit(state, step)
    # Commit 1 is older than the one before the newest: removed from memory.
    assert commits(memory) == [] and commits(disk) == ["rank0.000000000002.commit",
                                                       "rank0.000000000003.commit"]
    warned = [r.getMessage() for r in caplog.records if "on disk" in r.getMessage()]
    assert len(warned) == 1 and f"{memory} has 0 MiB free" in warned[0]
    assert recovered_step() == 3
    monkeypatch.setattr(shutil, "disk_usage", usage)  # room again
    commit(state, 4)
    assert commits(memory) == ["rank0.000000000004.commit"]
    assert commits(disk) == ["rank0.000000000003.commit"]
    assert recovered_step() == 4  # the newest of both folders


def test_a_full_memory_folder_during_the_write_sends_that_commit_to_disk(hosts_folders,
                                                                         monkeypatch):
    memory, disk = hosts_folders
    write = files.write_signed

    def full(path, *args, **kwargs):
        if path.startswith(str(memory)):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, *args, **kwargs)

    monkeypatch.setattr(files, "write_signed", full)
    state = elastic.ObjectState(step=0)
    state.recover()
    commit(state, 1)
    state.check_host_updates()  # no failure to report
    assert commits(memory) == [] and commits(disk) == ["rank0.000000000001.commit"]
    assert recovered_step() == 1


def test_a_host_without_dev_shm_writes_commits_to_the_folder_on_disk(hosts_folders,
                                                                     monkeypatch):
    memory, disk = hosts_folders
    memory.parent.rmdir()  # this host has no /dev/shm
    state = elastic.ObjectState(step=0)
    state.recover()
    commit(state, 1)
    assert not memory.parent.exists()
    assert commits(disk) == ["rank0.000000000001.commit"]
    assert recovered_step() == 1


def test_a_failed_write_is_raised_at_the_next_check_naming_the_file(hosts_folders,
                                                                    monkeypatch):
    def broken(path, *args, **kwargs):
        raise OSError(errno.EIO, "simulated I/O error")

    monkeypatch.setattr(files, "write_signed", broken)
    state = elastic.ObjectState(step=0)
    state.recover()
    commit(state, 1)  # returns: the write fails in the background
    with pytest.raises(OSError, match=r"rank 0 could not write commit 1 to '.*shm/hvd_elastic"
                                      r"\.job/rank0\.000000000001\.commit' \(\[Errno 5\] "
                                      r"simulated I/O error\); check that folder"):
        state.check_host_updates()
    state.check_host_updates()  # reported once


def test_temporary_files_of_earlier_lives_are_removed_at_recovery(hosts_folders, monkeypatch):
    memory, _ = hosts_folders
    files.private_folder(str(memory))
    earlier = memory / ".rank1.000000000007.commit.life0.abcdefgh.tmp"
    mine = memory / ".rank1.000000000007.commit.life2.abcdefgh.tmp"
    other = memory / ".states.abcdefgh.tmp"
    for path in (earlier, mine, other):
        path.write_bytes(b"a killed writer's partial file")
    monkeypatch.setenv(protocol.RESTART_VARIABLE, "2")
    elastic.ObjectState(step=0).recover()
    assert not earlier.exists() and mine.exists() and other.exists()


def arrays():
    """Arrays of many kinds, each with its own values."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((6, 8))
    return {
        "float32": base.astype(np.float32),
        "float16": base.astype(np.float16),
        "int8": (base * 50).astype(np.int8),
        "bool": base > 0,
        "complex": base[:3] + 1j * base[3:],
        "scalar": np.array(2.5),
        "record": np.array([(1, 2.0), (3, 4.0)], dtype=[("a", np.int32), ("b", np.float64)]),
        "fortran": np.asfortranarray(base),
        "strided": base[::2, 1::3],
        "objects": np.array([{"a": 1}, None], dtype=object),
        "empty": np.zeros((0, 4)),
    }


def assert_same_arrays(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert got[name].tolist() == want[name].tolist(), name
    assert got["fortran"].flags.f_contiguous


def test_arrays_of_every_kind_come_back_exactly_from_memory_and_from_disk(hosts_folders):
    values = arrays()
    reference = {name: array.copy() for name, array in values.items()}
    shared = values["float32"]
    state = elastic.ObjectState(step=0, arrays=values, same=[shared, shared])
    state.recover()
    commit(state, 1)
    for array in values.values():  # work after the commit, lost by the restore
        if array.dtype != object:
            array[...] = np.zeros_like(array)
    state.restore()
    assert_same_arrays(state.arrays, reference)
    first, second = state.same
    assert first is second  # one array in the commit, one after the restore
    np.testing.assert_array_equal(first, reference["float32"])
    fresh = elastic.ObjectState(step=0, arrays=None, same=None)
    fresh.recover()
    assert_same_arrays(fresh.arrays, reference)


def test_a_restore_gets_the_last_commit_while_buffers_are_reused(hosts_folders):
    state = elastic.ObjectState(step=0, weights=np.zeros(1000))
    state.recover()
    for step in range(1, 6):
        state.weights = np.arange(1000) * float(step)
        state.commit()
    state.weights[:] = -1
    state.restore()
    np.testing.assert_array_equal(state.weights, np.arange(1000) * 5.0)


def test_a_commit_folder_removed_while_the_job_runs_is_made_again(hosts_folders, caplog):
    memory, _ = hosts_folders
    state = elastic.ObjectState(step=0)
    state.recover()
    commit(state, 1)
    shutil.rmtree(memory)  # e.g. rm -rf /dev/shm/hvd_elastic.*
    commit(state, 2)
    commit(state, 3)
    state.check_host_updates()  # no failure to report
    assert commits(memory) == ["rank0.000000000002.commit", "rank0.000000000003.commit"]
    assert any("was removed while the job ran (its commits are lost); making it again"
               in r.getMessage() for r in caplog.records)
    assert recovered_step() == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder of another user needs root to make "
                                               "(run the tests as root)")
def test_a_commit_folder_of_another_user_is_left_out_with_a_warning(hosts_folders, caplog):
    memory, disk = hosts_folders
    disk.mkdir(mode=0o700)
    os.chown(disk, 65534, 65534)  # made first by another user
    state = elastic.ObjectState(step=0)
    state.recover()
    commit(state, 1)
    commit(state, 2)
    state.check_host_updates()  # no failure to report
    assert commits(memory) == ["rank0.000000000001.commit", "rank0.000000000002.commit"]
    assert list(disk.iterdir()) == []
    warned = [r.getMessage() for r in caplog.records if "leaving it out" in r.getMessage()]
    assert len(warned) == 1 and "belongs to user id 65534" in warned[0]
    assert recovered_step() == 2


@pytest.mark.parametrize("allowed", [False, True])
def test_a_restart_without_a_commit_after_one_was_written_fails_unless_allowed(
        hosts_folders, monkeypatch, caplog, allowed):
    monkeypatch.setenv(protocol.RESTART_VARIABLE, "1")
    monkeypatch.setenv(protocol.COMMITTED_VARIABLE, "4")  # hvdrun heard of commit 4
    if allowed:
        monkeypatch.setenv(protocol.ALLOW_FRESH_START_VARIABLE, "1")
        assert recovered_step() == 0
        assert any("training starts again from the initial state" in r.getMessage()
                   for r in caplog.records)
    else:
        with pytest.raises(elastic.CommitsLostError, match=r"restart 1 of the elastic job finds "
                           r"no commit on any rank, though an earlier life wrote commit 4.*"
                           r"--elastic-allow-fresh-start"):
            recovered_step()
    monkeypatch.setenv(protocol.COMMITTED_VARIABLE, "0")  # no life wrote one: a plain start
    assert recovered_step() == 0


@pytest.mark.parametrize("name", ["HVD_ELASTIC_RESTART", "HVD_ELASTIC_GENERATION",
                                  "HVD_ELASTIC_COMMITTED"])
def test_a_malformed_elastic_variable_is_named(hosts_folders, monkeypatch, name):
    monkeypatch.setenv(name, "two")
    with pytest.raises(ValueError, match=f"{name}='two' is not a whole number >= 0"):
        recovered_step()
