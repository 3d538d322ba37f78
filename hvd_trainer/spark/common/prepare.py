"""horovod.spark.common.util's data preparation: a DataFrame's training columns written once to
Parquet in the store, with what the ranks need to read them back (metadata, row counts).

Vectors (dense or sparse) become arrays of float64, arrays and numeric scalars are written as
they are; every array or vector column must hold one size in every row. The training and
validation rows go to ``intermediate_{train,val}_data.IDX`` in ``num_processes *
partitions_per_process`` files. A second fit on the same DataFrame object with the same
columns, validation and store reuses the files (as Horovod's prepare_data does); a changed
column list, validation or store prepares again. As in Horovod, a new dataset takes the
smallest index that no running prepare_data holds, so that the files of datasets no fit uses
are written over rather than filling the store, and the first after clear_training_cache is 0.
"""
import collections
import contextlib
import numbers
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Union

import numpy as np

__all__ = ["ARRAY", "NOCHANGE", "DatasetProperties", "prepare_data", "get_dataset_properties",
           "is_prepared", "properties_from_parquet",
           "clear_training_cache", "check_shape_compatibility", "check_columns",
           "check_validation", "get_metadata"]

# Horovod's names of a column's intermediate format.
ARRAY = "array"
NOCHANGE = "nochange"
_VALIDATION_SEED = 0  # a fraction splits the same rows into validation on every fit


class DatasetProperties(NamedTuple):
    """What a prepared dataset holds (Horovod's get_dataset_properties, named)."""
    train_rows: int
    val_rows: int
    metadata: Dict[str, Dict[str, Any]]
    avg_row_size: float


class _Prepared(NamedTuple):
    dataframe: Any  # held, so that the key's id() stays this DataFrame's
    properties: DatasetProperties


_lock = threading.Lock()
_by_key: Dict[tuple, int] = {}
_datasets: Dict[int, _Prepared] = {}
_in_use: "collections.Counter[int]" = collections.Counter()  # indices inside prepare_data


def clear_training_cache() -> None:
    """Forget every prepared dataset (the files stay in their stores)."""
    with _lock:
        _by_key.clear()
        _datasets.clear()


def _free_index() -> int:
    """The smallest dataset index that no running prepare_data holds, forgotten by the dataset
    that had it (its files are written over). Called with _lock held."""
    idx = 0
    while _in_use[idx]:
        idx += 1
    for key in [key for key, held in _by_key.items() if held == idx]:
        del _by_key[key]
    _datasets.pop(idx, None)
    return idx


def get_dataset_properties(dataset_idx: int) -> DatasetProperties:
    """The rows, metadata and mean row size of a dataset prepare_data wrote."""
    return _datasets[dataset_idx].properties


def is_prepared(dataset_idx: int) -> bool:
    """Whether this process prepared dataset ``dataset_idx``."""
    return dataset_idx in _datasets


