"""``hvd_trainer.spark.horovod_runner``: Databricks' ``sparkdl.HorovodRunner`` by its module
path; the code is the Spark engine's (hvd_trainer_launch.engines.horovod_runner)."""
from hvd_trainer_launch.engines.horovod_runner import HorovodRunner

__all__ = ["HorovodRunner"]
