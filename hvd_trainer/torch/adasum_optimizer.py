"""DistributedOptimizer(op=Adasum): the ranks combine their optimizers' updates, not their
gradients, by adaptive summation, as Horovod's Adasum optimizer does.

At ``step()`` each rank applies the wrapped optimizer to its own gradients, which moves its
weights by an update (its delta); the ranks then combine their deltas by the core's Adasum
(:mod:`hvd_trainer.collectives.adasum`, each parameter with its own coefficients, in one grouped
call), and every rank sets its weights to where they were before the step plus the combined delta.
So the weights stay equal on every rank while the optimizer's state (momentum, Adam's
moments) follows each rank's own gradients, as in Horovod.

The process set must have a power-of-two number of ranks, as Adasum's pairwise tree needs:
the constructor refuses any other size on every rank (the size is known to all of them).
"""
from typing import Any, Callable, Dict, List, Optional

import torch

from ..collectives.adasum import AdasumSizeError
from ..runtime.runtime import ProcessSet
from . import ops
from .compression import Compression

_NAME = "DistributedOptimizer.adasum"


def check_adasum(compression: Any, process_set: ProcessSet) -> None:
    """Refuse what op=Adasum cannot combine: a set that is not a power of two of ranks, and
    compressors other than Horovod's (the deltas travel through an Adasum allreduce)."""
    size = process_set.size()
    if size & (size - 1):
        raise AdasumSizeError(f"DistributedOptimizer(op=Adasum) needs a power-of-two number "
                              f"of ranks, as in Horovod; the process set has {size}: use "
                              f"op=Average, or a process set of {1 << (size.bit_length() - 1)} "
                              "ranks")
    if compression not in (Compression.none, Compression.fp16):
        raise ValueError("DistributedOptimizer(op=Adasum) takes compression=Compression.none "
                         "or Compression.fp16; packed codecs reduce by sums, not by Adasum")


class AdasumDistributed:
    """The methods that DistributedOptimizer(op=Adasum) adds to the wrapped optimizer's
    class."""

    def _set_up(self, names: Dict[torch.Tensor, str], compression: Any, passes: int,
                process_set: ProcessSet) -> None:
        self._parameter_names = names
        self._compression = compression
        self._process_set = process_set
        self.backward_passes_per_step = passes
        self._params: List[torch.nn.Parameter] = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def synchronize(self) -> None:
        """Nothing to wait for: with op=Adasum, ``step()`` combines the updates, as in
        Horovod."""

    def skip_synchronize(self) -> None:
        """Refused, as in Horovod: the updates are combined in ``step()`` itself."""
        raise RuntimeError("DistributedOptimizer(op=Adasum) combines the ranks' updates in "
                           "step(), which cannot skip it; call step() without "
                           "skip_synchronize() (clip gradients before step() as usual: they "
                           "are this rank's own)")

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Refused: with op=Adasum the ranks combine updates, not gradient buckets."""
        raise ValueError("DistributedOptimizer(op=Adasum) combines the ranks' updates, so it "
                         "has no gradient buckets to hook; use op=hvd.Average with "
                         "register_comm_hook(None, hooks.adasum_hook) to combine gradients "
                         "by Adasum instead")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Record ``passes``; gradients accumulate in ``.grad`` until ``step()`` whatever it
        is, and the local step uses them all."""
        self.backward_passes_per_step = passes

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The wrapped step on this rank's gradients, then the ranks' updates combined by
        Adasum and applied on every rank; returns the closure's loss. A collective of the
        process set."""
        if not self._process_set.included():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            starts = [p.detach().clone() for p in self._params]
        super().step()
        with torch.no_grad():
            packed = [self._compression.compress(p.detach() - start)
                      for p, start in zip(self._params, starts)]
            combined = ops.grouped_allreduce([delta for delta, _ in packed], name=_NAME,
                                             op=ops.Adasum, process_set=self._process_set)
            for p, start, delta, (_, ctx) in zip(self._params, starts, combined, packed):
                p.copy_(start.add_(self._compression.decompress(delta, ctx)))
        return loss
