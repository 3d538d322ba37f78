"""The estimators' stores without Spark: Horovod's layout under the prefix, the kind that
Store.create picks, HDFS and DBFS paths (no HDFS is reached: the connection opens on first
use), whole-file writes (atomic, owner-only), syncing a run folder, and the digest that guards
what is unpickled later."""
import os
import stat

import pytest

pytest.importorskip("fsspec")

from hvd_trainer.spark.common import payload  # noqa: E402
from hvd_trainer.spark.common.store import (DBFSLocalStore, FilesystemStore,  # noqa: E402
                                            HDFSStore, LocalStore, Store)


def test_the_layout_under_the_prefix(tmp_path):
    store = Store.create(str(tmp_path))
    prefix = tmp_path.as_uri()
    assert isinstance(store, FilesystemStore) and store.prefix_path == prefix
    assert store.get_train_data_path(3) == f"{prefix}/intermediate_train_data.3"
    assert store.get_val_data_path() == f"{prefix}/intermediate_val_data"
    assert store.get_test_data_path(1) == f"{prefix}/intermediate_test_data.1"
    assert store.get_checkpoint_path("r") == store.get_run_path("r") == f"{prefix}/runs/r"
    assert store.get_logs_path("r") == f"{prefix}/runs/r/logs"
    assert store.get_checkpoint_filename() == "checkpoint"
    assert LocalStore(str(tmp_path), save_runs=False).get_checkpoint_path("r") is None
    remote = store.to_remote("r", 2)
    assert remote.train_data_path == store.get_train_data_path(2)
    assert remote.checkpoint_path == f"{prefix}/runs/r"


def test_create_picks_hdfs_and_dbfs(monkeypatch):
    store = Store.create("hdfs://namenode01:8020/user/test")
    assert isinstance(store, HDFSStore)
    assert store.get_full_path("/output") == "hdfs://namenode01:8020/output"
    assert store.get_localized_path("hdfs://namenode01:8020/user/x") == "/user/x"
    default = HDFSStore("/user/test")
    assert default.get_full_path("/a") == "hdfs:///a" and default.prefix_path == "hdfs:///user/test"
    with pytest.raises(ValueError, match="is not an HDFS URL"):
        HDFSStore("s3://bucket/path")
    assert not isinstance(Store.create("dbfs:/tmp/x"), DBFSLocalStore)  # not on Databricks
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "13.3")
    dbfs = Store.create("dbfs:/tmp/x")
    assert isinstance(dbfs, DBFSLocalStore) and dbfs.prefix_path == "file:///dbfs/tmp/x"
    assert dbfs.get_localized_path(dbfs.get_run_path("r")) == "/dbfs/tmp/x/runs/r"
    with pytest.raises(ValueError, match="is not a DBFS path"):
        DBFSLocalStore("/tmp/x")


def test_writes_are_whole_owner_only_and_synced(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    path = store.join_path(store.get_run_path("r"), "checkpoint")
    store.write_bytes(path, b"one")
    store.write_bytes(path, b"two")
    assert store.read(path) == b"two" and store.exists(path)
    local = store.get_localized_path(path)
    assert stat.S_IMODE(os.stat(local).st_mode) == 0o600
    assert os.listdir(os.path.dirname(local)) == ["checkpoint"]  # no temporary left behind
    run = tmp_path / "local_run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "events").write_bytes(b"e")
    store.sync_fn("r")(str(run))
    assert store.read(store.join_path(store.get_logs_path("r"), "events")) == b"e"


def test_a_damaged_payload_is_refused_before_it_is_loaded():
    packed = payload.pack(b"state")
    assert payload.unpack(packed, "x") == b"state"
    assert payload.from_text(payload.to_text(b"abc"), "x") == b"abc"
    with pytest.raises(ValueError, match="the checkpoint c does not match its digest"):
        payload.unpack(packed[:-1] + b"X", "the checkpoint c")
    with pytest.raises(ValueError, match="is not a file that hvd_trainer wrote"):
        payload.unpack(b"pickle data", "y")
