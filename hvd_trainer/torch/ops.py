"""horovod.torch's collectives on torch.Tensor, synchronous and asynchronous, over the core.

Every collective runs on the core's communication thread (see
``hvd_trainer/coordination/work_order.py``) in the order of the calls, as Horovod's background
thread runs them: an ``*_async`` function returns a handle at once, :func:`poll` says whether it has
finished and :func:`synchronize` waits for it and returns its result (or raises its error). A
synchronous function is its ``*_async`` form followed by :func:`synchronize`, so both kinds may be
mixed freely.

CPU tensors are reduced through views of their memory (bridge.py): an in-place function
writes into the tensor it is given, an out-of-place one returns a tensor that adopts the
core's result array. CUDA tensors go the same way to the core's GPU collectives, as CuPy
arrays sharing their memory, in order with PyTorch's current stream at the call (the rule is
in bridge.py's docstring); ``alltoall``, ``sparse_allreduce_async`` and ``op=Adasum``, which
the core runs on the host only, copy CUDA tensors through host memory. Until a handle is
synchronized, its tensors must not be modified.

Errors are collective. The adapter's own argument checks run at the call; one that fails
goes through the core's agreement (``ops.refuse``), so the rank that made the bad call raises
at once and every other rank raises the same error from :func:`synchronize`. Errors reaching
the caller through :func:`synchronize` are ``HorovodInternalError`` (see errors.py).

The out-of-place functions are autograd functions with Horovod's backward rules, documented
on each.
"""
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch

from ..collectives import adasum, arguments, objects, sparse
from ..collectives import joined as core_join
from ..collectives import ops as core
from ..coordination import work_order
from ..backends.halves import is_half
from ..coordination.handles import Handle
from ..collectives.memory import KernelMemory
from ..collectives.arguments import Average, Sum
from ..runtime.runtime import ProcessSet, global_process_set, rank
from ..training.kinds import table_shape
from . import bridge
from . import sparse as torch_sparse
from .compression import KERNELS, Compression
from .errors import as_horovod_error

# Horovod's value of op=Adasum: allreduce and grouped_allreduce combine by adaptive summation
# (see hvd_trainer/collectives/adasum.py).
Adasum = 2
_SPARSE = "sparse_allreduce"  # the base name of an unnamed sparse allreduce's collectives
T = TypeVar("T")


# -- handles --------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """Whether the asynchronous collective behind ``handle`` has finished; never blocks."""
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for the asynchronous collective behind ``handle``; return its result.

    Its error, if it failed, is raised here as a ``HorovodInternalError`` that is also the
    core's ``ValueError``, ``TypeError`` or ``MismatchError``.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be a handle returned by an *_async function, got "
                        f"{type(handle).__name__}")
    try:
        return handle.wait()
    except (ValueError, TypeError, RuntimeError) as error:
        translated = as_horovod_error(error)
        if translated is error:
            raise
        raise translated.with_traceback(error.__traceback__) from None


class _CallableHandle(Handle):
    """:func:`sparse_allreduce_async`'s handle: Horovod's is a function that returns the
    result, so this one may also be called."""

    def __call__(self) -> Any:
        return synchronize(self)


