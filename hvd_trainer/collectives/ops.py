"""Named collectives on NumPy arrays, with Horovod's ops, scaling and argument checks.

Out-of-place functions return new arrays; the ``*_`` variants write into their argument,
which must then be C-contiguous and writeable. Out-of-place functions accept any strided
array (it is copied once into the result). Every call first checks that all ranks agree on
what they are doing (see agreement.py), so a disagreement raises on every rank; a caller
that has agreed on a whole series of calls runs them inside ``agreement.covered``.

Argument errors are collective: a check that fails on one rank raises the same ``ValueError``
or ``TypeError`` on every rank of the process set, naming the rank, and the next collective
works. ``root_rank`` is a global rank, as in Horovod, also on a process set.

Any thread may call a collective; calls on one process set run one at a time (see
agreement.py). Unnamed calls pair thread by thread across ranks, by the thread's name (see
automatic_names.py); named ones pair by name.

Integer tensors reduce in their own type, wrapping on overflow as MPI's sum does; ``Average``
and fractional scale factors then truncate toward zero, as C's integer division does: the
results of Horovod, which sums in the tensor's type and then scales. Boolean ``Sum`` is a
logical or.
"""
from __future__ import annotations  # the nested functions' annotations cost each call else

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..coordination import agreement, records
from . import fusion, plans
from .carried import carried_reduction, concatenated
from ..runtime import runtime, timeline
from ..backends import split_evenly
from .memory import HOST, Memory, check_array, memory_of
from ..runtime.runtime import ProcessSet, global_process_set
from .arguments import (BACKEND_OP, ROUNDED_ONCE, Average, ReduceOp, check_list,
                        check_reduction, check_root, check_rows, describe_reduction,
                        describe_tensor, half_in_float32, prescaled, scales, tensor_signature)


# -- allreduce ------------------------------------------------------------------------------
def reduce_group(memory: Memory, tensors: Sequence[Any], op: Any, name: Optional[str],
                 prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set, *, kind: str,
                 inplace: bool, halves: str = ROUNDED_ONCE) -> List[Any]:
    """The allreduce family: reduce ``tensors`` in place, or into new arrays, fused;
    ``halves``: how a scaled sum of 16-bit floats is rounded (see arguments.ROUNDED_ONCE)."""
    comm = runtime.communicator(process_set)
    if kind == "allreduce" and memory is HOST:
        done = _reduced_again(comm, tensors[0], op, name, prescale_factor, postscale_factor,
                              process_set, inplace, halves)
        if done is not None:
            return done
    plans.reductions.forget_last()  # until this call has run
    with memory.active(), agreement.collective(comm, kind, name) as call:
        key = plans.reduction_key(comm, memory, kind, tensors, op, prescale_factor,
                                  postscale_factor, inplace, halves)
        plan = plans.reductions.get(key, comm)
        with call.checks():
            if kind == "allreduce":
                tensors = [memory.check(tensors[0], "tensor", inplace)]
            else:
                tensors = check_list(tensors, memory, inplace)
            if plan is None:  # a known reduction's key stands for these checks
                op = check_reduction(op, prescale_factor, postscale_factor)

        def describe() -> Dict[str, Any]:
            return describe_reduction(call.name, tensors, op, prescale_factor, postscale_factor)

        if call.error is not None:
            call.agree(describe)  # raises the error on every rank
        if plan is None:
            plan = plans.reductions.keep(key, comm, plans.reduction(
                comm, memory, kind, tensors, op, prescale_factor, postscale_factor, halves))
        outputs = _reduced(call, memory, describe, tensors, plan, op, inplace, process_set)
        if key is not None and memory is HOST and kind == "allreduce":
            plans.reductions.ran(comm, (tensors[0].dtype, tensors[0].shape, op,
                                        prescale_factor, postscale_factor, inplace, halves),
                                 plan)
        return outputs


