"""A rank that ran out of data joins (join()) and serves the others' reductions with zeros.

Horovod's semantics (``horovod.torch.join``): a rank that has no more batches calls
:func:`join`, which returns once every rank of the world has called it. Meanwhile the ranks
that have not joined go on calling collectives; each joined rank learns each call from its
agreement (see diagnostics.py) and runs the same data phase with zeros of the described
shapes and dtypes, so the wire pattern (fusion, pieces, ring) is the same as if it had made
the call. It serves ``allreduce``, ``grouped_allreduce`` (Adasum included), ``barrier`` and
the reducer's gradient steps (DistributedOptimizer, DistributedTrainer), whose collectives
then each make their own agreement. Any other collective (allgather, broadcast, alltoall,
reducescatter, the object collectives, process-set changes, and a step's sparse or packed
gradients, which go by allgather) raises on every rank that called it, and the joined ranks
wait for the next call. So does a call on GPU arrays.

``Average`` divides by the size of the process set, joined ranks included, as in Horovod
0.28 (its test expects ``tensor * (size - 1) / size`` with one rank joined): the joined
ranks' zeros count as contributions. ``Min``, ``Max`` and ``Product`` see the zeros too.
"""
from typing import Any, Dict

import numpy as np

from . import adasum, diagnostics, ops, runtime
from .runtime import global_process_set


def _dtype(text: str) -> np.dtype:
    # bfloat16 describes itself as '<V2' (void); ml_dtypes, imported by whoever made such an
    # array, registers its name with NumPy.
    return np.dtype("bfloat16") if text.lstrip("<>|=").startswith("V") else np.dtype(text)


def _serve(description: Dict[str, Any]) -> None:
    """Run the data phase of the call ``description`` describes, with zeros."""
    kind = description["kind"]
    if kind not in ("allreduce", "grouped_allreduce", "adasum"):
        return  # barrier, a step's agreement: nothing but the agreement itself
    zeros = [np.zeros(t["shape"], _dtype(t["dtype"])) for t in description["tensors"]]
    pre, post = description["prescale_factor"], description["postscale_factor"]
    comm = runtime.communicator(global_process_set)
    with diagnostics.covered(comm):  # agreed on in serve_joined
        if kind == "adasum":
            adasum.grouped_allreduce(zeros, description["name"], pre, post, inplace=True)
        else:
            ops.reduce_group(ops.HOST, zeros, ops.ReduceOp[description["op"]],
                             description["name"], pre, post, global_process_set, kind, True)


def join() -> int:
    """Serve the other ranks' reductions with zeros until every rank has called join; return
    the global rank that joined last (of several joining together, the highest).

    A collective over the world; the next collective after it works normally on every rank.
    """
    runtime.init()
    comm = runtime.communicator(global_process_set)
    if comm.size == 1:
        return runtime.rank()
    newly = True
    with diagnostics.turn(comm):
        while True:
            description = diagnostics.serve_joined(comm)
            if description is None:
                break
            newly = False
            if description:
                _serve(description)
        last = diagnostics.finish_join(comm, newly)
    return runtime.world_rank(comm, last)