def _start(collective: Callable[..., Any], *args: Any,
           finish: Callable[[Any], Any] = bridge.adopt, handle: type = Handle,
           on: Optional[torch.Tensor] = None, gpu_core: bool = True,
           name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Run ``finish(collective(*args))`` on the communication thread; return its handle.

    ``name`` and ``process_set`` are the collective's: its name (or automatic name) is taken
    now, in the caller's order, and one that is still pending raises ``ValueError`` here.

    When ``on`` is a CUDA tensor, the work runs in order with PyTorch's current stream on its
    device, taken now (``bridge.ordered``; ``gpu_core=False`` for work that never reaches
    CuPy).
    """
    ordered = None if on is None else bridge.ordered(on, gpu_core)
    if ordered is None:
        return handle(work_order.start(lambda: finish(collective(*args)), name, process_set))

    def run() -> Any:
        with ordered():
            return finish(collective(*args))

    return handle(work_order.start(run, name, process_set))


def checked(kind: str, name: Optional[str], process_set: ProcessSet, check: Callable[[], T]) -> T:
    """Run an argument ``check``; its error is raised on every rank of the process set.

    The refusal takes the collective's place on the communication thread, so it meets the
    other ranks' call of the same collective, in order.
    """
    try:
        return check()
    except (TypeError, ValueError) as error:
        synchronize(_start(arguments.refuse, error, kind, name, process_set, name=name,
                           process_set=process_set))
        raise AssertionError("unreachable: ops.refuse raises") from error


def _tensors(tensors: Sequence[torch.Tensor], inplace: bool = False) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors must be a list of tensors, got a single tensor; wrap it in a "
                        "list")
    checked_tensors = [bridge.check_tensor(t, f"tensors[{i}]", inplace)
                       for i, t in enumerate(tensors)]
    for i, t in enumerate(checked_tensors[1:], 1):
        if t.device != checked_tensors[0].device:
            raise ValueError(f"tensors[{i}] is on {t.device} but tensors[0] on "
                             f"{checked_tensors[0].device}; a group's tensors must share one "
                             "device (move them, or make one call per device)")
    return checked_tensors


def _is_adasum(op: Any) -> bool:
    return isinstance(op, int) and not isinstance(op, bool) and op == Adasum


def _no_adasum(op: Any, kind: str) -> Any:
    if _is_adasum(op):
        raise ValueError(f"{kind} does not take op=Adasum (nor does Horovod's); use op=Average "
                         "or op=Sum")
    return op


def _not_differentiable(kind: str, op: Any) -> None:
    if op not in (Average, Sum):
        what = "Adasum" if _is_adasum(op) else arguments.ReduceOp(op).name.title()
        raise RuntimeError(f"{kind} with op={what} has no gradient here; only Average and Sum "
                           "are differentiable")


# -- allreduce ------------------------------------------------------------------------------
_HOST = KernelMemory(KERNELS)  # CPU tensors: float16 and bfloat16 sums on torch's kernels


def _reduce_group(kind: str, inplace: bool) -> Callable[..., List[Any]]:
    """The core's allreduce of ``kind`` on a list of tensor views (op, name, scale factors and
    process set follow): CPU float16 and bfloat16 views sum on torch's kernels, the others
    go through the core's own function."""
    def collective(arrays: List[Any], *args: Any) -> List[Any]:
        if arrays and all(isinstance(a, np.ndarray) and is_half(a.dtype) for a in arrays):
            return core.reduce_group(_HOST, arrays, *args, kind=kind, inplace=inplace)
        if kind == "allreduce":
            return [(core.allreduce_ if inplace else core.allreduce)(arrays[0], *args)]
        return (core.grouped_allreduce_ if inplace else core.grouped_allreduce)(arrays, *args)
    return collective


