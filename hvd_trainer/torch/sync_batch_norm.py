"""``SyncBatchNorm``: batch normalization over the whole batch of a process set, as Horovod's.

In training, the mean and variance are those of every rank's batch together (ranks may hold
different numbers of samples), and the running statistics are updated with them, so every
rank computes what one process computes on the concatenated batch. The input gradient is
that of the global batch too. The weight and bias gradients stay local, as in Horovod: the
gradient allreduce of data-parallel training sums them. In evaluation, with running
statistics, it is an ordinary local BatchNorm.
"""
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..collectives.arguments import Sum
from ..runtime.runtime import ProcessSet, global_process_set
from . import backward_collectives, calls, ops

__all__ = ["SyncBatchNorm"]

_NAME = "sync_batch_norm"


def _per_channel(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast along dim 1 of a ``dims``-dimensional input."""
    return t.reshape((1, -1) + (1,) * (dims - 2))


class _SyncBatchNorm(torch.autograd.Function):
    """Forward and backward of batch normalization with statistics over the process set."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        reduce_dims = [0] + list(range(2, x.dim()))
        count = x.numel() // x.shape[1]
        # Each rank's count, mean and sum of squared deviations, combined exactly (Chan et
        # al.'s pairwise rule) in float64, which also keeps large counts exact.
        local = x.detach().to(torch.float64)
        mean = local.mean(reduce_dims) if count else torch.zeros(x.shape[1], dtype=torch.float64,
                                                                  device=x.device)
        m2 = ((local - _per_channel(mean, x.dim())) ** 2).sum(reduce_dims)
        stats = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                           mean, m2])
        every = ops.allgather(stats.unsqueeze(0), name=f"{_NAME}.stats",
                              process_set=process_set)
        counts, means, m2s = every[:, :1], every[:, 1:1 + x.shape[1]], every[:, 1 + x.shape[1]:]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        var = global_m2 / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * global_mean.to(running_mean.dtype))
            unbiased = global_m2 / (total - 1) if total > 1 else var
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        mean_c = global_mean.to(x.dtype)
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        scale = invstd if weight is None else invstd * weight
        out = (x - _per_channel(mean_c, x.dim())) * _per_channel(scale, x.dim())
        if bias is not None:
            out = out + _per_channel(bias, x.dim())
        ctx.save_for_backward(x, weight, mean_c, invstd)
        ctx.total, ctx.process_set = total.item(), process_set
        if ctx.needs_input_grad[0]:
            backward_collectives.expect()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = x.dim()
        reduce_dims = [0] + list(range(2, dims))
        xmu = x - _per_channel(mean, dims)
        sum_dy = grad_out.sum(reduce_dims)
        sum_dy_xmu = (grad_out * xmu).sum(reduce_dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # The input gradient needs both sums over the global batch.
            both = ops.allreduce(torch.stack([sum_dy, sum_dy_xmu]), op=Sum,
                                 name=f"{_NAME}.grad", process_set=ctx.process_set)
            backward_collectives.done()
            mean_dy, mean_dy_xmu = both[0] / ctx.total, both[1] / ctx.total
            scale = invstd if weight is None else invstd * weight
            grad_x = (grad_out - _per_channel(mean_dy, dims)
                      - xmu * _per_channel(invstd * invstd * mean_dy_xmu, dims)) \
                * _per_channel(scale, dims)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * invstd
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``SyncBatchNorm``: ``torch.nn.BatchNorm*d`` with statistics over the process
    set in training. Takes inputs of 2 or more dimensions (N, C, ...) on the CPU.

    Training steps are collectives of the process set; outside it, and on a set of one rank,
    it is a local BatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: Any) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, "
                             f"...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        batch_stats = self.training or not self.track_running_stats
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        if not batch_stats or not self.process_set.included() or self.process_set.size() == 1:
            self._check_input_dim(input)
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, batch_stats, factor, self.eps)
        # A bad input on one rank is refused on all: the refusal meets the others' allgather.
        calls.checked("allgather", f"{_NAME}.stats", self.process_set,
                     lambda: self._check_input_dim(input))
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean,
                                    self.running_var, self.eps, factor, self.process_set)
