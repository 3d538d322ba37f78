"""Sparse COO tensors as the core's row-sparse pairs (ids, rows), and back.

A COO tensor of shape ``sparse_shape + dense_shape`` is a table of
``prod(sparse_shape)`` rows of ``dense_shape``: each index tuple becomes one row id (its
row-major position), each entry's values one row. :mod:`hvd_trainer.collectives.sparse` sums such
pairs across ranks.
"""
from typing import Sequence, Tuple

import numpy as np
import torch

from . import bridge


def to_rows(tensor: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """The unique row ids and the rows of a sparse COO tensor (summing duplicate indices),
    as NumPy arrays that share the coalesced tensor's memory."""
    coalesced = tensor.detach().coalesce()
    sparse_shape = tuple(coalesced.shape[:coalesced.sparse_dim()])
    indices = coalesced.indices().numpy()
    ids = indices[0] if len(sparse_shape) == 1 else \
        np.ravel_multi_index(tuple(indices), sparse_shape)
    return ids, np.ascontiguousarray(bridge.view(coalesced.values()))


def from_rows(ids: np.ndarray, rows: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The coalesced sparse COO tensor of ``shape`` holding ``rows`` at the sorted unique row
    ids ``ids`` (the sparse dimensions are those of ``shape`` that ``rows`` lacks)."""
    sparse_shape = tuple(shape[:len(shape) - rows.dim() + 1])
    indices = torch.from_numpy(
        np.stack(np.unravel_index(ids, sparse_shape)).astype(np.int64))
    return torch.sparse_coo_tensor(indices.reshape(len(sparse_shape), -1), rows, tuple(shape),
                                   is_coalesced=True, check_invariants=False)