def _reduced_again(comm: Any, tensor: Any, op: Any, name: Optional[str], pre: Any, post: Any,
                   process_set: ProcessSet, inplace: bool, halves: str) -> Optional[List[Any]]:
    """The steady state: an allreduce of a host array whose arguments are those of this
    thread's last allreduce on ``comm``, which ran (see plans.Known.again), skips its plan's
    lookup and the checks the plan stands for, and is named and agreed on at once where the
    communicator is free (agreement.again). None: the call takes the full path."""
    if type(tensor) is not np.ndarray or type(op) is not ReduceOp or type(pre) is not float \
            or type(post) is not float:
        return None
    plan = plans.reductions.again(comm, (tensor.dtype, tensor.shape, op, pre, post, inplace,
                                         halves))
    if plan is None or (inplace and not (tensor.flags.c_contiguous and tensor.flags.writeable)):
        return None  # an in-place call's layout may change between calls: checked there
    call = agreement.again(comm, "allreduce", name)
    if call is None:
        return None
    tensors = [tensor]

    def describe() -> Dict[str, Any]:
        return describe_reduction(call.name, tensors, op, pre, post)

    try:
        with call:
            return _reduced(call, HOST, describe, tensors, plan, op, inplace, process_set)
    except BaseException:
        plans.reductions.forget_last()
        raise


def _reduced(call: agreement.Call, memory: Memory, describe: Callable[[], Dict[str, Any]],
             tensors: Sequence[Any], plan: plans.Reduction, op: ReduceOp, inplace: bool,
             process_set: ProcessSet) -> List[Any]:
    """A checked reduction's agreement and data: carried where it fits, else its own data
    phase, fused."""
    if plan.wire is None:
        call.agree(describe, signature=plan.signature)
    else:
        done = carried_reduction(call, describe, tensors, plan, op, inplace)
        if done is not None:
            return done
    pre, post, wide = plan.pre, plan.post, plan.wide
    if inplace:
        outputs = tensors
    else:
        tensors = [memory.xp.asarray(t, order="C") for t in tensors]  # keeps 0-d arrays
        outputs = [memory.xp.empty(t.shape, t.dtype) for t in tensors]
    data = memory.mover(process_set)
    backend_op = BACKEND_OP[op]
    halves = outputs
    if any(wide):
        if pre != 1.0:
            tensors = [prescaled(memory, t, pre).reshape(t.shape) for t in tensors]
            pre = 1.0
        tensors = [t.astype(memory.xp.float32) if w else t for t, w in zip(tensors, wide)]
        outputs = [memory.xp.empty(t.shape, t.dtype) if w else o
                   for t, o, w in zip(tensors, outputs, wide)]

    def communicate(flat: Any, out: Optional[Any] = None) -> None:
        with call.communicate():
            data.allreduce(flat, backend_op, out)

    with timeline.span(call.name, "FUSE"):
        fusion.fused(tensors, outputs, lambda: memory.pool(data), runtime.fusion_threshold(),
                     communicate, pre, post, memory.pack, memory.unpack)
    for half, out, w in zip(halves, outputs, wide):
        if w:
            half[...] = out  # the one rounding to half precision
    return list(halves)


