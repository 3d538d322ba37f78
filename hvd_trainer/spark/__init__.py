"""``hvd_trainer.spark``: horovod.spark's ``run`` on a Spark cluster, without ssh.

One Spark barrier job of ``num_proc`` tasks: the tasks are the agents that run the MPI
launcher's proxies (hvd_trainer_launch.engine_agent), MPI moves the data, and Spark carries the
function out and the results back (hvd_trainer.spark.runner).
"""
from hvd_trainer.spark.runner import run, run_elastic

__all__ = ["run", "run_elastic"]
