"""horovod.spark.common.store: where an estimator keeps its prepared data, runs, checkpoints
and logs, on any filesystem fsspec reaches (a shared folder, HDFS through pyarrow, DBFS).

The layout under ``prefix_path`` is Horovod's: ``intermediate_train_data.IDX`` and
``intermediate_val_data.IDX`` (Parquet folders of a prepared DataFrame),
``runs/RUN_ID/checkpoint`` and ``runs/RUN_ID/logs``. Whole files are written to a temporary
name beside the target and renamed over it, so a reader sees the old file or the new one,
never half of one (a checkpoint of a rank that failed mid-write is never taken as the latest).
"""
import abc
import contextlib
import os
import pathlib
import re
import tempfile
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional

import fsspec
from fsspec.core import split_protocol

from hvd_trainer.runtime import files

__all__ = ["Store", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore"]

_DATABRICKS_VARIABLE = "DATABRICKS_RUNTIME_VERSION"


class Store(abc.ABC):
    """Storage of intermediate data and training artifacts under ``prefix_path`` (Horovod's
    Store). ``Store.create(prefix_path)`` picks the kind from the path; the methods below are
    Horovod's. Subclasses say how a path maps to their filesystem."""

    def __init__(self, prefix_path: str, train_path: Optional[str] = None,
                 val_path: Optional[str] = None, test_path: Optional[str] = None,
                 runs_path: Optional[str] = None, save_runs: bool = True,
                 storage_options: Optional[Dict[str, Any]] = None,
                 checkpoint_filename: Optional[str] = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.prefix_path = self.get_full_path(prefix_path)
        self._train_path = self._path_or_default(train_path, "intermediate_train_data")
        self._val_path = self._path_or_default(val_path, "intermediate_val_data")
        self._test_path = self._path_or_default(test_path, "intermediate_test_data")
        self._runs_path = self._path_or_default(runs_path, "runs")
        self._save_runs = save_runs
        self.checkpoint_filename = checkpoint_filename or "checkpoint"

    @staticmethod
    def create(prefix_path: str, *args, **kwargs) -> "Store":
        """The store for ``prefix_path``: HDFSStore for ``hdfs://``, DBFSLocalStore for a DBFS
        path on Databricks, else a FilesystemStore (any fsspec URL, or a local folder)."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if os.environ.get(_DATABRICKS_VARIABLE) and DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    # Paths: full URLs (get_full_path) for Spark, localized ones for the filesystem object.
    def _path_or_default(self, path: Optional[str], default: str) -> str:
        return self.get_full_path(path) if path is not None else \
            self.join_path(self.prefix_path, default)

    @staticmethod
    def join_path(base: str, *names: str) -> str:
        """``base``/``names``... as the store writes paths (with ``/``)."""
        return "/".join([base.rstrip("/"), *names])

    @abc.abstractmethod
    def get_full_path(self, path: str) -> str:
        """``path`` as a URL that Spark and fsspec both read."""

    def get_full_path_fn(self) -> Callable[[str], str]:
        return self.get_full_path

    @abc.abstractmethod
    def get_localized_path(self, path: str) -> str:
        """``path`` as the filesystem object (``fs``) names it."""

    @property
    @abc.abstractmethod
    def fs(self) -> Any:
        """The fsspec filesystem under the store."""

    def get_train_data_path(self, idx: Optional[int] = None) -> str:
        return self._train_path if idx is None else f"{self._train_path}.{idx}"

    def get_val_data_path(self, idx: Optional[int] = None) -> str:
        return self._val_path if idx is None else f"{self._val_path}.{idx}"

    def get_test_data_path(self, idx: Optional[int] = None) -> str:
        return self._test_path if idx is None else f"{self._test_path}.{idx}"

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return self.join_path(self._runs_path, run_id)

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        return self.get_run_path(run_id) if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        return self.checkpoint_filename

    def get_logs_subdir(self) -> str:
        return "logs"

    def get_logs_path(self, run_id: str) -> Optional[str]:
        return self.join_path(self.get_run_path(run_id), self.get_logs_subdir()) \
            if self._save_runs else None

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> List[str]:
        folder = self.get_localized_path(self.get_checkpoint_path(run_id))
        return sorted(name for name in self.fs.ls(folder, detail=False) if name.endswith(suffix))

    # Files.
    def exists(self, path: str) -> bool:
        return self.fs.exists(self.get_localized_path(path))

    def read(self, path: str) -> bytes:
        with self.fs.open(self.get_localized_path(path), "rb") as f:
            return f.read()

    def write_text(self, path: str, text: str) -> None:
        self.write_bytes(path, text.encode())

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` as the whole of ``path``: to a temporary name beside it, then renamed
        over it (locally: O_EXCL, owner-only, never through a link)."""
        local = self.get_localized_path(path)
        parent = local.rsplit("/", 1)[0]
        if self.is_local():
            os.makedirs(parent, mode=0o700, exist_ok=True)
            files.write_atomically(local, data)
            return
        self.fs.makedirs(parent, exist_ok=True)
        temporary = f"{parent}/.{local.rsplit('/', 1)[-1]}.{uuid.uuid4().hex}.tmp"
        with self.fs.open(temporary, "wb") as f:
            f.write(data)
        self.fs.mv(temporary, local)

    def is_local(self) -> bool:
        """Whether the store's filesystem is this machine's (a folder, maybe shared)."""
        return "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                          else (self.fs.protocol,))

    def is_parquet_dataset(self, path: str) -> bool:
        """Whether ``path`` holds Parquet files."""
        return bool(self.parquet_files(path))

    def parquet_files(self, path: str) -> List[str]:
        """The Parquet files of the dataset at ``path`` (localized names, sorted); [] when
        there is none."""
        local = self.get_localized_path(path)
        if not self.fs.exists(local):
            return []
        return sorted(name for name in self.fs.find(local)
                      if name.endswith(".parquet")
                      and not name.rsplit("/", 1)[-1].startswith(("_", ".")))

    def get_parquet_dataset(self, path: str) -> Any:
        """A pyarrow.parquet.ParquetDataset of the files at ``path``."""
        import pyarrow.parquet as pq
        return pq.ParquetDataset(self.parquet_files(path), filesystem=self.fs)

    def get_local_output_dir_fn(self, run_id: str) -> Callable:
        """A context manager giving a temporary local folder for a rank's run output."""
        @contextlib.contextmanager
        def local_run_path() -> Iterator[str]:
            with tempfile.TemporaryDirectory(prefix="hvd_run.") as folder:
                yield folder
        return local_run_path

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A function that copies a local folder's files into the run's folder."""
        run_path = self.get_run_path(run_id)

        def sync(local_run_path: str) -> None:
            for folder, _, names in os.walk(local_run_path):
                relative = os.path.relpath(folder, local_run_path)
                for name in names:
                    parts = [] if relative == "." else relative.split(os.sep)
                    with open(os.path.join(folder, name), "rb") as f:
                        self.write_bytes(self.join_path(run_path, *parts, name), f.read())
        return sync

    def to_remote(self, run_id: str, dataset_idx: Optional[int]) -> Any:
        """The paths and functions a rank needs, as plain attributes (Horovod's view)."""
        view = type("RemoteStore", (), {})()
        view.__dict__.update(
            train_data_path=self.get_train_data_path(dataset_idx),
            val_data_path=self.get_val_data_path(dataset_idx),
            test_data_path=self.get_test_data_path(dataset_idx),
            saving_runs=self.saving_runs(), runs_path=self.get_runs_path(),
            run_path=self.get_run_path(run_id),
            checkpoint_path=self.get_checkpoint_path(run_id),
            logs_path=self.get_logs_path(run_id),
            checkpoint_filename=self.get_checkpoint_filename(),
            logs_subdir=self.get_logs_subdir(),
            get_local_output_dir=self.get_local_output_dir_fn(run_id),
            sync=self.sync_fn(run_id))
        return view


class FilesystemStore(Store):
    """A store on the fsspec filesystem that ``prefix_path``'s protocol names (a plain path: the
    local filesystem, which must be shared by the driver and every executor, e.g. NFS)."""

    def __init__(self, prefix_path: str, *args, **kwargs) -> None:
        protocol, _ = split_protocol(prefix_path)
        self.protocol = protocol or "file"
        options = dict(kwargs.get("storage_options") or {})
        cls = fsspec.get_filesystem_class(self.protocol)
        self._fs = cls(**{**cls._get_kwargs_from_urls(prefix_path), **options})
        super().__init__(prefix_path, *args, **kwargs)

    @property
    def fs(self) -> Any:
        return self._fs

    def get_full_path(self, path: str) -> str:
        if split_protocol(path)[0] is not None:
            return path
        return pathlib.Path(os.path.abspath(path)).as_uri()

    def get_localized_path(self, path: str) -> str:
        return self._fs._strip_protocol(path)

    def get_filesystem(self) -> Any:
        return self._fs

    @classmethod
    def matches(cls, path: str) -> bool:
        return True


class LocalStore(FilesystemStore):
    """A store in a folder that the driver and every executor see at the same path (NFS, a
    single machine); Horovod's name for a FilesystemStore on ``file://``."""


class HDFSStore(Store):
    """A store on HDFS, through pyarrow's HadoopFileSystem (libhdfs and a Hadoop client on
    every host). ``prefix_path`` is ``hdfs://HOST:PORT/path``, ``hdfs:///path`` or
    ``/path``; ``host``/``port`` default to the URL's, else ``default`` and 0 (the client's
    configuration). The connection opens on first use."""

    FS_PREFIX = "hdfs://"
    _URL = re.compile(r"^(?:(?P<prefix>[^:/]+://))?(?:(?P<host>[^/:]+))?(?::(?P<port>\d+))?"
                      r"(?P<path>/.*)?$")

    def __init__(self, prefix_path: str, host: Optional[str] = None,
                 port: Optional[int] = None, user: Optional[str] = None,
                 kerb_ticket: Optional[str] = None, driver: str = "libhdfs",
                 extra_conf: Optional[Dict[str, str]] = None, *args, **kwargs) -> None:
        match = self._URL.match(prefix_path)
        if match is None or not match["path"]:
            raise ValueError(f"HDFSStore: cannot read a path from {prefix_path!r}; give "
                             "hdfs://HOST:PORT/path, hdfs:///path or /path")
        if match["prefix"] not in (None, self.FS_PREFIX):
            raise ValueError(f"HDFSStore: {prefix_path!r} is not an HDFS URL (it starts with "
                             f"{match['prefix']!r}, not {self.FS_PREFIX!r}); use Store.create")
        self._url_prefix = prefix_path[:match.start("path")] if match["prefix"] \
            else self.FS_PREFIX
        self._hdfs_kwargs = dict(host=host or match["host"] or "default",
                                 port=int(port or match["port"] or 0), user=user,
                                 kerb_ticket=kerb_ticket, extra_conf=extra_conf)
        self._hdfs = None
        super().__init__(prefix_path, *args, **kwargs)

    @property
    def fs(self) -> Any:
        if self._hdfs is None:
            from fsspec.implementations.arrow import HadoopFileSystem
            self._hdfs = HadoopFileSystem(**self._hdfs_kwargs)
        return self._hdfs

    def __getstate__(self) -> Dict[str, Any]:
        # A connection does not travel: each rank opens its own.
        return {**self.__dict__, "_hdfs": None}

    def get_full_path(self, path: str) -> str:
        return path if self.matches(path) else self._url_prefix + path

    def get_localized_path(self, path: str) -> str:
        return path[len(self._url_prefix):] if path.startswith(self._url_prefix) else path

    @classmethod
    def matches(cls, path: str) -> bool:
        return path.startswith(cls.FS_PREFIX)


class DBFSLocalStore(FilesystemStore):
    """A store on Databricks' DBFS through its local file API (``/dbfs/...``); the prefix may
    be given as ``dbfs:/...``, ``/dbfs/...``, ``file:/dbfs/...`` or ``file:///dbfs/...``."""

    def __init__(self, prefix_path: str, *args, **kwargs) -> None:
        super().__init__(self.normalize_path(prefix_path), *args, **kwargs)

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        return (path.startswith("dbfs:/") and not path.startswith("dbfs://")) or \
            path.startswith(("/dbfs/", "file:///dbfs/", "file:/dbfs/"))

    @staticmethod
    def normalize_path(path: str) -> str:
        """``path`` in the form ``/dbfs/...``."""
        for prefix, keep in (("dbfs:/", "/dbfs/"), ("file:///dbfs/", "/dbfs/"),
                             ("file:/dbfs/", "/dbfs/"), ("/dbfs/", "/dbfs/")):
            if path.startswith(prefix) and not path.startswith("dbfs://"):
                return keep + path[len(prefix):]
        raise ValueError(f"DBFSLocalStore: {path!r} is not a DBFS path; give /dbfs/..., "
                         "dbfs:/..., file:/dbfs/... or file:///dbfs/...")

    def get_full_path(self, path: str) -> str:
        return "file://" + self.normalize_path(path)

    def get_localized_path(self, path: str) -> str:
        return self.normalize_path(path)

    def get_checkpoint_filename(self) -> str:
        return "checkpoint.tf"
