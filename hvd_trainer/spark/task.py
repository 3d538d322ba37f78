"""``hvd_trainer.spark.task`` (horovod.spark.task): what a rank of ``hvd_trainer.spark.run``
may ask about the Spark task it stands for.

The ranks are children of the launcher proxy that the first task on their host runs, not of
their own task, so the driver hands that proxy every task's resources on the host, in local
rank order (hvd_trainer.spark.runner), in :data:`RESOURCES_VARIABLE`; each rank reads its own.
"""
import json
import os
from typing import List

__all__ = ["get_available_devices"]

# JSON: for each local rank on this host, its task's resources ({"gpu": ["0"]}).
RESOURCES_VARIABLE = "HVD_SPARK_TASK_RESOURCES"


def get_available_devices() -> List[str]:
    """The addresses of the GPUs that Spark assigned to this rank's task
    (``BarrierTaskContext.resources()['gpu'].addresses``, e.g. ``['1']``), as Horovod's: ``[]``
    when the task got none or outside a Spark job. Pin the rank's device with it
    (``torch.cuda.set_device(int(get_available_devices()[0]))``) when Spark schedules GPUs
    (``spark.task.resource.gpu.amount``)."""
    found = os.environ.get(RESOURCES_VARIABLE)
    if found is None:
        return []
    by_local_rank = json.loads(found)
    return list(by_local_rank[int(os.environ["HOROVOD_LOCAL_RANK"])].get("gpu", []))
