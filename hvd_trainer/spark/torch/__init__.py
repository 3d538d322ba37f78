"""``hvd_trainer.spark.torch`` (horovod.spark.torch): the torch estimator over Spark.

Its names load on first use, so that the ranks, which import the training function of
``remote``, do not import pyspark.ml (a second or more per rank)."""
from typing import Any, List

__all__ = ["TorchEstimator", "TorchModel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hvd_trainer.spark.torch import estimator
        return getattr(estimator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted([*globals(), *__all__])
