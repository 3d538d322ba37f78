"""ElasticSampler: batches that a restart on another number of ranks spreads over the new
ranks, so that within an epoch every sample is processed once (framework-free).
"""
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..runtime import runtime
from ..collectives import arguments, ops


class ElasticSampler:
    """The batches of an epoch for this rank, such that a restart on another number of ranks
    spreads the samples not yet processed over the new ranks: within an epoch every sample is
    processed once, none is lost or repeated (framework-free; a batch sampler, e.g.
    ``gluon.data.DataLoader(dataset, batch_sampler=sampler)``).

    The epoch's order is a permutation of ``range(num_samples)`` fixed by ``seed`` and the
    epoch (or the identity without ``shuffle``). Its unprocessed samples are cut into rounds
    of ``size * batch_size``, and rank r takes every size-th sample of each round from the
    r-th, so every rank gets the same number of batches; a last round with fewer samples than
    ranks joins the round before. Call :meth:`record` with each batch once it is processed,
    and keep the sampler in the committed state (an attribute of the State).
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0):
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"ElasticSampler(num_samples={num_samples}, batch_size="
                             f"{batch_size}): both must be >= 1")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self.processed = np.zeros(self.num_samples, bool)
        self._current: Optional[List[List[int]]] = None  # the batches of the running iteration

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: its own order, nothing processed yet."""
        self.epoch = int(epoch)
        self.processed[:] = False

    def order(self) -> np.ndarray:
        """The epoch's order of all samples."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.RandomState((self.seed + self.epoch) % 2**32).permutation(self.num_samples)

    def batches(self, rank: int, size: int) -> List[List[int]]:
        """Rank ``rank``'s batches, of ``size`` ranks, over the samples not processed yet."""
        order = self.order()
        remaining = order[~self.processed[order]]
        span = size * self.batch_size
        rounds = [remaining[start:start + span] for start in range(0, len(remaining), span)]
        if len(rounds) > 1 and len(rounds[-1]) < size:
            rounds[-2:] = [np.concatenate(rounds[-2:])]
        return [[int(i) for i in part[rank::size]] for part in rounds]

    def __iter__(self) -> Iterator[List[int]]:
        runtime.init()
        self._current = self.batches(runtime.rank(), runtime.size())
        return iter(self._current)

    def __len__(self) -> int:
        runtime.init()
        return len(self.batches(runtime.rank(), runtime.size()))

    def record(self, indices: Sequence[int]) -> None:
        """Mark this rank's ``indices`` as processed."""
        self.processed[np.asarray(indices, dtype=np.int64)] = True

    def record_batch(self, batch_index: int) -> None:
        """Mark the ``batch_index``-th batch of the current iteration as processed."""
        if self._current is None or not 0 <= batch_index < len(self._current):
            count = "no iteration has started" if self._current is None else \
                f"the current iteration has {len(self._current)} batches"
            raise ValueError(f"ElasticSampler.record_batch({batch_index}): {count}; pass the "
                             "position of a batch the sampler has handed out")
        self.record(self._current[batch_index])

    def sync(self) -> None:
        """Merge every rank's processed samples (a collective)."""
        runtime.init()
        if runtime.size() > 1:
            merged = ops.allreduce(self.processed.astype(np.uint8), op=arguments.Max,
                                   name="elastic.sampler")
            self.processed = merged.astype(bool)

    def state_dict(self) -> Dict[str, Any]:
        """The epoch and the processed samples (packed bits)."""
        return {"epoch": self.epoch, "processed": np.packbits(self.processed)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Set what :meth:`state_dict` returned."""
        self.epoch = int(state["epoch"])
        self.processed = np.unpackbits(state["processed"])[:self.num_samples].astype(bool)