def _allreduce_async(tensor: torch.Tensor, inplace: bool, average: Optional[bool],
                     name: Optional[str], op: Any, prescale_factor: float,
                     postscale_factor: float, process_set: ProcessSet) -> Handle:
    op, tensor = checked("allreduce", name, process_set, lambda: (
        arguments.requested_op(op, average), bridge.check_tensor(tensor, "tensor", inplace)))
    if _is_adasum(op):
        staged = bridge.host_view(tensor)
        return _start(adasum.grouped_allreduce, [staged], name, prescale_factor,
                      postscale_factor, process_set, inplace,
                      finish=(lambda _: bridge.write_back(staged, tensor)) if inplace
                      else lambda out: bridge.on_device(out[0], tensor), on=tensor,
                      name=name, process_set=process_set)
    return _start(_reduce_group("allreduce", inplace), [bridge.view(tensor)], op, name,
                  prescale_factor, postscale_factor, process_set,
                  finish=(lambda _: tensor) if inplace else lambda out: bridge.adopt(out[0]),
                  on=tensor, name=name, process_set=process_set)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` across the process set (Average unless ``op`` says otherwise);
    :func:`synchronize` returns the result as a new tensor. ``tensor`` is left alone."""
    return _allreduce_async(tensor, False, average, name, op, prescale_factor,
                            postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``tensor`` (contiguous),
    which :func:`synchronize` returns."""
    return _allreduce_async(tensor, True, average, name, op, prescale_factor,
                            postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the process set in place; returns ``tensor``.

    The result is ``op`` over every rank's ``tensor * prescale_factor``, times
    ``postscale_factor``.
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce with a gradient: the incoming gradients are allreduced with the same op and
    scale factors (Average and Sum; the derivative of Min, Max and Product is not this)."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op = checked("allreduce", name, process_set,
                         lambda: arguments.requested_op(op, average))
        ctx.scales = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return synchronize(allreduce_async(tensor, None, name, ctx.op, prescale_factor,
                                           postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        _not_differentiable("allreduce", ctx.op)
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.scales[0],
                         postscale_factor=ctx.scales[1], process_set=ctx.process_set)
        return grad, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Like :func:`allreduce_` but returns a new tensor and leaves ``tensor`` alone.

    ``compression`` changes what travels (``Compression.fp16``). Gradients flow through it
    (see :class:`HorovodAllreduce`).
    """
    compressed, ctx = compression.compress(tensor)
    reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                     postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _grouped_allreduce_async(tensors: Sequence[torch.Tensor], inplace: bool,
                             average: Optional[bool], name: Optional[str], op: Any,
                             prescale_factor: float, postscale_factor: float,
                             process_set: ProcessSet) -> Handle:
    op, tensors = checked("grouped_allreduce", name, process_set, lambda: (
        arguments.requested_op(op, average), _tensors(tensors, inplace)))
    first = tensors[0] if tensors else None
    if _is_adasum(op):
        staged = [bridge.host_view(t) for t in tensors]
        return _start(adasum.grouped_allreduce, staged, name, prescale_factor,
                      postscale_factor, process_set, inplace,
                      finish=(lambda _: [bridge.write_back(a, t)
                                         for a, t in zip(staged, tensors)]) if inplace
                      else lambda out: [bridge.on_device(a, t) for a, t in zip(out, tensors)],
                      on=first, name=name, process_set=process_set)
    finish = (lambda _: list(tensors)) if inplace else (lambda out: [bridge.adopt(a) for a in out])
    return _start(_reduce_group("grouped_allreduce", inplace), [bridge.view(t) for t in tensors],
                  op, name, prescale_factor, postscale_factor, process_set, finish=finish,
                  on=first, name=name, process_set=process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a list of tensors as one fused operation; :func:`synchronize` returns
    new tensors."""
    return _grouped_allreduce_async(tensors, False, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`; :func:`synchronize` returns ``tensors``."""
    return _grouped_allreduce_async(tensors, True, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduce each tensor of a list in place, fused; returns ``tensors``."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce with gradients, by :class:`HorovodAllreduce`'s rule."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                *tensors):
        ctx.op = checked("grouped_allreduce", name, process_set,
                          lambda: arguments.requested_op(op, average))
        ctx.scales = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), None, name, ctx.op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        _not_differentiable("grouped_allreduce", ctx.op)
        grads = grouped_allreduce(list(grad_outputs), op=ctx.op, prescale_factor=ctx.scales[0],
                                  postscale_factor=ctx.scales[1], process_set=ctx.process_set)
        return (None,) * 6 + tuple(grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Like :func:`grouped_allreduce_` but returns new tensors; gradients flow through it."""
    tensors = checked("grouped_allreduce", name, process_set, lambda: _tensors(tensors))
    packed = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor,
                                            postscale_factor, process_set,
                                            *[t for t, _ in packed])
    return [compression.decompress(r, c) for r, (_, c) in zip(reduced, packed)]


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: Any,
                           process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a sparse COO tensor (Average or Sum) across the process set.

    Every rank's entries are gathered by the core's row allgather and entries with the same
    index are summed, so the result (a coalesced sparse tensor) holds exactly the indices
    present on some rank. Where the gathered entries would cost more than the dense tensor,
    they travel as a dense allreduce instead. :func:`synchronize` returns it; as in Horovod,
    calling the handle does too. A CUDA tensor's entries travel through host memory, and the
    result is on its device.
    """
    def check() -> Tuple[Any, torch.Tensor]:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            raise TypeError("tensor must be a sparse COO torch.Tensor, got "
                            f"{getattr(tensor, 'layout', type(tensor).__name__)}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise TypeError(f"tensor is on {tensor.device}; hvd_trainer.torch takes CPU and "
                            "CUDA tensors (pass tensor.cpu())")
        reduce_op = _no_adasum(arguments.requested_op(op, None), "sparse_allreduce_async")
        if reduce_op not in (Average, Sum):
            raise ValueError(f"op={reduce_op!r}: sparse_allreduce_async takes Average or Sum")
        return reduce_op, tensor.detach().coalesce().cpu()

    # The core's first step is the allgather of the ids, which a refusal stands in for.
    op, coalesced = checked("allgather", f"{name or _SPARSE}.ids", process_set, check)
    return _start(_sparse_allreduce, coalesced, name, op, process_set,
                  finish=lambda result: result.to(tensor.device), handle=_CallableHandle,
                  on=tensor, gpu_core=False, name=name, process_set=process_set)


def _sparse_allreduce(tensor: torch.Tensor, name: Optional[str], op: Any,
                      process_set: ProcessSet) -> torch.Tensor:
    ids, rows = torch_sparse.to_rows(tensor)
    num_rows = table_shape(tensor.shape, tensor.sparse_dim())[0]
    union, summed, _ = sparse.allreduce_rows(ids, rows, num_rows, name or _SPARSE,
                                             process_set=process_set)
    result = bridge.adopt(summed)
    if op == Average:
        result = result / process_set.size() if result.is_floating_point() \
            else result.div(process_set.size(), rounding_mode="trunc")
    return torch_sparse.from_rows(union, result, tensor.shape)


# -- allgather ------------------------------------------------------------------------------
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (which may differ per rank)."""
    tensor = checked("allgather", name, process_set,
                      lambda: bridge.check_tensor(tensor, "tensor"))
    return _start(core.allgather, bridge.view(tensor), name, process_set, on=tensor, name=name,
                  process_set=process_set)


