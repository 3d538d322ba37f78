"""``hvd_trainer.ray``: horovod.ray's ``RayExecutor`` on a Ray cluster, without ssh.

:meth:`RayExecutor.start` places one Ray actor per worker (a placement group: STRICT_SPREAD
over ``num_hosts`` hosts, else packed); the first actor on each node is that host's agent.
Each :meth:`RayExecutor.run` or :meth:`RayExecutor.execute` is one MPI job: hvdrun on the
driver runs the MPI launcher, which hands each host's proxy command over instead of
starting it (MPICH's manual launcher, Open MPI's launcher agent), each agent runs its host's proxy command, the proxies
start the ranks, MPI moves the data, and Ray's object store carries the function out and the
results back (hvd_trainer_launch.engines: launch, agent, rank).

:class:`ElasticRayExecutor` (and RayExecutor with ``min_workers``/``max_workers``) runs an
elastic job: Ray's live nodes (:class:`RayHostDiscovery`, or the settings' ``discovery``) are
its hosts, an actor on each is its agent for the whole job, and hvdrun's elastic mode restarts
the ranks from the last commit when a host is lost or comes (engines.elastic, ray_elastic).
"""
from hvd_trainer_launch.engines.ray_elastic import (ElasticRayExecutor, ElasticSettings,
                                                   RayHostDiscovery)
from hvd_trainer_launch.engines.ray_executor import RayExecutor, Settings

__all__ = ["RayExecutor", "ElasticRayExecutor", "ElasticSettings", "RayHostDiscovery", "Settings"]
