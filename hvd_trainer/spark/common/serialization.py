"""Saving and loading estimators and models as Spark ML writables (``model.save(path)``,
``TorchModel.load(path)``, inside a ``Pipeline``'s save too).

``path/metadata`` is one JSON line, written through Spark (so any path Spark writes works): the
class, uid and every parameter's value, each pickled (cloudpickle, or the class's own
serializer for its framework's objects) and framed with a digest (``payload``). The backend
and store are not saved: they belong to the cluster, and are given again after loading.
"""
import importlib
import json
import time
from typing import Any, Callable, Dict, Optional

import cloudpickle
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from hvd_trainer.spark.common import payload

__all__ = ["ParamsWritable", "ParamsReadable"]

_NOT_SAVED = ("backend", "store")


def _encode(instance: Any, params: Dict[Any, Any]) -> Dict[str, Optional[str]]:
    serialize: Callable[[str, Any], bytes] = getattr(
        instance, "_serialize_param", lambda name, value: cloudpickle.dumps(value))
    return {param.name: payload.to_text(serialize(param.name, value))
            for param, value in params.items()
            if param.name not in _NOT_SAVED and value is not None}


def _decode(cls: Any, values: Dict[str, str], path: str) -> Dict[str, Any]:
    deserialize: Callable[[str, bytes], Any] = getattr(
        cls, "_deserialize_param", lambda name, data: cloudpickle.loads(data))
    return {name: deserialize(name, payload.from_text(text, f"{path}: parameter {name}"))
            for name, text in values.items()}


class _Writer(MLWriter):
    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        instance = self.instance
        record = {"class": f"{type(instance).__module__}.{type(instance).__qualname__}",
                  "timestamp": int(time.time() * 1000), "sparkVersion": self.sc.version,
                  "uid": instance.uid, "paramMap": _encode(instance, instance._paramMap),
                  "defaultParamMap": _encode(instance, instance._defaultParamMap)}
        self.sc.parallelize([json.dumps(record, separators=(",", ":"))], 1) \
            .saveAsTextFile(f"{path.rstrip('/')}/metadata")


class _Reader(MLReader):
    def __init__(self, cls: Any) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        lines = self.sc.textFile(f"{path.rstrip('/')}/metadata", 1).collect()
        if len(lines) != 1:
            raise ValueError(f"{path} holds no saved hvd_trainer estimator or model "
                             "(its metadata is missing or not one line)")
        record = json.loads(lines[0])
        module, _, name = record["class"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not issubclass(cls, self.cls):
            raise ValueError(f"{path} holds a {record['class']}, not a {self.cls.__name__}: "
                             f"load it with {name}.load")
        instance = cls()
        instance._resetUid(record["uid"])
        defaults = _decode(cls, record["defaultParamMap"], path)
        instance._setDefault(**{k: v for k, v in defaults.items() if instance.hasParam(k)})
        instance._set(**{k: v for k, v in _decode(cls, record["paramMap"], path).items()
                         if instance.hasParam(k)})
        return instance


class ParamsWritable(MLWritable):
    """``save(path)`` / ``write()`` for an estimator or model."""

    def write(self) -> MLWriter:
        return _Writer(self)


class ParamsReadable(MLReadable):
    """``load(path)`` / ``read()`` for an estimator or model class."""

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)
