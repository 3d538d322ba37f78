"""Adasum: combining the ranks' gradients by adaptive summation (Maleki et al., 2021).

Two gradients a and b combine to (1 - a·b / 2|a|²) a + (1 - a·b / 2|b|²) b: orthogonal
gradients add up, equal ones average. As in Horovod, the ranks of a process set (a power of
two) combine in a binary tree, ranks (0, 1), (2, 3), ... first, then pairs of those results,
and so on; each tensor of a group has its own coefficients; the dot products are taken in
float64, and a coefficient stays 1 where its gradient's squared norm is below the square root
of float64's smallest normal number (Horovod's cutoff), so tiny gradients still average.

Every rank gathers every rank's tensors and computes the tree itself (the same arithmetic in
the same order, so every rank gets the same result). That moves (N-1)·n values into each
rank, where Horovod's vector-halving exchange moves about 2n: fine for the small rank counts
of one machine, costly for many.
"""
from typing import Any, List, Optional, Sequence

import numpy as np

from ..coordination import agreement, messages
from . import arguments, memory, ops
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set

_TINY = float(np.sqrt(np.finfo(np.float64).tiny))  # squared norms below keep coefficient 1


# Horovod raises NotImplementedError for this size; the ValueError base keeps our own callers'.
@messages.carried
class AdasumSizeError(ValueError, NotImplementedError):
    """op=Adasum on a process set whose size is not a power of two: a ValueError, and the
    NotImplementedError Horovod raises, so a drop-in script's ``except`` catches it."""


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The adaptive sum of two float64 vectors."""
    dot, a2, b2 = float(a @ b), float(a @ a), float(b @ b)
    a_coeff = 1.0 - dot / (2 * a2) if a2 >= _TINY else 1.0
    b_coeff = 1.0 - dot / (2 * b2) if b2 >= _TINY else 1.0
    return a_coeff * a + b_coeff * b


def tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Combine a power of two of vectors pairwise, level by level: (0, 1), (2, 3), ..."""
    level = list(vectors)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _check(tensors: Sequence[Any], size: int) -> None:
    if size & (size - 1):
        raise AdasumSizeError(f"op=Adasum needs a power-of-two number of ranks, as in Horovod; "
                              f"the process set has {size}: use op=Average, or a process set "
                              f"of {1 << (size.bit_length() - 1)} ranks")
    for i, t in enumerate(tensors):
        if t.dtype.kind != "f" and t.dtype.name != "bfloat16":
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}; op=Adasum takes floating-point "
                            "tensors")


def grouped_allreduce(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      inplace: bool = False) -> List[np.ndarray]:
    """The adaptive sum of each tensor across the process set, times the scale factors
    (``prescale_factor`` before combining, ``postscale_factor`` after); in place (into
    C-contiguous, writeable arrays) or into new arrays."""
    comm = runtime.communicator(process_set)
    with agreement.collective(comm, "adasum", name) as call:
        with call.checks():
            tensors = [memory.check_array(t, f"tensors[{i}]", inplace)
                       for i, t in enumerate(tensors)]
            _check(tensors, comm.size)
            arguments.check_reduction(arguments.Sum, prescale_factor, postscale_factor)
        call.agree(lambda: arguments.describe_reduction(call.name, tensors, arguments.Sum,
                                                        prescale_factor, postscale_factor))
        with agreement.covered(comm):  # each allgather below is fixed by that agreement
            gathered = ops.grouped_allgather([t.reshape(1, -1) for t in tensors], call.name,
                                             process_set)
        outputs = []
        for t, every in zip(tensors, gathered):
            rows = every.astype(np.float64) * float(prescale_factor)
            result = (tree(list(rows)) * float(postscale_factor)).reshape(t.shape)
            out = t if inplace else np.empty(t.shape, t.dtype)
            np.copyto(out, result, casting="unsafe")
            outputs.append(out)
        return outputs
