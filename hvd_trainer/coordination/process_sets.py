"""Process sets: registering and removing them, collectively (Horovod's API), and the
public :func:`init`, which joins the job and registers the sets it is given."""
from typing import Any, Optional, Sequence, Union

from . import agreement
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set, state


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Join the job. ``comm`` may be an mpi4py communicator to run on instead of COMM_WORLD.

    ``process_sets`` are registered as if passed to :func:`add_process_set`. A second call
    does nothing except register further process sets.
    """
    runtime.init(comm)
    for ps in process_sets or ():
        add_process_set(ps)


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set; a collective call that every rank of the world must make, in
    the same order, with the same ranks (ranks that disagree all raise)."""
    st = state()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    with agreement.collective(st.world, "add_process_set", None) as call:
        with call.checks():
            if ps.ranks is None or not ps.ranks:
                raise ValueError("add_process_set: the process set needs a non-empty list of "
                                 "ranks")
            odd = [r for r in ps.ranks if isinstance(r, bool) or not isinstance(r, int)]
            if odd:
                raise TypeError(f"add_process_set: ranks must be integers, got {odd[0]!r} "
                                f"({type(odd[0]).__name__}) in {ps.ranks!r}; give whole rank "
                                "numbers")
            bad = [r for r in ps.ranks if not 0 <= r < st.world.size]
            if bad or len(set(ps.ranks)) != len(ps.ranks):
                raise ValueError(f"add_process_set: ranks {ps.ranks} must be distinct and "
                                 f"within 0..{st.world.size - 1}")
            if ps.process_set_id is not None:
                raise ValueError(f"{ps!r} is already registered")
            for known in st.process_sets.values():
                if known.ranks == ps.ranks:
                    raise ValueError(f"a process set with ranks {ps.ranks} already exists "
                                     f"(id {known.process_set_id}); reuse it")
        call.agree(lambda: {"ranks": ps.ranks, "process_set_id": st.next_set_id})
        with runtime.lock(), call.communicate():
            ps.comm = st.world.split(ps.ranks)
            ps.process_set_id = st.next_set_id
            st.next_set_id += 1
            st.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective call of the world); False, on
    every rank, if it was not registered."""
    st = state()
    known = (process_set is not global_process_set
             and process_set.process_set_id in st.process_sets)
    with agreement.collective(st.world, "remove_process_set", None) as call:
        call.agree(lambda: {"process_set_id": process_set.process_set_id if known else None})
    if not known:
        return False
    with runtime.lock():
        del st.process_sets[process_set.process_set_id]
        if process_set.comm is not None:
            process_set.comm.free()
        process_set.comm, process_set.process_set_id = None, None
    return True
