"""horovod.torch's alltoall on torch.Tensor, with its autograd function. The core's alltoall
runs on the host, so a CUDA tensor travels through host memory."""
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..collectives import ops as core
from ..coordination.handles import Handle
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .calls import checked, start, synchronize

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

    return start(core.alltoall, bridge.host_view(tensor), split_rows, name, process_set,
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
