"""``hvd_trainer.spark.torch`` (horovod.spark.torch): the torch estimator over Spark.

Its names load on first use, so that the ranks, which import the training function of
``remote``, do not import pyspark.ml (a second or more per rank)."""
from hvd_trainer.spark.common.lazy import lazy_names

__all__ = ["TorchEstimator", "TorchModel"]
__getattr__, __dir__ = lazy_names(__name__, "hvd_trainer.spark.torch.estimator", __all__)
