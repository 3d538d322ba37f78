"""horovod.torch's allreduce family on torch.Tensor: allreduce, grouped_allreduce (in place,
out of place, asynchronous), their autograd functions, and sparse_allreduce_async.

CPU tensors are reduced through views of their memory (bridge.py): an in-place function writes
into the tensor it is given, an out-of-place one returns a tensor that adopts the core's result
array. CUDA tensors go the same way to the core's GPU collectives, as CuPy arrays sharing their
memory, in order with PyTorch's current stream at the call (the rule is in bridge.py's
docstring); ``sparse_allreduce_async`` and ``op=Adasum``, which the core runs on the host only,
copy CUDA tensors through host memory. Until a handle is synchronized, its tensors must not be
modified. The out-of-place functions are autograd functions with Horovod's backward rule.
"""
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..backends.halves import is_half
from ..collectives import adasum, arguments, sparse
from ..collectives import ops as core
from ..collectives.arguments import Average, Sum
from ..collectives.memory import KernelMemory
from ..coordination.handles import Handle
from ..runtime.runtime import ProcessSet, global_process_set
from ..training.kinds import table_shape
from . import bridge
from . import sparse as torch_sparse
from .calls import (CallableHandle, checked, is_adasum, no_adasum, not_differentiable, start,
                    synchronize, tensor_list)
from .compression import KERNELS, Compression

_SPARSE = "sparse_allreduce"  # the base name of an unnamed sparse allreduce's collectives

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
    if is_adasum(op):
        staged = bridge.host_view(tensor)
        return start(adasum.grouped_allreduce, [staged], name, prescale_factor,
                      postscale_factor, process_set, inplace,
                      finish=(lambda _: bridge.write_back(staged, tensor)) if inplace
                      else lambda out: bridge.on_device(out[0], tensor), on=tensor,
                      name=name, process_set=process_set)
    return start(_reduce_group("allreduce", inplace), [bridge.view(tensor)], op, name,
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
        not_differentiable("allreduce", ctx.op)
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
        arguments.requested_op(op, average), tensor_list(tensors, inplace)))
    first = tensors[0] if tensors else None
    if is_adasum(op):
        staged = [bridge.host_view(t) for t in tensors]
        return start(adasum.grouped_allreduce, staged, name, prescale_factor,
                      postscale_factor, process_set, inplace,
                      finish=(lambda _: [bridge.write_back(a, t)
                                         for a, t in zip(staged, tensors)]) if inplace
                      else lambda out: [bridge.on_device(a, t) for a, t in zip(out, tensors)],
                      on=first, name=name, process_set=process_set)
    finish = (lambda _: list(tensors)) if inplace else (lambda out: [bridge.adopt(a) for a in out])
    return start(_reduce_group("grouped_allreduce", inplace), [bridge.view(t) for t in tensors],
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
        not_differentiable("grouped_allreduce", ctx.op)
        grads = grouped_allreduce(list(grad_outputs), op=ctx.op, prescale_factor=ctx.scales[0],
                                  postscale_factor=ctx.scales[1], process_set=ctx.process_set)
        return (None,) * 6 + tuple(grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Like :func:`grouped_allreduce_` but returns new tensors; gradients flow through it."""
    tensors = checked("grouped_allreduce", name, process_set, lambda: tensor_list(tensors))
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
        reduce_op = no_adasum(arguments.requested_op(op, None), "sparse_allreduce_async")
        if reduce_op not in (Average, Sum):
            raise ValueError(f"op={reduce_op!r}: sparse_allreduce_async takes Average or Sum")
        return reduce_op, tensor.detach().coalesce().cpu()

    # The core's first step is the allgather of the ids, which a refusal stands in for.
    op, coalesced = checked("allgather", f"{name or _SPARSE}.ids", process_set, check)
    return start(_sparse_allreduce, coalesced, name, op, process_set,
                  finish=lambda result: result.to(tensor.device), handle=CallableHandle,
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
