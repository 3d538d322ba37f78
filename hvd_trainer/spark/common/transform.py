"""A trained model's ``transform``: its predictions as new columns, computed on the executors
in batches (``mapInPandas``), one batch of rows per model call.

The framework's half is ``make_predict()``, run once per partition on the executor: it
returns ``predict(inputs)``, the model's outputs (2-D or more NumPy arrays, one row per input
row) for its inputs (one array per feature column, rows first). An output with one value per
row for a scalar label becomes a column of the label's type; any other becomes an ML vector
(DenseVector), as Horovod's models give them.
"""
from typing import Any, Callable, Dict, List, NamedTuple, Sequence

import numpy as np

__all__ = ["OutputColumn", "dense_rows", "output_columns", "model_transform", "transform"]

Predict = Callable[[List[np.ndarray]], List[np.ndarray]]


class OutputColumn(NamedTuple):
    """One prediction column: its name, and whether it holds vectors."""
    name: str
    vector: bool
    scalar_type: Any  # the Spark type of a scalar output


def dense_rows(values: Any) -> np.ndarray:
    """A pandas column of ML vectors (as mapInPandas hands them: dicts of type, size,
    indices, values), of arrays or of scalars, as one NumPy array with a row per value."""
    first = next((v for v in values if v is not None), None)
    if isinstance(first, dict):
        rows = []
        for cell in values:
            if cell["type"] == 1:
                rows.append(np.asarray(cell["values"], dtype=np.float64))
            else:
                row = np.zeros(cell["size"], dtype=np.float64)
                row[np.asarray(cell["indices"], dtype=np.int64)] = cell["values"]
                rows.append(row)
        return np.stack(rows) if rows else np.zeros((0, 0))
    if isinstance(first, (np.ndarray, list)):
        return np.stack([np.asarray(v) for v in values])
    return np.asarray(values)


def _as_vectors(values: Any) -> List[Any]:
    """A pandas column of vector dicts as pyspark.ml.linalg vectors (what the output of
    mapInPandas must hold for a vector column)."""
    from pyspark.ml.linalg import VectorUDT
    udt = VectorUDT()
    return [None if cell is None else udt.deserialize(
        (cell["type"], cell["size"], cell["indices"], cell["values"])) for cell in values]


def output_columns(metadata: Dict[str, Dict[str, Any]], label_columns: Sequence[str],
                   output_names: Sequence[str], sample: List[np.ndarray]) -> List[OutputColumn]:
    """The kind of each prediction column, from the model's outputs ``sample`` for one row."""
    from pyspark.sql.types import DoubleType, FloatType, IntegerType, LongType
    scalars = {FloatType: FloatType, DoubleType: DoubleType, IntegerType: IntegerType,
               LongType: LongType}
    columns = []
    for label, name, output in zip(label_columns, output_names, sample):
        kind = metadata.get(label, {}).get("spark_data_type")
        scalar = output[0].size == 1 and kind in scalars
        columns.append(OutputColumn(name, not scalar,
                                    scalars[kind]() if scalar else DoubleType()))
    return columns


def transform(df: Any, feature_columns: Sequence[str], outputs: Sequence[OutputColumn],
              make_predict: Callable[[], Predict]) -> Any:
    """``df`` with the prediction columns ``outputs`` added, computed on the executors."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType
    vectors_in = [f.name for f in df.schema.fields if isinstance(f.dataType, VectorUDT)]
    names = [column.name for column in outputs]
    kept = [f for f in df.schema.fields if f.name not in names]
    schema = StructType(kept + [
        StructField(c.name, ArrayType(DoubleType()) if c.vector else c.scalar_type, True)
        for c in outputs])
    casts = [(c.name, c.vector, c.scalar_type) for c in outputs]
    features = list(feature_columns)

    def run(batches):
        import pandas as pd
        predict = make_predict()
        for pdf in batches:
            results = predict([dense_rows(pdf[name]) for name in features]) if len(pdf) \
                else [np.zeros((0, 1))] * len(casts)
            out = pdf.drop(columns=[n for n in names if n in pdf.columns])
            for name in vectors_in:
                out[name] = _as_vectors(pdf[name])
            for (name, vector, kind), result in zip(casts, results):
                rows = np.asarray(result).reshape(len(pdf), -1).astype(np.float64)
                out[name] = list(rows) if vector else (
                    np.rint(rows[:, 0]).astype(np.int64) if kind.typeName() in ("integer", "long")
                    else rows[:, 0])
            yield pd.DataFrame(out, columns=[f.name for f in schema.fields])

    result = df.mapInPandas(run, schema)
    for name, vector, _ in casts:
        if vector:
            result = result.withColumn(name, array_to_vector(name))
    return result


def model_transform(df: Any, metadata: Dict[str, Dict[str, Any]], feature_columns: Sequence[str],
                    label_columns: Sequence[str], output_names: Sequence[str],
                    make_predict: Callable[[], Predict]) -> Any:
    """A trained model's transform: the kind of each prediction column from the model's
    outputs for the DataFrame's first row (on the driver), then transform()."""
    sample = df.select(*feature_columns).limit(1).collect()
    if sample:
        inputs = [dense_rows([row[c].toArray() if hasattr(row[c], "toArray") else row[c]
                              for row in sample]) for c in feature_columns]
        outputs = make_predict()(inputs)
    else:
        outputs = [np.zeros((1, 1))] * len(label_columns)
    columns = output_columns(metadata or {}, label_columns, output_names, outputs)
    return transform(df, feature_columns, columns, make_predict)