def properties_from_parquet(store: Any, columns: Sequence[str],
                            dataset_idx: Optional[int] = None) -> DatasetProperties:
    """The properties of a Parquet dataset already in the store (``fit_on_parquet`` on files
    this process did not prepare), read from the files' schemas and footers: each column's
    values per row from the first row group (list columns), or 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    train_path = store.get_train_data_path(dataset_idx)
    files = store.parquet_files(train_path)
    if not files:
        raise ValueError(f"the store has no Parquet dataset at {train_path}: prepare one first "
                         "(prepare_data, or fit on a DataFrame)")
    with store.fs.open(files[0], "rb") as f:
        table = pq.ParquetFile(f).read_row_group(0, columns=list(columns))
    metadata = {}
    for name in columns:
        column = table.column(name)
        listed = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
        size = len(column.combine_chunks()[0].values) if listed and len(column) else 1
        element = column.type.value_type if listed else column.type
        metadata[name] = {"spark_data_type": None, "shape": size, "max_size": size,
                          "intermediate_format": ARRAY if listed else NOCHANGE,
                          "is_vector": False, "dtype": element.to_pandas_dtype()}
    train_rows, train_bytes = _rows_and_bytes(store, train_path)
    val_path = store.get_val_data_path(dataset_idx)
    val_rows, val_bytes = _rows_and_bytes(store, val_path if store.parquet_files(val_path)
                                          else None)
    return DatasetProperties(train_rows, val_rows, metadata,
                             (train_bytes + val_bytes) / max(1, train_rows + val_rows))


def check_validation(validation: Union[None, float, str], columns: Sequence[str] = ()) -> None:
    """A validation fraction in [0, 1) or the name of a column of the DataFrame."""
    if validation is None or (isinstance(validation, str) and (not columns
                                                               or validation in columns)):
        return
    if isinstance(validation, str):
        raise ValueError(f"validation={validation!r} names no column of the DataFrame "
                         f"(columns: {', '.join(columns)}); give a column of 0/1 or booleans, "
                         "or a fraction")
    if not isinstance(validation, numbers.Real) or not 0 <= validation < 1:
        raise ValueError(f"validation={validation!r}: give a fraction in [0, 1) or the name "
                         "of a column of 0/1 or booleans")


def check_columns(df: Any, feature_columns: Sequence[str], label_columns: Sequence[str],
                  sample_weight_col: Optional[str] = None) -> None:
    """Every named column exists and holds numbers (scalars, arrays or vectors): ValueError
    naming the column and the fix otherwise."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import ArrayType, BooleanType, NumericType
    if not feature_columns:
        raise ValueError("feature_cols is empty: name the DataFrame columns the model reads")
    if not label_columns:
        raise ValueError("label_cols is empty: name the DataFrame columns the loss compares "
                         "with the model's outputs")
    fields = {field.name: field.dataType for field in df.schema.fields}
    roles = [("feature", c) for c in feature_columns] + [("label", c) for c in label_columns]
    roles += [("sample weight", sample_weight_col)] if sample_weight_col else []
    for role, name in roles:
        if name not in fields:
            raise ValueError(f"{role} column {name!r} is not in the DataFrame (its columns: "
                             f"{', '.join(fields)})")
        kind = fields[name]
        element = kind.elementType if isinstance(kind, ArrayType) else kind
        numeric = isinstance(element, (NumericType, BooleanType)) or isinstance(kind, VectorUDT)
        if not numeric or (role == "sample weight" and not isinstance(kind, NumericType)):
            raise ValueError(
                f"{role} column {name!r} holds {kind.simpleString()}; the estimators train on "
                "numbers: numeric scalars, arrays of numbers or ML vectors"
                + (" (one number per row)" if role == "sample weight" else
                   " (index strings with pyspark.ml.feature.StringIndexer, assemble columns "
                   "with VectorAssembler)"))


