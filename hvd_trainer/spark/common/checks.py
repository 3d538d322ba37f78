"""The estimators' checks on the driver, before any training task starts: each error names
what is wrong and the fix (columns and shapes: :mod:`hvd_trainer.spark.common.prepare`)."""
import os
import uuid
from typing import Any

import cloudpickle

__all__ = ["check_picklable", "check_num_proc", "check_store_shared", "check_store"]


def check_picklable(what: str, value: Any) -> bytes:
    """``value`` pickled (cloudpickle), or ValueError saying it cannot travel to the ranks."""
    try:
        return cloudpickle.dumps(value)
    except Exception as error:
        raise ValueError(f"the {what} cannot be pickled, so it cannot travel to the ranks: "
                         f"{type(error).__name__}: {error}; define it at module level or in "
                         "__main__, without open files, locks or sessions") from error


def check_num_proc(num_proc: int) -> None:
    """The active Spark cluster has ``num_proc`` task slots (a barrier job needs them all)."""
    from pyspark import SparkContext
    context = SparkContext._active_spark_context
    if context is None:
        raise ValueError("the Spark estimators need an active SparkSession: create one first "
                         "(SparkSession.builder...getOrCreate())")
    if num_proc < 1:
        raise ValueError(f"num_proc={num_proc}: give at least 1")
    slots = context.defaultParallelism
    if num_proc > slots:
        raise ValueError(f"num_proc={num_proc} is more than the {slots} task slots of the Spark "
                         "cluster (its default parallelism), and training needs all its "
                         "processes at once: lower num_proc or add executors")


def check_store(store: Any) -> None:
    from hvd_trainer.spark.common.store import Store
    if store is None:
        raise ValueError("store is required: the estimators write the DataFrame and "
                         "checkpoints there (store=Store.create('/shared/folder'))")
    if not isinstance(store, Store):
        raise ValueError(f"store={store!r} is not a Store: use Store.create(prefix_path)")


def check_store_shared(store: Any, num_proc: int) -> None:
    """A store on the local filesystem must be the same folder on the executors: a marker
    the driver writes must be visible to ``num_proc`` tasks (one small Spark job)."""
    if not store.is_local():
        return
    from pyspark import SparkContext
    context = SparkContext._active_spark_context
    marker = store.join_path(store.prefix_path, f".hvd_store_check.{uuid.uuid4().hex}")
    local = store.get_localized_path(marker)
    store.write_bytes(marker, b"")
    try:
        def seen(_):
            import socket
            yield (socket.gethostname(), os.path.exists(local))
        answers = context.parallelize(range(num_proc), num_proc).mapPartitions(seen).collect()
    finally:
        os.unlink(local)
    blind = sorted({host for host, found in answers if not found})
    if blind:
        raise ValueError(f"the store's folder {store.prefix_path} is not visible at the same "
                         f"path on the executors of {', '.join(blind)}: a LocalStore must be "
                         "a folder that the driver and every executor share (NFS), or use "
                         "an HDFSStore or another shared filesystem")
