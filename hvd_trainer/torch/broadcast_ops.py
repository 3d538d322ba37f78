"""horovod.torch's broadcast on torch.Tensor (in place, out of place, asynchronous), with its
autograd function."""
from typing import Optional

import torch

from ..collectives import ops as core
from ..collectives.arguments import Average
from ..coordination.handles import Handle
from ..runtime.runtime import ProcessSet, global_process_set, rank
from . import bridge
from .allreduce_ops import allreduce
from .calls import checked, start, synchronize

def _broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                     process_set: ProcessSet, inplace: bool) -> Handle:
    tensor = checked("broadcast", name, process_set,
                      lambda: bridge.check_tensor(tensor, "tensor", inplace))
    collective = core.broadcast_ if inplace else core.broadcast
    return start(collective, bridge.view(tensor), root_rank, name, process_set,
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
