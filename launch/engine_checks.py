"""The checks that the engines' entry points (hvd_trainer.ray.RayExecutor,
hvd_trainer.spark.run) make of their arguments on the driver, before anything starts: each
error names the argument, what it was, and what it must be. Standard library only."""
import os
from typing import Any, Dict, Mapping, Optional

from hvd_trainer_launch import mpi

# What an environment value may be: written as str() gives it.
_VALUE_TYPES = (str, int, float, os.PathLike)


def check_function(fn: Any, where: str) -> None:
    """TypeError when ``fn`` (the function each rank runs) is not callable."""
    if not callable(fn):
        raise TypeError(f"{where}: fn={fn!r} is not callable; give the function that each "
                        "rank runs")


def check_count(value: Any, name: str, where: str) -> int:
    """``value`` when it is an int >= 1 (not a bool); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name}={value!r} must be an int >= 1")
    return value


def rank_env(env: Optional[Mapping[Any, Any]], name: str, where: str) -> Dict[str, str]:
    """``env`` (argument ``name``: variables for the ranks) as str to str; ValueError naming
    the first entry that no environment can hold: a name that is not a variable name (both
    MPIs pass only those), a value that is not a str or a number, or one holding a NUL."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError(f"{where}: {name}={env!r} must be a dict of variable names to values")
    checked = {}
    for key, value in env.items():
        why = mpi.variable_name_error(key)
        if why is None and (isinstance(value, bool) or not isinstance(value, _VALUE_TYPES)):
            why = (f"the value of {key!r} is {value!r}, a {type(value).__name__}: give a str "
                   "(or a number)")
        if why is None:
            checked[key] = os.fsdecode(value) if isinstance(value, os.PathLike) else str(value)
            if "\0" in checked[key]:
                why = f"the value of {key!r} holds a NUL character, which no environment can"
        if why is not None:
            raise ValueError(f"{where}: {name}: {why}")
    return checked
