"""horovod.torch's reducescatter and grouped_reducescatter on torch.Tensor, with their
autograd functions."""
from typing import Any, List, Optional, Sequence

import torch

from ..collectives import arguments
from ..collectives import ops as core
from ..collectives.arguments import Average, Sum
from ..coordination.handles import Handle
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .allgather_ops import grouped_allgather
from .calls import checked, no_adasum, not_differentiable, start, synchronize, tensor_list
from .compression import Compression

def reducescatter_async(tensor: torch.Tensor, op: Any = Average, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` across the set; :func:`synchronize` returns this rank's rows
    of the result (dim 0 split as evenly as possible, lower ranks taking one more)."""
    op, tensor = checked("reducescatter", name, process_set, lambda: (
        no_adasum(arguments.requested_op(op, None), "reducescatter"),
        bridge.check_tensor(tensor, "tensor")))
    return start(core.reducescatter, bridge.view(tensor), op, name, process_set,
                  prescale_factor, postscale_factor, on=tensor, name=name, process_set=process_set)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], op: Any = Average,
                                name: Optional[str] = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """:func:`reducescatter_async` of each tensor of a list, agreed on in one exchange."""
    op, tensors = checked("grouped_reducescatter", name, process_set, lambda: (
        no_adasum(arguments.requested_op(op, None), "grouped_reducescatter"), tensor_list(tensors)))
    return start(core.grouped_reducescatter, [bridge.view(t) for t in tensors], op, name,
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
    not_differentiable("reducescatter", op)
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
    tensors = checked("grouped_reducescatter", name, process_set, lambda: tensor_list(tensors))
    packed = [compression.compress(t) for t in tensors]
    shares = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                               postscale_factor, *[t for t, _ in packed])
    return [compression.decompress(s, c) for s, (_, c) in zip(shares, packed)]