def get_metadata(df: Any, columns: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Per column: its Spark type, its number of values per row (``shape``; 1 for scalars)
    and its intermediate format. One Spark aggregation reads the sizes of array and vector
    columns; ValueError when a column's rows differ in size."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType
    fields = {f.name: f.dataType for f in df.schema.fields}
    names = list(columns) if columns is not None else list(fields)
    sized = [n for n in names if isinstance(fields[n], (ArrayType, VectorUDT))]
    sizes = {}
    if sized:
        exprs = []
        for name in sized:
            values = vector_to_array(F.col(name)) if isinstance(fields[name], VectorUDT) \
                else F.col(name)
            exprs += [F.min(F.size(values)).alias(f"min_{name}"),
                      F.max(F.size(values)).alias(f"max_{name}")]
        row = df.agg(*exprs).collect()[0].asDict()
        for name in sized:
            low, high = row[f"min_{name}"], row[f"max_{name}"]
            if low != high:
                raise ValueError(f"column {name!r} holds {low} to {high} values per row; the "
                                 "estimators need the same size in every row (pad or slice it)")
            sizes[name] = low
    metadata = {}
    for name in names:
        kind = fields[name]
        metadata[name] = {
            "spark_data_type": type(kind),
            "shape": sizes.get(name, 1),
            "max_size": sizes.get(name, 1),
            "intermediate_format": ARRAY if name in sizes else NOCHANGE,
            "is_vector": isinstance(kind, VectorUDT),
            "dtype": (np.float64 if isinstance(kind, VectorUDT) else
                      _numpy_type(kind.elementType if isinstance(kind, ArrayType) else kind)),
        }
    return metadata


def _numpy_type(kind: Any) -> Any:
    """The NumPy type of a Spark numeric type."""
    from pyspark.sql import types as T
    table = {T.BooleanType: np.bool_, T.ByteType: np.int8, T.ShortType: np.int16,
             T.IntegerType: np.int32, T.LongType: np.int64, T.FloatType: np.float32,
             T.DoubleType: np.float64}
    return table.get(type(kind), np.float64)


def check_shape_compatibility(metadata: Dict[str, Dict[str, Any]], feature_columns: Sequence[str],
                              label_columns: Sequence[str],
                              input_shapes: Optional[Sequence[Sequence[int]]] = None,
                              output_shapes: Optional[Sequence[Sequence[int]]] = None,
                              label_shapes: Optional[Sequence[Sequence[int]]] = None) -> None:
    """Each shape given takes as many values as its column holds per row (a -1 dimension
    counts as one row); ValueError naming the column otherwise."""
    checks = [("input_shapes", input_shapes, feature_columns, "feature_cols"),
              ("output_shapes", output_shapes, label_columns, "label_cols"),
              ("label_shapes", label_shapes, label_columns, "label_cols")]
    for what, shapes, columns, names in checks:
        if shapes is None:
            continue
        if len(shapes) != len(columns):
            raise ValueError(f"{what} has {len(shapes)} shapes for the {len(columns)} columns "
                             f"of {names}: give one shape per column")
        for index, (column, shape) in enumerate(zip(columns, shapes)):
            size = metadata[column]["shape"]
            wanted = int(abs(np.prod(shape)))
            if size is not None and size != wanted:
                raise ValueError(f"{names[:-5]} column {column!r} holds {size} values per "
                                 f"row, but {what}[{index}]={list(shape)} takes {wanted}: "
                                 "make the shape match the column")


def _training_frame(df: Any, columns: Sequence[str], metadata: Dict[str, Dict[str, Any]],
                    validation: Union[None, float, str]) -> Any:
    """``df``'s ``columns`` (and a validation column), vectors as float64 arrays."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    kept = [vector_to_array(F.col(c)).alias(c) if metadata[c]["is_vector"] else F.col(c)
            for c in columns]
    return df.select(*kept, *([F.col(validation)] if isinstance(validation, str) else []))


def _split(df: Any, validation: Union[None, float, str]) -> tuple:
    """(training rows, validation rows or None)."""
    from pyspark.sql import functions as F
    if validation is None or validation == 0:
        return df, None
    if isinstance(validation, str):
        chosen = F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
        return (df.filter(~chosen).drop(validation), df.filter(chosen).drop(validation))
    train, val = df.randomSplit([1.0 - validation, validation], seed=_VALIDATION_SEED)
    return train, val


def _write(df: Any, store: Any, path: str, partitions: int) -> None:
    df.repartition(partitions).write.mode("overwrite").parquet(path)
    if not store.is_parquet_dataset(path):
        raise RuntimeError(f"Spark wrote no Parquet file at {path} that the driver can read: "
                           "the store's folder must be shared by the driver and every "
                           "executor (a LocalStore on NFS, HDFS, DBFS)")


def _rows_and_bytes(store: Any, path: Optional[str]) -> tuple:
    """(rows, uncompressed bytes) of the Parquet files at ``path``, from their footers."""
    import pyarrow.parquet as pq
    if path is None:
        return 0, 0
    rows = size = 0
    for name in store.parquet_files(path):
        with store.fs.open(name, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        rows += meta.num_rows
        size += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return rows, size


def _prepare(num_processes: int, store: Any, df: Any, columns: List[str],
             validation: Union[None, float, str], partitions: int, verbose: int,
             check_metadata: Optional[Callable[[Dict[str, Any]], None]]
             ) -> "tuple[int, DatasetProperties]":
    """Write the DataFrame's training (and validation) rows: the dataset's index and
    properties. Called with _lock held."""
    metadata = get_metadata(df, columns)
    if check_metadata is not None:
        check_metadata(metadata)
    train, val = _split(_training_frame(df, columns, metadata, validation), validation)
    idx = _free_index()
    train_path = store.get_train_data_path(idx)
    if verbose:
        print(f"hvd_trainer.spark: writing the training data to {train_path}", flush=True)
    _write(train, store, train_path, partitions)
    val_path = None
    if val is not None:
        val_path = store.get_val_data_path(idx)
        _write(val, store, val_path, partitions)
    train_rows, train_bytes = _rows_and_bytes(store, train_path)
    val_rows, val_bytes = _rows_and_bytes(store, val_path)
    if train_rows < num_processes:
        raise ValueError(f"the DataFrame has {train_rows} training rows for {num_processes} "
                         "processes: every process needs at least one; use fewer processes "
                         "or more rows")
    if isinstance(validation, (str, float)) and validation and val_rows == 0:
        raise ValueError(f"validation={validation!r} left no validation rows: use a larger "
                         "fraction, or a column with some true values")
    return idx, DatasetProperties(train_rows, val_rows, metadata,
                                  (train_bytes + val_bytes) / max(1, train_rows + val_rows))


@contextlib.contextmanager
def prepare_data(num_processes: int, store: Any, df: Any, label_columns: Sequence[str],
                 feature_columns: Sequence[str], validation: Union[None, float, str] = None,
                 sample_weight_col: Optional[str] = None, compress_sparse: bool = False,
                 partitions_per_process: int = 10, verbose: int = 0,
                 check_metadata: Optional[Callable[[Dict[str, Any]], None]] = None
                 ) -> Iterator[int]:
    """Write ``df``'s training columns to Parquet in ``store`` once (reused while the same
    DataFrame, columns, validation and store come again) and give the dataset's index, for
    get_dataset_properties and the store's data paths. ``check_metadata(metadata)`` runs
    before anything is written (the estimators' shape checks). ``compress_sparse`` is
    accepted for Horovod's signature: sparse vectors are always written dense."""
    columns = list(dict.fromkeys([*feature_columns, *label_columns,
                                  *([sample_weight_col] if sample_weight_col else [])]))
    check_columns(df, feature_columns, label_columns, sample_weight_col)
    check_validation(validation, df.columns)
    partitions = max(1, num_processes * (partitions_per_process or 1))
    key = (id(df), store.prefix_path, tuple(columns), validation, partitions)
    with _lock:
        idx = _by_key.get(key)
        reusable = idx is not None and store.is_parquet_dataset(store.get_train_data_path(idx))
        if not reusable:
            idx, properties = _prepare(num_processes, store, df, columns, validation,
                                       partitions, verbose, check_metadata)
            _by_key[key] = idx
            _datasets[idx] = _Prepared(df, properties)
        else:
            if check_metadata is not None:
                check_metadata(_datasets[idx].properties.metadata)
            if verbose:
                print(f"hvd_trainer.spark: reusing the prepared data at "
                      f"{store.get_train_data_path(idx)}", flush=True)
        _in_use[idx] += 1
    try:
        yield idx
    finally:
        with _lock:
            _in_use[idx] -= 1
