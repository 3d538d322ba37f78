"""A reducer's comm-hook state between the ranks and the one rank that saves or loads it.

The built-in hooks' states keep per-rank values that an exact resume needs: the packed codecs'
error-feedback residuals, PowerSGD's residuals, factors and counts. A state keeps them when it
has ``state()`` (this rank's values, picklable) and ``restore(saved)`` (continue from them;
None: start again), as the built-in ones do; so may a user's hook state. Checkpoints
(checkpoint.py) and elastic commits gather every member's values on the process set's first
rank, without gathering every rank's values onto every rank.
"""
import warnings
from typing import Any, Dict, Optional

from ..collectives import objects


def kept(reducer: Any) -> Any:
    """The reducer's hook state when it keeps values across steps (see the module docstring),
    else None."""
    state = reducer.hook.state
    if callable(getattr(state, "state", None)) and callable(getattr(state, "restore", None)):
        return state
    return None


def _settings(reducer: Any) -> Dict[str, Any]:
    return {"compression": reducer.hook.describe(), "size": reducer.size}


def gather(reducer: Any, name: str) -> Optional[Dict[str, Any]]:
    """Every member's hook state and the settings it belongs to, on the set's first rank
    (None on the others); None everywhere when the hook keeps no state. A collective."""
    state = kept(reducer)
    if state is None:
        return None
    process_set = reducer.process_set
    every = objects.gather_object(state.state(), process_set.ranks[0], name, process_set)
    return None if every is None else dict(_settings(reducer), residuals=every)


def shared(reducer: Any, name: str) -> Optional[Dict[str, Any]]:
    """What :func:`gather` returns, on every member: an elastic commit, which any one rank's
    copy may have to restore, holds every member's state. A collective."""
    if kept(reducer) is None:
        return None
    process_set = reducer.process_set
    return objects.broadcast_object(gather(reducer, name), process_set.ranks[0], name,
                                    process_set)


def scatter(reducer: Any, saved: Optional[Dict[str, Any]], name: str) -> None:
    """Give each member its state from ``saved`` (what :func:`gather` returned, read on the
    set's first rank; ignored elsewhere). A state saved with other settings (another hook or
    number of ranks) starts again from nothing, with a warning. A collective."""
    state = kept(reducer)
    if state is None:
        return
    process_set = reducer.process_set
    root = process_set.rank() == 0
    every = None
    if root and saved is not None:
        found = saved if isinstance(saved, dict) else {}
        mine = _settings(reducer)
        if {k: found.get(k) for k in mine} == mine:
            every = saved["residuals"]
        else:
            warnings.warn(f"the saved error-feedback residuals come from {found.get('size')} "
                          f"ranks with {found.get('compression')}, this job has "
                          f"{mine['size']} with {mine['compression']}; they start again from "
                          "zero")
    if root and every is None:
        every = [None] * reducer.size
    state.restore(objects.scatter_object(every, process_set.ranks[0], name, process_set))
