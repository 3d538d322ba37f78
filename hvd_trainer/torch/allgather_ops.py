"""horovod.torch's allgather and grouped_allgather on torch.Tensor, with their autograd
functions (Horovod's rule: the incoming gradients are averaged across the set and each rank
takes back the rows it contributed)."""
from typing import List, Optional, Sequence

import torch

from ..collectives import ops as core
from ..collectives.arguments import Average
from ..coordination.handles import Handle
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .allreduce_ops import allreduce, grouped_allreduce
from .calls import checked, start, synchronize, tensor_list

def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (which may differ per rank)."""
    tensor = checked("allgather", name, process_set,
                      lambda: bridge.check_tensor(tensor, "tensor"))
    return start(core.allgather, bridge.view(tensor), name, process_set, on=tensor, name=name,
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
    tensors = checked("grouped_allgather", name, process_set, lambda: tensor_list(tensors))
    return start(core.grouped_allgather, [bridge.view(t) for t in tensors], name, process_set,
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
    tensors = checked("grouped_allgather", name, process_set, lambda: tensor_list(tensors))
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))
