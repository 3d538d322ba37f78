"""A rank that ran out of data joins (join()) and serves the others' reductions with zeros.

Horovod's semantics (``horovod.torch.join``): a rank that has no more batches calls
:func:`join`, which returns once every rank of the world has called it. Meanwhile the ranks
that have not joined go on calling collectives; each joined rank learns each call from its
agreement (see agreement.py) and runs the same data phase with zeros of the described
shapes and dtypes, so the wire pattern (fusion, pieces, ring) is the same as if it had made
the call; on the world and on every process set it belongs to, so no collective waits for it
in vain. It serves ``allreduce``, ``grouped_allreduce`` (Adasum included), ``barrier`` and
the reducer's gradient steps (DistributedOptimizer, DistributedTrainer), whose collectives
then each make their own agreement. Any other collective (allgather, broadcast, alltoall,
reducescatter, the object collectives, process-set changes, and a step's sparse or packed
gradients, which go by allgather) raises on every rank that called it, and the joined ranks
wait for the next call. So does a call on GPU arrays.

``Average`` divides by the size of the process set, joined ranks included, as in Horovod
0.28 (its test expects ``tensor * (size - 1) / size`` with one rank joined): the joined
ranks' zeros count as contributions. ``Min``, ``Max`` and ``Product`` see the zeros too.
"""
import contextlib
import time
import weakref
from typing import Any, Callable, Dict, List

import numpy as np

from hvd_trainer_launch import installs

from . import adasum, arguments, memory, ops
from ..coordination import agreement, rounds, stall, work_order
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set


# Bound methods to call at the end of each join(), in registration order (see after_join).
_after: List["weakref.WeakMethod[Callable[[], None]]"] = []


def after_join(method: Callable[[], None]) -> None:
    """Call the bound ``method`` at the end of every join() from now on, on every rank, in
    the order of registration (make it the same on every rank), while its object lives.

    For state that the ranks decide in their steps and that a joined rank, which served
    those steps without taking them, has not seen: the method can agree on it there by a
    collective (the optimizer's gradient kinds, say).
    """
    _after.append(weakref.WeakMethod(method))


def _dtype(text: str) -> np.dtype:
    if text.lstrip("<>|=").startswith("V"):
        # bfloat16 describes itself as '<V2' (void). A joined rank may never have met one, so
        # ml_dtypes (which the adapters import only on a first bfloat16 tensor) is imported now.
        ml_dtypes = installs.require("ml_dtypes", installs.ML_DTYPES,
                                     "serving a peer's bfloat16 tensor after join()")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(text)


def _serve(description: Dict[str, Any], process_set: ProcessSet) -> None:
    """Run the data phase of the call ``description`` describes, with zeros."""
    kind = description["kind"]
    if kind not in ("allreduce", "grouped_allreduce", "adasum"):
        return  # barrier, a step's agreement: nothing but the agreement itself
    zeros = [np.zeros(t["shape"], _dtype(t["dtype"])) for t in description["tensors"]]
    pre, post = description["prescale_factor"], description["postscale_factor"]
    with agreement.covered(runtime.communicator(process_set)):  # agreed on already
        if kind == "adasum":
            adasum.grouped_allreduce(zeros, description["name"], pre, post, process_set,
                                     inplace=True)
        else:
            ops.reduce_group(memory.HOST, zeros, arguments.ReduceOp[description["op"]],
                             description["name"], pre, post, process_set, kind=kind,
                             inplace=True)


def join() -> int:
    """Serve the other ranks' reductions with zeros until every rank has called join; return
    the global rank that joined last (of several joining together, the highest).

    A joined rank serves calls on every process set it belongs to, so a collective on a
    process set never waits for it. A collective over the world; the next collective after
    it works normally on every rank.

    As in Horovod, join() returns only once every rank has called it, whatever the other
    ranks do meanwhile, and never leaves them waiting: each call they make is served (the
    reductions and barrier), or raises on the ranks that made it, naming the call (one a
    joined rank cannot serve; calls that differ between them, once each of them waits for
    its own, a script that caught a failure on some ranks only, say). So a script whose
    ranks went apart still ends its join() once every rank reaches join(). A rank that ends
    its program without calling join() leaves the joined ranks waiting (Horovod ends their
    join() with its shut-down error instead; README Limitations).
    """
    runtime.init()
    work_order.flush(here=True)  # a deferred training step goes first (see work_order.py)
    world = runtime.communicator(global_process_set)
    if world.size == 1:
        return runtime.rank()
    sets = sorted((ps for ps in runtime.state().process_sets.values() if ps.included()),
                  key=lambda ps: ps.process_set_id)  # the world first
    newly = True  # this rank joined in the world's last agreement
    with contextlib.ExitStack() as turns:
        for ps in sets:
            turns.enter_context(agreement.turn(runtime.communicator(ps)))
        pending = {ps.process_set_id: (ps, rounds.JoinedRecord(runtime.communicator(ps)))
                   for ps in sets}
        start = time.monotonic()
        while pending:
            # A set whose ranks have all joined is done: nobody can call on it any more.
            for key, (ps, record) in list(pending.items()):
                if not record.done():
                    continue
                description = record.read()
                if description is None:
                    del pending[key]
                    continue
                newly = newly and ps is not global_process_set
                if description:
                    _serve(description, ps)
                pending[key] = (ps, rounds.JoinedRecord(record.comm))
                start = time.monotonic()
            stall.pause(start)
        last = agreement.finish_join(world, newly)
        for ps in sets[1:]:
            agreement.finish_join(runtime.communicator(ps), False)
    settle()
    return runtime.world_rank(world, last)


def settle() -> None:
    """Call the :func:`after_join` methods, on every rank: at the end of join(), and after
    a growth in place (hvd_trainer.elastic), whose new ranks have seen none of the steps. A
    collective where the methods are."""
    _after[:] = [ref for ref in _after if ref() is not None]
    for ref in list(_after):
        method = ref()
        if method is not None:
            method()
