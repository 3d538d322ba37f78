"""``hvd_trainer.ray``: horovod.ray's ``RayExecutor`` on a Ray cluster, without ssh.

:meth:`RayExecutor.start` places one Ray actor per worker (a placement group: STRICT_SPREAD
over ``num_hosts`` hosts, else packed); the first actor on each node is that host's agent.
Each :meth:`RayExecutor.run` or :meth:`RayExecutor.execute` is one MPI job: hvdrun on the
driver runs the MPI launcher, which hands each host's proxy command over instead of
starting it (MPICH's manual launcher, Open MPI's launcher agent), each agent runs its host's proxy command, the proxies
start the ranks, MPI moves the data, and Ray's object store carries the function out and the
results back (hvd_trainer_launch.engines: launch, agent, rank).
"""
from hvd_trainer_launch.engines.ray_executor import ElasticRayExecutor, RayExecutor, Settings

__all__ = ["RayExecutor", "ElasticRayExecutor", "Settings"]
