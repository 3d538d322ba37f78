"""``hvd_trainer.spark.keras`` (horovod.spark.keras): the Keras 3 estimator over Spark.

Its names load on first use, so that the ranks, which import the training function of
``remote``, do not import pyspark.ml."""
from hvd_trainer.spark.common.lazy import lazy_names

__all__ = ["KerasEstimator", "KerasModel"]
__getattr__, __dir__ = lazy_names(__name__, "hvd_trainer.spark.keras.estimator", __all__)
