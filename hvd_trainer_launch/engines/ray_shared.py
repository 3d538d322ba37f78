"""What both Ray drivers (ray_executor's RayExecutor, ray_elastic's ElasticRayExecutor) share:
the ranks' PYTHONPATH from the driver's, and Ray's words of a lost actor."""
import os
import re
from typing import Dict, Optional

# How much of what Ray says of a lost actor an EngineError quotes.
_CAUSE_CHARS = 600


def driver_path(given: Optional[str]) -> Dict[str, str]:
    """PYTHONPATH for the ranks: ``given`` (extra_env_vars'), then the driver's sys.path, as
    Ray gives its workers the driver's (so functions that refer to the driver's modules load
    there too), but not the driver's working directory ('' on its sys.path: a folder of the
    driver's, not of the ranks'); extra_env_vars={"PYTHONPATH": ...} can name it."""
    import sys
    entries = [entry for entry in sys.path if entry and os.path.isdir(entry)]
    return {"PYTHONPATH": os.pathsep.join(([given] if given else []) + entries)}


def lost_cause(error: Exception) -> str:
    """What Ray said of a lost actor, without the fields that name the actor itself (class,
    id, pid, namespace): its death and why (ray.kill, the worker's exit, out of memory)."""
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")
             and line.strip() != getattr(error, "BASE_ERROR_MSG", None)]
    cause = re.sub(r"\s+", " ", " ".join(lines) or text).strip()
    return f"{type(error).__name__}: " + (cause if len(cause) <= _CAUSE_CHARS
                                          else cause[:_CAUSE_CHARS] + " ...")