def _rows_before(rows: int, process_set: ProcessSet) -> int:
    """How many rows the ranks before this one in the set contribute (a collective)."""
    every = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    return int(every[:process_set.rank()].sum())


class HorovodAllgather(torch.autograd.Function):
    """Allgather with a gradient, Horovod's rule: the incoming gradients are averaged across
    the set and each rank takes back the rows it contributed."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        gathered = synchronize(allgather_async(tensor, name, process_set))
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return gathered

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        offset = _rows_before(ctx.rows, ctx.process_set)
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; gradients flow through it."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start allgathering each tensor of a list, agreed on in one exchange."""
    tensors = checked("grouped_allgather", name, process_set, lambda: _tensors(tensors))
    return _start(core.grouped_allgather, [bridge.view(t) for t in tensors], name, process_set,
                  finish=lambda out: [bridge.adopt(a) for a in out],
                  on=tensors[0] if tensors else None, name=name, process_set=process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather with gradients, by :class:`HorovodAllgather`'s rule."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        gathered = synchronize(grouped_allgather_async(list(tensors), name, process_set))
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        every = allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                          process_set=ctx.process_set)
        offsets = every[:ctx.process_set.rank()].sum(dim=0).tolist()
        return (None, None) + tuple(g.narrow(0, o, r)
                                    for g, o, r in zip(grads, offsets, ctx.rows))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """:func:`allgather` each tensor of a list; gradients flow through it."""
    tensors = checked("grouped_allgather", name, process_set, lambda: _tensors(tensors))
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ------------------------------------------------------------------------------
def _broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                     process_set: ProcessSet, inplace: bool) -> Handle:
    tensor = checked("broadcast", name, process_set,
                      lambda: bridge.check_tensor(tensor, "tensor", inplace))
    collective = core.broadcast_ if inplace else core.broadcast
    return _start(collective, bridge.view(tensor), root_rank, name, process_set,
                  finish=(lambda _: tensor) if inplace else bridge.adopt, on=tensor,
                  name=name, process_set=process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start sending ``root_rank``'s ``tensor`` to every rank; :func:`synchronize` returns it
    as a new tensor. ``root_rank`` is a global rank, also on a process set."""
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`: ``tensor`` (contiguous) receives the root's values."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values on every rank; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast with a gradient, Horovod's rule: the incoming gradients are averaged across
    the set; the root keeps the average, the other ranks get zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``; gradients flow through it."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall -------------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Union[None, Sequence[int], torch.Tensor] = None,
                   name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank i of the set.

    Without ``splits`` dim 0 is divided equally. :func:`synchronize` returns
    ``(output, received_splits)``, the second an int32 CPU tensor of the rows from each rank.
    A CUDA tensor travels through host memory (the core's alltoall is host-only); the output
    is on its device.
    """
    def check() -> Tuple[torch.Tensor, Any]:
        t = bridge.check_tensor(tensor, "tensor")
        if splits is None:
            if t.dim() and t.shape[0] % process_set.size() == 0:
                # Explicit equal splits, so the core also reports the rows received.
                return t, [t.shape[0] // process_set.size()] * process_set.size()
            return t, None
        given = (splits.detach().cpu().numpy() if isinstance(splits, torch.Tensor)
                 else np.asarray(splits))
        if given.size and given.dtype.kind not in "iu":
            # Horovod raises ValueError here (its splits are an int32 tensor).
            raise ValueError(f"splits must hold integers, got dtype {given.dtype} "
                             f"({given.reshape(-1).tolist()}); pass "
                             "torch.tensor(splits, dtype=torch.int32)")
        return t, given.astype(np.int64)

    tensor, split_rows = checked("alltoall", name, process_set, check)

    def finish(result: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        # split_rows is None only where the core refuses the call, so a result is a pair.
        output, received = result
        return bridge.on_device(output, tensor), torch.from_numpy(received.astype(np.int32))

    return _start(core.alltoall, bridge.host_view(tensor), split_rows, name, process_set,
                  finish=finish, on=tensor, name=name, process_set=process_set)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall with a gradient: the incoming gradients go back by an alltoall with the
    received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_):
        grad, _ = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Union[None, Sequence[int], torch.Tensor] = None,
             name: Optional[str] = None, process_set: ProcessSet = global_process_set
             ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Send ``splits[i]`` rows of ``tensor`` to rank i; return what arrives, and, as in
    Horovod, the received splits too when ``splits`` is given. Gradients flow through it."""
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# -- reducescatter --------------------------------------------------------------------------
def reducescatter_async(tensor: torch.Tensor, op: Any = Average, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` across the set; :func:`synchronize` returns this rank's rows
    of the result (dim 0 split as evenly as possible, lower ranks taking one more)."""
    op, tensor = checked("reducescatter", name, process_set, lambda: (
        _no_adasum(arguments.requested_op(op, None), "reducescatter"),
        bridge.check_tensor(tensor, "tensor")))
    return _start(core.reducescatter, bridge.view(tensor), op, name, process_set,
                  prescale_factor, postscale_factor, on=tensor, name=name, process_set=process_set)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], op: Any = Average,
                                name: Optional[str] = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """:func:`reducescatter_async` of each tensor of a list, agreed on in one exchange."""
    op, tensors = checked("grouped_reducescatter", name, process_set, lambda: (
        _no_adasum(arguments.requested_op(op, None), "grouped_reducescatter"), _tensors(tensors)))
    return _start(core.grouped_reducescatter, [bridge.view(t) for t in tensors], op, name,
                  process_set, prescale_factor, postscale_factor,
                  finish=lambda out: [bridge.adopt(a) for a in out],
                  on=tensors[0] if tensors else None, name=name, process_set=process_set)


def _scatter_gradient(grads: List[torch.Tensor], op: Any, scale: float,
                      process_set: ProcessSet) -> List[torch.Tensor]:
    """The gradient of a reducescatter, Horovod's rule: every rank's incoming gradient,
    gathered in rank order, times the scale factors and, for Sum, the set's size.

    That is the gradient of the sum of every rank's loss with respect to an input that
    every rank holds alike: Sum makes each rank's share size times that input's rows,
    Average makes it those rows.
    """
    _not_differentiable("reducescatter", op)
    gathered = grouped_allgather(grads, process_set=process_set)
    factor = scale * (process_set.size() if op == Sum else 1)
    return [g * factor if factor != 1.0 else g for g in gathered]


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter with a gradient (see :func:`_scatter_gradient`)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op = checked("reducescatter", name, process_set,
                         lambda: arguments.requested_op(op, None))
        ctx.process_set = process_set
        ctx.scale = prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, ctx.op, name, process_set,
                                               prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad, = _scatter_gradient([grad_output], ctx.op, ctx.scale, ctx.process_set)
        return grad, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, op: Any = Average, name: Optional[str] = None,
                  compression: Any = Compression.none,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across the set and return this rank's rows; gradients flow."""
    compressed, ctx = compression.compress(tensor)
    share = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                       postscale_factor)
    return compression.decompress(share, ctx)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter with gradients (see :func:`_scatter_gradient`)."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op = checked("grouped_reducescatter", name, process_set,
                          lambda: arguments.requested_op(op, None))
        ctx.process_set = process_set
        ctx.scale = prescale_factor * postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), ctx.op, name, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = _scatter_gradient(list(grad_outputs), ctx.op, ctx.scale, ctx.process_set)
        return (None,) * 5 + tuple(grads)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], op: Any = Average,
                          name: Optional[str] = None, compression: Any = Compression.none,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """:func:`reducescatter` of each tensor of a list, agreed on in one exchange."""
    tensors = checked("grouped_reducescatter", name, process_set, lambda: _tensors(tensors))
    packed = [compression.compress(t) for t in tensors]
    shares = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                               postscale_factor, *[t for t, _ in packed])
    return [compression.decompress(s, c) for s, (_, c) in zip(shares, packed)]


