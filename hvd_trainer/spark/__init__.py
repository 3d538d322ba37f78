"""``hvd_trainer.spark``: horovod.spark's ``run`` on a Spark cluster, without ssh, and
Databricks' ``HorovodRunner``.

One Spark barrier job of ``num_proc`` tasks: the tasks are the agents that run the MPI
launcher's proxies (hvd_trainer_launch.engines.agent), hvdrun runs on the driver, MPI moves the
data, and Spark carries the function out and the results back (hvd_trainer_launch.engines.spark_run).
``hvd_trainer.spark.task.get_available_devices()`` gives a rank its task's GPUs.
"""
from hvd_trainer.spark import task
from hvd_trainer.spark.horovod_runner import HorovodRunner
from hvd_trainer_launch.engines.spark_elastic import run_elastic
from hvd_trainer_launch.engines.spark_run import run

__all__ = ["HorovodRunner", "run", "run_elastic", "task"]
