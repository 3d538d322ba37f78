"""horovod.ray.ray_logger: a rank of an elastic Ray job logs events (JSON-able dicts) that reach
the driver's callbacks (``ElasticRayExecutor.run(fn, callbacks=[...])``).

Each event is one JSON line appended to a file in the rank's agent folder on its host
(hvd_trainer_launch.protocol.ENGINE_EVENTS_VARIABLE); the agent carries the lines back with
the life's outcomes, and the driver hands each event to every callback once the job has ended
(Horovod's callbacks get them as they come). An event of a rank killed mid-line is dropped.
"""
import json
import os
from typing import Any, Dict

from hvd_trainer_launch.protocol import ENGINE_EVENTS_VARIABLE

__all__ = ["log"]


def log(info: Dict[str, Any]) -> None:
    """Log ``info`` (a dict of JSON-able values) for the driver's callbacks. RuntimeError
    outside a rank of an elastic Ray job (which collects the events); TypeError when ``info``
    does not convert to JSON."""
    path = os.environ.get(ENGINE_EVENTS_VARIABLE)
    if not path:
        raise RuntimeError("ray_logger.log: this is not a rank of an elastic Ray job "
                           "(ElasticRayExecutor.run or RayExecutor with min_workers), whose "
                           "driver hands the events to its callbacks")
    line = json.dumps(info) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