# -- the rest -------------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the process set arrives."""
    synchronize(_start(core.barrier, process_set, finish=lambda _: None, process_set=process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (``root_rank`` is global)."""
    return synchronize(_start(objects.broadcast_object, obj, root_rank, name, process_set,
                              finish=lambda result: result, name=name, process_set=process_set))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    return synchronize(_start(objects.allgather_object, obj, name, process_set,
                              finish=lambda result: result, name=name, process_set=process_set))


def join(device: int = -1) -> int:
    """This rank has no more data: serve the other ranks' reductions with zeros until every
    rank has called join; return the global rank that joined last (of several joining
    together, the highest). See :mod:`hvd_trainer.collectives.joined` for what a joined rank serves.

    Meanwhile the other ranks' ``allreduce``, ``grouped_allreduce`` (their async forms and
    Adasum included), ``barrier`` and ``DistributedOptimizer`` steps run with zeros for this
    rank; ``Average`` divides by the full size, joined ranks included, as Horovod 0.28 does.
    Any other collective raises ``HorovodInternalError`` on every rank that called it while
    a rank is joined (Horovod refuses allgather, broadcast, alltoall and reducescatter), and
    so do calls that differ between the other ranks once each waits for its own (after a
    failure caught on some ranks only, say): this rank stays in join() until every rank has
    called it, never leaving the others waiting (see :func:`hvd_trainer.collectives.joined.join`).
    ``device`` says where Horovod makes its zeros; it is accepted and not used: a joined
    rank serves host tensors only (a collective on CUDA tensors raises while a rank is
    joined), and its zeros are host arrays.
    """
    return synchronize(_start(core_join.join, finish=lambda last: last))
