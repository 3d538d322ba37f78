"""``hvd_trainer.spark.lightning`` (horovod.spark.lightning): the PyTorch Lightning 2 estimator
over Spark, training with hvd_trainer.torch.lightning.HorovodStrategy.

Its names load on first use, so that the ranks, which import the training function of
``remote``, do not import pyspark.ml."""
from hvd_trainer.spark.common.lazy import lazy_names

__all__ = ["TorchEstimator", "TorchModel"]
__getattr__, __dir__ = lazy_names(__name__, "hvd_trainer.spark.lightning.estimator", __all__)