def allreduce(tensor: np.ndarray, op: Any = Average, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``tensor`` across the process set's ranks; return the result as a new array."""
    return reduce_group(memory_of(tensor), [tensor], op, name, prescale_factor,
                        postscale_factor, process_set, kind="allreduce", inplace=False)[0]


def allreduce_(tensor: np.ndarray, op: Any = Average, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return reduce_group(memory_of(tensor), [tensor], op, name, prescale_factor,
                        postscale_factor, process_set, kind="allreduce", inplace=True)[0]


def grouped_allreduce(tensors: Sequence[np.ndarray], op: Any = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Allreduce a list of tensors as one fused operation; return new arrays."""
    return reduce_group(memory_of(tensors), tensors, op, name, prescale_factor,
                        postscale_factor, process_set, kind="grouped_allreduce", inplace=False)


def grouped_allreduce_(tensors: Sequence[np.ndarray], op: Any = Average, name: Optional[str] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    return reduce_group(memory_of(tensors), tensors, op, name, prescale_factor,
                        postscale_factor, process_set, kind="grouped_allreduce", inplace=True)


# -- allgather ------------------------------------------------------------------------------
def allgather_rows(memory: Memory, tensor: Any, name: Optional[str],
                   process_set: ProcessSet) -> Any:
    """Allgather: every rank's ``tensor`` concatenated along dimension 0."""
    comm = runtime.communicator(process_set)
    with memory.active(), agreement.collective(comm, "allgather", name) as call:
        with call.checks():
            memory.check(tensor, "tensor")
            check_rows(tensor, "tensor", "allgather")
            tensor = memory.xp.ascontiguousarray(tensor)

        def describe() -> Dict[str, Any]:
            return {"tensors": [describe_tensor(tensor, call.name, False)]}

        if call.error is not None:
            call.agree(describe)  # raises the error on every rank
        signature = tensor_signature(memory, [tensor], dim0=False)
        row = math.prod(tensor.shape[1:])
        if memory is HOST and row:  # the ranks agree on row, so the bytes tell the rows
            carried = call.exchange(describe, tensor.reshape(-1).view(np.uint8)
                                    if tensor.nbytes <= records.room(comm) else None,
                                    signature)
            if carried is not None and carried.every():
                return concatenated(carried, tensor, row)
        else:
            call.agree(describe, signature=signature)
        rows = call.gather_counts(tensor.shape[0])
        out = memory.xp.empty((sum(rows),) + tensor.shape[1:], tensor.dtype)
        data = memory.mover(process_set)
        with call.communicate():
            data.allgatherv(tensor.reshape(-1), out.reshape(-1), [r * row for r in rows])
        return out


def allgather(tensor: np.ndarray, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0, which may differ per rank."""
    return allgather_rows(memory_of(tensor), tensor, name, process_set)


def grouped_allgather(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Allgather each tensor of a list; return the gathered arrays in order."""
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "grouped_allgather", name) as call:
        with call.checks():
            tensors = check_list(tensors, memory_of(tensors))
            for i, t in enumerate(tensors):
                check_rows(t, f"tensors[{i}]", "allgather")
        names = [f"{call.name}.{i}" for i in range(len(tensors))]
        call.agree(lambda: {"tensors": [describe_tensor(t, n, dim0=False)
                                        for t, n in zip(tensors, names)]})
        with agreement.covered(comm):  # agreed on above, tensor by tensor
            return [allgather(t, n, process_set) for t, n in zip(tensors, names)]


# -- broadcast ------------------------------------------------------------------------------
def broadcast_in(memory: Memory, tensor: Any, root_rank: Any, name: Optional[str],
                 process_set: ProcessSet, inplace: bool) -> Any:
    """Broadcast from the global rank ``root_rank``, into ``tensor`` or a new array."""
    comm = runtime.communicator(process_set)
    if memory is HOST:
        done = _broadcast_again(comm, tensor, root_rank, name, process_set, inplace)
        if done is not None:
            return done
    plans.broadcasts.forget_last()  # until this call has run
    with memory.active(), agreement.collective(comm, "broadcast", name) as call:
        key = plans.broadcast_key(comm, tensor, root_rank, inplace)
        plan = plans.broadcasts.get(key, comm)
        with call.checks():
            memory.check(tensor, "tensor", inplace)
            root = check_root(root_rank, process_set) if plan is None else plan.root

        def describe() -> Dict[str, Any]:
            return {"root_rank": int(root_rank), "tensors": [describe_tensor(tensor, call.name)]}

        if call.error is not None:
            call.agree(describe)  # raises the error on every rank
        if plan is None:
            plan = plans.broadcasts.keep(key, comm, plans.broadcast(comm, memory, tensor,
                                                                     int(root_rank), root))
        out = _broadcasted(call, memory, describe, tensor, plan, process_set, inplace)
        if key is not None and memory is HOST:
            plans.broadcasts.ran(comm, (tensor.dtype, tensor.shape, root_rank, inplace), plan)
        return out


def _broadcast_again(comm: Any, tensor: Any, root_rank: Any, name: Optional[str],
                     process_set: ProcessSet, inplace: bool) -> Optional[np.ndarray]:
    """The steady state of a host array's broadcast, as :func:`_reduced_again` is a
    reduction's. None: the call takes the full path."""
    if type(tensor) is not np.ndarray or type(root_rank) is not int:
        return None
    plan = plans.broadcasts.again(comm, (tensor.dtype, tensor.shape, root_rank, inplace))
    if plan is None or (inplace and not (tensor.flags.c_contiguous and tensor.flags.writeable)):
        return None
    call = agreement.again(comm, "broadcast", name)
    if call is None:
        return None

    def describe() -> Dict[str, Any]:
        return {"root_rank": root_rank, "tensors": [describe_tensor(tensor, call.name)]}

    try:
        with call:
            return _broadcasted(call, HOST, describe, tensor, plan, process_set, inplace)
    except BaseException:
        plans.broadcasts.forget_last()
        raise


def _broadcasted(call: agreement.Call, memory: Memory, describe: Callable[[], Dict[str, Any]],
                 tensor: Any, plan: plans.Broadcast, process_set: ProcessSet,
                 inplace: bool) -> Any:
    """A checked broadcast's agreement and data: carried where it fits, else its own data
    phase."""
    root = plan.root
    if plan.fits or plan.inline:
        mine = call.comm.rank == root
        # Every rank knows the tensor's size: one that cannot ride in the root's record need
        # not look there. (One that rides but does not fit the carrier, at 129 to 256 ranks,
        # is gathered for nothing when its root took the full path, then runs its data phase.)
        carried = call.exchange(describe, tensor.reshape(-1).view(np.uint8) if mine
                                else None, plan.signature, root if plan.inline else None)
        sent = None if carried is None else carried.of(root)
        if sent is not None:
            if inplace and mine:
                return tensor
            out = tensor if inplace else np.empty(tensor.shape, tensor.dtype)
            out.reshape(-1).view(np.uint8)[...] = sent
            return out
    else:
        call.agree(describe, signature=plan.signature)
    if not inplace:
        tensor = memory.xp.array(tensor, order="C", copy=True)
    data = memory.mover(process_set)
    with call.communicate():
        data.broadcast(tensor.reshape(-1), root)
    return tensor


def broadcast_(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Overwrite ``tensor`` on every rank with the root rank's values; returns ``tensor``.

    ``root_rank`` is a global rank, also on a process set (Horovod's rule).
    """
    return broadcast_in(memory_of(tensor), tensor, root_rank, name, process_set, True)


def broadcast(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return a new array holding the root rank's ``tensor`` on every rank."""
    return broadcast_in(memory_of(tensor), tensor, root_rank, name, process_set, False)


# -- alltoall -------------------------------------------------------------------------------
def _check_splits(splits: Any, rows: int, size: int) -> np.ndarray:
    """The rows to send to each rank, from ``splits`` or an equal division of ``rows``."""
    if splits is None:
        if rows % size:
            raise ValueError(f"tensor's first dimension ({rows}) is not divisible by the number "
                             f"of ranks ({size}); pass splits=")
        return np.full(size, rows // size, np.int64)
    given = np.asarray(splits)
    if given.dtype.kind not in "iu":
        raise TypeError(f"splits must hold integers, got dtype {given.dtype} "
                        f"({given.reshape(-1).tolist()})")
    send_rows = given.astype(np.int64).reshape(-1)
    if send_rows.size != size or (send_rows < 0).any() or send_rows.sum() != rows:
        raise ValueError(f"splits={send_rows.tolist()} must hold {size} non-negative "
                         f"counts summing to the first dimension of tensor ({rows})")
    return send_rows


def alltoall(tensor: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set
             ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank i; gather what arrives.

    Without ``splits`` dim 0 is divided equally. As in Horovod, the received row counts are
    returned too (``(output, received_splits)``) only when ``splits`` is given.
    """
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "alltoall", name) as call:
        with call.checks():
            check_array(tensor, "tensor")
            check_rows(tensor, "tensor", "alltoall")
            tensor = np.ascontiguousarray(tensor)
            send_rows = _check_splits(splits, tensor.shape[0], comm.size)
        call.agree(lambda: {"tensors": [describe_tensor(tensor, call.name, dim0=False)]})
        recv_rows = np.empty(comm.size, np.int64)
        row = int(np.prod(tensor.shape[1:], dtype=np.int64))
        with call.communicate():
            comm.alltoallv(send_rows, [1] * comm.size, recv_rows, [1] * comm.size)
            out = np.empty((int(recv_rows.sum()),) + tensor.shape[1:], tensor.dtype)
            comm.alltoallv(tensor.reshape(-1), (send_rows * row).tolist(),
                           out.reshape(-1), (recv_rows * row).tolist())
        return out if splits is None else (out, recv_rows)


# -- reducescatter --------------------------------------------------------------------------
def rows_per_rank(rows: int, size: int) -> List[int]:
    """Horovod's split of dim 0: as even as possible, the first ranks taking one extra row."""
    bounds = split_evenly(rows, size)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def reducescatter(tensor: np.ndarray, op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of dim 0's rows."""
    return scatter_reduce(memory_of(tensor), [tensor], op, name, process_set, prescale_factor,
                          postscale_factor, "reducescatter")[0]


def grouped_reducescatter(tensors: Sequence[np.ndarray], op: Any = Average,
                          name: Optional[str] = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[np.ndarray]:
    """:func:`reducescatter` on each tensor of a list, agreed on in one exchange."""
    return scatter_reduce(memory_of(tensors), tensors, op, name, process_set, prescale_factor,
                          postscale_factor, "grouped_reducescatter")


def scatter_reduce(memory: Memory, tensors: Sequence[Any], op: Any, name: Optional[str],
                   process_set: ProcessSet, prescale_factor: float, postscale_factor: float,
                   kind: str, halves: str = ROUNDED_ONCE) -> List[Any]:
    """The reducescatter family: each rank gets its share of dim 0 of each reduced tensor;
    ``halves`` as in :func:`reduce_group`."""
    comm = runtime.communicator(process_set)
    with memory.active(), agreement.collective(comm, kind, name) as call:
        with call.checks():
            if kind == "reducescatter":
                tensors, arg = [memory.check(tensors[0], "tensor")], "tensor"
            else:
                tensors, arg = check_list(tensors, memory), "tensors[{}]"
            for i, t in enumerate(tensors):
                check_rows(t, arg.format(i), "reducescatter")
            op = check_reduction(op, prescale_factor, postscale_factor)
        call.agree(lambda: describe_reduction(call.name, tensors, op, prescale_factor,
                                              postscale_factor))
        pre, post = scales(op, comm, prescale_factor, postscale_factor)
        data = memory.mover(process_set)
        results = []
        for t in tensors:
            row = int(np.prod(t.shape[1:], dtype=np.int64))
            shares = rows_per_rank(t.shape[0], comm.size)
            work = prescaled(memory, t, pre)
            if half_in_float32(t, op, pre, post, halves):
                work = work.astype(memory.xp.float32)
            with call.communicate():
                mine = data.reduce_scatter(work, [s * row for s in shares], BACKEND_OP[op])
            out = memory.xp.empty((shares[comm.rank],) + t.shape[1:], work.dtype)
            memory.unpack(mine, [out], post)
            results.append(out.astype(t.dtype, copy=False))
        return results


def any_rank(flags: Sequence[bool], name: str,
             process_set: ProcessSet = global_process_set) -> List[bool]:
    """Whether each of ``flags`` is set on some rank of the process set: or-ed in the one
    small exchange of the call's agreement, without a data phase."""
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "any_rank", name) as call:
        return call.agree(dict, flags=np.array(flags, bool)).tolist()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the process set arrives.

    It is an agreement exchange, so the stall inspector watches it; the (empty) flags keep it
    an exchange even inside ``agreement.covered``.
    """
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "barrier", None) as call:
        call.agree(dict, _NO_FLAGS, ())


_NO_FLAGS = np.zeros(0, bool)
