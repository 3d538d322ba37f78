"""horovod.torch.elastic's API: ``TorchState``, a torch ``ElasticSampler``, and the
framework-free core's ``run``, ``State``, ``ObjectState`` and errors.

``hvd.elastic.TorchState(model, optimizer, epoch=0, sampler=sampler)`` keeps the model's and
the optimizer's ``state_dict()`` (and those of any other module, optimizer or learning-rate
scheduler passed by keyword), the sampler's record and any picklable attributes across a
reset of the job (see :mod:`hvd_trainer.elastic`).
"""
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

import torch
import torch.utils.data

from .. import elastic as core
from ..runtime import runtime
from ..elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run
from ..training import hook_state
from ..training.reducer import Reducer
from .optimizer import _Distributed

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]


def _describe(tensor: torch.Tensor) -> Optional[Tuple[int, Any]]:
    # Sparse, quantized and nested tensors, and empty ones, are pickled as usual.
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested \
            or tensor.numel() == 0:
        return None
    return (tensor.numel() * tensor.element_size(),
            (tensor.dtype, tuple(tensor.shape), str(tensor.device), tensor.requires_grad))


def _copy(tensor: torch.Tensor, meta: Any, out: np.ndarray) -> None:
    """The tensor's bytes into ``out``, whatever its dtype (bfloat16 too) and device."""
    torch.from_numpy(out).view(meta[0]).view(meta[1]).copy_(tensor.detach())


def _rebuild(data: np.ndarray, meta: Any) -> torch.Tensor:
    dtype, shape, device, requires_grad = meta
    tensor = torch.from_numpy(data).view(dtype).view(shape)
    if device != "cpu":
        tensor = tensor.to(device)
    return tensor.requires_grad_(requires_grad)


core.register_array_type(torch.Tensor, "torch", _describe, _copy, _rebuild)


class ElasticSampler(torch.utils.data.Sampler, core.ElasticSampler):
    """This rank's sample indices of the epoch, for ``DataLoader(dataset, batch_size=B,
    sampler=sampler)``, such that a restart on another number of ranks spreads the samples
    not processed yet over the new ranks: none is lost or repeated within an epoch.

    The epoch's order is the core sampler's (a permutation fixed by ``seed`` and the epoch,
    or the identity without ``shuffle``); rank r of N takes every N-th sample of what is
    left, from the r-th, so the ranks' counts differ by at most one. Unlike Horovod's sampler
    nothing is padded with repeats: when the samples left are k·N·B + m with 0 < m < N, ranks
    below m get one more batch (of one sample) than the others, and the collectives that
    follow pair the wrong steps. The first :meth:`record_batch` of an iteration warns (on
    every rank) when that is so; use the core ``hvd_trainer.elastic.ElasticSampler`` as
    ``batch_sampler=`` where it can happen, or call ``hvd.join()`` at the end of each epoch
    (the ranks without the extra batch then serve its step with zeros).

    Call :meth:`record_batch` (Horovod's arguments: the batch's position and the
    DataLoader's batch size) after each batch, :meth:`set_epoch` at the end of each epoch,
    and keep the sampler in the :class:`TorchState`, which merges the ranks' records at a
    commit.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        core.ElasticSampler.__init__(self, len(dataset), 1, shuffle, seed)
        self.dataset = dataset
        self.indices: Optional[List[int]] = None  # this rank's samples of the running iteration
        self._left = self._ranks = 0  # the iteration's samples and ranks, all ranks together
        self._checked: Optional[int] = None  # the batch size the iteration was checked for

    def _mine(self) -> List[int]:
        runtime.init()
        return [i for batch in self.batches(runtime.rank(), runtime.size()) for i in batch]

    def __iter__(self) -> Iterator[int]:  # type: ignore[override]
        self.indices = self._mine()
        self._left = int(self.num_samples - self.processed.sum())
        self._ranks, self._checked = runtime.size(), None
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self._mine())

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """The samples of the ``batch_idx``-th batch of ``batch_size`` of the current
        iteration on this rank (the DataLoader's ``batch_size``)."""
        if self.indices is None:
            raise ValueError(f"ElasticSampler.get_indices({batch_idx}, {batch_size}): no "
                             "iteration has started; iterate the DataLoader first")
        start = batch_idx * batch_size
        if batch_size < 1 or not 0 <= start < len(self.indices):
            raise ValueError(f"ElasticSampler.get_indices({batch_idx}, {batch_size}): the "
                             f"current iteration has {len(self.indices)} samples on this rank; "
                             "pass the position of a batch the DataLoader handed out and its "
                             "batch_size")
        return self.indices[start:start + batch_size]

    def record_indices(self, indices: Sequence[int]) -> None:
        """Mark this rank's ``indices`` as processed."""
        self.record(indices)

    def record_batch(self, batch_idx: int, batch_size: int) -> None:  # type: ignore[override]
        """Mark the ``batch_idx``-th batch of ``batch_size`` of the current iteration as
        processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))
        if batch_size != self._checked:
            self._checked = batch_size
            self._warn_if_uneven(batch_size)

    def _warn_if_uneven(self, batch_size: int) -> None:
        """Warn when the iteration gives some ranks one more batch than others."""
        extra = self._left % (self._ranks * batch_size)
        if 0 < extra < self._ranks:
            warnings.warn(
                f"ElasticSampler: {self._left} samples are left in epoch {self.epoch} for "
                f"{self._ranks} ranks with batches of {batch_size}, so ranks 0 to {extra - 1} "
                "get one more batch, of one sample, than the others, and the collectives "
                "that follow pair the wrong steps (unless the DataLoader drops last batches, "
                "which skips those samples); use hvd_trainer.elastic.ElasticSampler("
                f"len(dataset), {batch_size}) as the DataLoader's batch_sampler instead, or "
                "call hvd.join() at the end of each epoch",
                RuntimeWarning, stacklevel=3)


class TorchState(ObjectState):
    """The state of a PyTorch training process (horovod.torch.elastic.TorchState).

    ``model``, ``optimizer`` and every keyword value that is a ``torch.nn.Module``, a
    ``torch.optim.Optimizer`` (a DistributedOptimizer too) or a learning-rate scheduler stay
    the script's objects: a commit holds their ``state_dict()`` (weights and buffers;
    optimizer states such as momentum, with every parameter group's options) and a restore
    loads it back into them. A DistributedOptimizer with an error-feedback compressor also
    has every rank's residuals in the commit (they restore exactly on as many ranks, and
    start from zero, with a warning, on another number). An :class:`ElasticSampler` is kept
    likewise, its record merged over the ranks at each commit. Other keyword values
    (``epoch``, ``batch``, ...) are picklable attributes, as in :class:`ObjectState`.
    """

    kept = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any):
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    def _reducers(self) -> Dict[str, Reducer]:
        """The gradient reducers of the DistributedOptimizers among the attributes, by name
        (none on ranks outside an optimizer's process set)."""
        found = {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, _Distributed) and value._reducer is not None:
                found[name] = value._reducer
        return found

    def save(self) -> Dict[str, Any]:
        snapshot = super().save()
        snapshot["_residuals"] = {name: hook_state.shared(reducer, f"elastic.residuals.{name}")
                                  for name, reducer in self._reducers().items()}
        return snapshot

    def load(self, snapshot: Dict[str, Any]) -> None:
        super().load(snapshot)
        saved = snapshot["_residuals"]
        for name, reducer in self._reducers().items():
            if name in saved:
                hook_state.scatter(reducer, saved[name], f"elastic.residuals.{name}")
