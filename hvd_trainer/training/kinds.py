"""Which gradients are row-sparse, agreed by the ranks.

Which gradients are row-sparse may show only in backward, and a rank that has no gradient for
a parameter cannot tell. The ranks agree on each gradient's kind (:data:`NONE`, a number of
sparse dimensions, :data:`DENSE`; the largest wins, so dense beats sparse) in one small
allreduce after the steps in which some gradient has had no kind agreed yet (usually the first
step only). Until then a gradient travels in its bucket: a sparse one travels densely in the
step that reveals it, is summed by rows as well (the result is taken from those), and leaves
the buckets from the next step on. After ``join()`` the ranks take the kinds that were decided
while a rank was joined.
"""
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..collectives import arguments, ops
from .buckets import Gradient

NONE = 0     # no rank has had a gradient for the parameter yet
DENSE = 64   # a dense gradient; a row-sparse one with s sparse dimensions has the kind s


def table_shape(shape: Sequence[int], sparse_dim: int) -> Tuple[int, ...]:
    """The (rows, ...) shape of a tensor of ``shape`` with ``sparse_dim`` sparse dimensions."""
    return (int(np.prod(shape[:sparse_dim], dtype=np.int64)),) + tuple(shape[sparse_dim:])


def agree_kinds(kinds: List[int], keys: Sequence[int], mine: Sequence[int], name: str,
                process_set: Any) -> List[int]:
    """Set ``kinds[k]`` for each of ``keys`` to the largest of the ranks' kinds (``mine`` here)
    and return the keys agreed row-sparse. A collective (a small allreduce over the set)."""
    agreed = ops.allreduce(np.array(mine, np.int8), arguments.Max, name, process_set=process_set)
    for k, kind in zip(keys, agreed):
        kinds[k] = int(kind)
    return [k for k, kind in zip(keys, agreed) if NONE < kind < DENSE]


class Kinds:
    """The agreed kind of each of an adapter's gradients (``dense``: each as the reducer
    describes it when dense, by key 0..n-1), and what this step revealed of the undecided
    ones."""

    def __init__(self, dense: Sequence[Gradient], kinds: Sequence[int]):
        self.dense = list(dense)
        self.kinds = list(kinds)
        self._seen = [NONE] * len(self.kinds)  # this step's kinds of the undecided gradients
        self._revealing: Dict[int, Any] = {}   # first sparse gradients, by key

    def __getitem__(self, k: int) -> int:
        return self.kinds[k]

    def gradients(self) -> List[Gradient]:
        """The gradients as the reducer must know them: row-sparse where agreed sparse."""
        return [Gradient(g.key, table_shape(g.shape, kind), g.dtype, sparse=True)
                if NONE < kind < DENSE else g for g, kind in zip(self.dense, self.kinds)]

    def see(self, k: int, kind: int, revealing: Any = None) -> None:
        """This rank's gradient ``k``, of a kind not agreed yet, is of ``kind``; a sparse one
        is kept as ``revealing`` for the rows summed at the end of the step."""
        self._seen[k] = kind
        if revealing is not None:
            self._revealing[k] = revealing

    def agree(self, name: str, process_set: Any) -> Tuple[List[int], Dict[int, Any]]:
        """Agree on the kind of each gradient that had none before this step (a collective,
        only when there are such); return the keys found row-sparse and the sparse gradients
        this rank revealed, and start the next step's record."""
        revealing, self._revealing = self._revealing, {}
        seen, self._seen = self._seen, [NONE] * len(self.kinds)
        undecided = [k for k, kind in enumerate(self.kinds) if kind == NONE]
        if not undecided:
            return [], revealing
        found = agree_kinds(self.kinds, undecided, [seen[k] for k in undecided], name,
                            process_set)
        return found, revealing

    def forget(self) -> None:
        """Drop this step's record (the step failed)."""
        self._seen = [NONE] * len(self.kinds)
        self._revealing = {}

    def settle(self, name: str, process_set: Any) -> bool:
        """Take the kinds that the other ranks decided while this rank was joined (or keep
        one's own); True when some gradient was found row-sparse. A collective."""
        return bool(agree_kinds(self.kinds, list(range(len(self.kinds))), list(self.kinds),
                                name, process_set))
