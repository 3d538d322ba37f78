"""PowerSGD (Vogels et al., NeurIPS 2019): gradients summed as low-rank factors.

Each compressed gradient M (viewed as rows × cols: its first dimension by the rest) travels as
two thin factors that are summed by allreduce, so its cost does not grow with the number of
ranks: every rank computes P = M·Q from the shared Q (rows × r), the ranks sum the P's, every
rank orthonormalises the sum (QR, LAPACK), computes Q = Mᵀ·P̂, and the ranks sum the Q's; the
sum of the gradients is approximated by P̂·Qᵀ. One power-iteration step per training step.

- **Error feedback.** Each rank keeps, per tensor, what the approximation left out of its own
  gradient (its input minus 1/N of the approximated sum, as PyTorch DDP's ``powerSGD_hook``
  does with averages) and adds it to its next gradient.
- **Warm start.** Q is kept from step to step, so the power iteration goes on across steps; the
  first Q (and every Q without warm start) is drawn from a normal distribution seeded by the
  seed, the tensor and the step, so every rank draws the same one.
- **What is compressed.** float32/float64 tensors of two or more dimensions whose factors
  would be at least ``min_compression_rate`` times smaller than the tensor; the others (1-D,
  small, integer, float16) are summed exactly, in the same allreduce as the P's. Before a
  tensor's ``start_iter``-th reduction everything is summed exactly (no residual is kept).

:class:`PowerSGD` holds the settings (``Compression.powersgd(...)`` in every adapter);
:class:`PowerSGDSum` the per-tensor state and the reduction the gradient reducer calls.
"""
import math
import numbers
import time
import zlib
from typing import Any, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import arguments, ops
from ..runtime.runtime import ProcessSet, global_process_set
from .traffic import CommStats

_FACTORED = (np.dtype(np.float32), np.dtype(np.float64))
# The passes over a factored matrix go a block of rows at a time, each block about this many
# bytes (64 rows of 1024 float32), so that a block's product, residual and update are made
# while it is in the L2 cache rather than in one pass of main memory each.
_BLOCK_BYTES = 1 << 18


def _row_blocks(matrix: np.ndarray) -> List[Tuple[int, int]]:
    """(start, end) row ranges of ``matrix`` of about ``_BLOCK_BYTES`` each."""
    rows = max(1, _BLOCK_BYTES // max(1, matrix.shape[1] * matrix.itemsize))
    return [(a, min(a + rows, matrix.shape[0])) for a in range(0, matrix.shape[0], rows)]


class Factors(NamedTuple):
    """How a tensor is factored: its rows × cols view and the factors' rank."""

    rows: int
    cols: int
    rank: int


def _whole(value: Any, what: str, least: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{what}={value!r} must be an integer ≥ {least}: {fix}")
    return int(value)


class PowerSGD:
    """PowerSGD's settings; pass an instance as ``compression=`` (``Compression.powersgd``).

    ``rank``: the rank r of the approximation (DDP's ``matrix_approximation_rank``); each
    compressed rows × cols tensor sends (rows + cols)·r numbers instead of rows·cols.
    ``start_iter``: reductions of each tensor summed exactly before compression starts.
    ``min_compression_rate``: compress a tensor only when rows·cols exceeds this times
    (rows + cols)·r. ``use_error_feedback`` and ``warm_start`` as in the module docstring;
    ``seed`` seeds the first Q (the same on every rank). Defaults are DDP's.
    """

    def __init__(self, *, rank: int = 1, start_iter: int = 1000,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True,
                 warm_start: bool = True, seed: int = 0):
        self.rank = _whole(rank, "rank", 1, "the rank of the low-rank approximation, e.g. "
                           "Compression.powersgd(rank=4)")
        self.start_iter = _whole(start_iter, "start_iter", 0, "the number of exact reductions "
                                 "before compression starts, e.g. start_iter=10")
        if isinstance(min_compression_rate, bool) \
                or not isinstance(min_compression_rate, numbers.Real) \
                or not math.isfinite(min_compression_rate) or min_compression_rate <= 0:
            raise ValueError(f"min_compression_rate={min_compression_rate!r} must be a positive "
                             "number: a tensor is compressed when its factors are at least "
                             "that many times smaller (default 2)")
        self.min_compression_rate = float(min_compression_rate)
        for name, flag in (("use_error_feedback", use_error_feedback),
                           ("warm_start", warm_start)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r} must be True or False")
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.seed = _whole(seed, "seed", 0, "the seed of the first Q, the same on every rank")

    def _settings(self) -> Tuple[Any, ...]:
        return (self.rank, self.start_iter, self.min_compression_rate, self.use_error_feedback,
                self.warm_start, self.seed)

    def __eq__(self, other: Any) -> bool:
        # Equal settings are one compressor: an adapter that keeps a reducer per compressor
        # (TensorFlow's tapes, made anew each step) keeps its state across new instances.
        return isinstance(other, PowerSGD) and self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash(self._settings())

    def accepts(self, tensor: Any) -> bool:
        """True: every tensor goes to :class:`PowerSGDSum`, which sums those it does not
        factor exactly, in the allreduce of the P's."""
        return True

    def factors(self, shape: Sequence[int], dtype: Any) -> Optional[Factors]:
        """How a tensor of ``shape`` and ``dtype`` is factored, or None when it is summed
        exactly (fewer than 2 dimensions, not float32/64, or too little to gain)."""
        if len(shape) < 2 or np.dtype(dtype) not in _FACTORED:
            return None
        rows = int(shape[0])
        cols = int(np.prod(shape[1:], dtype=np.int64))
        rank = min(rows, cols, self.rank)
        if rank < 1 or (rows + cols) * rank * self.min_compression_rate >= rows * cols:
            return None
        return Factors(rows, cols, rank)


def orthonormalize(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``p``'s (rows ≥ columns), from LAPACK's QR: defined for
    any input, a rank-deficient or zero ``p`` included."""
    return np.linalg.qr(p, mode="reduced")[0].astype(p.dtype, copy=False)


def first_q(seed: int, key: Hashable, draw: int, shape: Tuple[int, int],
            dtype: np.dtype) -> np.ndarray:
    """The Q drawn for tensor ``key`` at ``draw``: standard normal, the same on every rank."""
    rng = np.random.default_rng([seed, zlib.crc32(repr(key).encode()), draw])
    return rng.standard_normal(shape).astype(dtype)


class _Compressed(NamedTuple):
    key: Hashable
    matrix: np.ndarray  # the rows × cols view of the tensor (holds the input, then the sum)
    q: np.ndarray       # this step's Q, then the summed new Q
    p: np.ndarray       # this rank's P, then the sum


class PowerSGDSum:
    """Sums gradients across ranks by PowerSGD, keeping per tensor key this rank's residual,
    the warm-start Q (the same on every rank) and the count of its reductions."""

    def __init__(self, compressor: PowerSGD):
        self.compressor = compressor
        self.residuals: Dict[Hashable, np.ndarray] = {}
        self.factors: Dict[Hashable, np.ndarray] = {}
        self.steps: Dict[Hashable, int] = {}
        self._products: Dict[Tuple[Tuple[int, ...], np.dtype], np.ndarray] = {}  # P·Qᵀ

    def _product(self, like: np.ndarray) -> np.ndarray:
        """A scratch array for P·Qᵀ of a block of ``like``'s rows, kept from step to step
        (one per shape)."""
        held = self._products.get((like.shape, like.dtype))
        if held is None:
            rows = _row_blocks(like)[0]
            held = self._products[(like.shape, like.dtype)] = np.empty(
                (rows[1] - rows[0], like.shape[1]), like.dtype)
        return held

    def _residual(self, key: Hashable, like: np.ndarray) -> np.ndarray:
        """Tensor ``key``'s residual array, to be overwritten: the one kept from the last
        step when it fits, a new one otherwise."""
        held = self.residuals.get(key)
        if held is None or held.shape != like.shape or held.dtype != like.dtype \
                or not held.flags.writeable or not held.flags.c_contiguous:
            held = self.residuals[key] = np.empty_like(like)
        return held

    def state(self) -> Dict[str, Any]:
        """This rank's state, for checkpoints and elastic commits."""
        return {"residuals": self.residuals, "factors": self.factors, "steps": self.steps}

    def restore(self, saved: Optional[Dict[str, Any]]) -> None:
        """Continue from what :meth:`state` returned (None: start again from nothing)."""
        saved = saved or {}
        self.residuals = dict(saved.get("residuals", {}))
        self.factors = dict(saved.get("factors", {}))
        self.steps = dict(saved.get("steps", {}))

    def sum_(self, named: Sequence[Tuple[Hashable, np.ndarray]], name: str, scale: float = 1.0,
             process_set: ProcessSet = global_process_set,
             stats: Optional[CommStats] = None) -> None:
        """Replace each (C-contiguous) tensor by the sum over ranks, times ``scale``: exact for
        the tensors PowerSGD leaves alone, the rank-r approximation for the others. Two
        allreduces: the exact tensors with the P's, then the Q's. A collective."""
        settings = self.compressor
        tic = time.perf_counter()
        exact: List[np.ndarray] = []
        compressed: List[_Compressed] = []
        for key, t in named:
            shape = settings.factors(t.shape, t.dtype)
            step = self.steps.get(key, 0)
            self.steps[key] = step + 1
            if shape is None or step < settings.start_iter:
                exact.append(t)
                continue
            matrix = t.reshape(shape.rows, shape.cols)
            residual = self.residuals.get(key) if settings.use_error_feedback else None
            q = self.factors.get(key) if settings.warm_start else None
            if q is None or q.shape != (shape.cols, shape.rank) or q.dtype != t.dtype:
                q = first_q(settings.seed, key, 0 if settings.warm_start else step,
                            (shape.cols, shape.rank), t.dtype)
            compressed.append(_Compressed(key, matrix, q, _with_residual_times(matrix,
                                                                               residual, q)))
        encoded = time.perf_counter() - tic
        ps = [c.p for c in compressed]
        # P's scale does not matter (it is orthonormalised), so the prescale may touch it.
        ops.grouped_allreduce_(ps + exact, arguments.Sum, name, prescale_factor=scale,
                               process_set=process_set)
        tic = time.perf_counter()
        for c in compressed:
            p = orthonormalize(c.p)
            np.matmul(c.matrix.T, p, out=c.q)
            c.p[...] = p
        encoded += time.perf_counter() - tic
        if compressed:
            ops.grouped_allreduce_([c.q for c in compressed], arguments.Sum, f"{name}.q",
                                   process_set=process_set)
        tic = time.perf_counter()
        size = process_set.size()
        for c in compressed:
            residual = self._residual(c.key, c.matrix) if settings.use_error_feedback else None
            _expand(c, self._product(c.matrix), residual, size, scale)
            if settings.warm_start:
                self.factors[c.key] = c.q
        if stats is not None:
            factor_bytes = sum(c.p.nbytes + c.q.nbytes for c in compressed)
            exact_bytes = sum(t.nbytes for t in exact)
            stats.add_allreduce(factor_bytes + exact_bytes,
                                exact_bytes + sum(c.matrix.nbytes for c in compressed), size)
            stats.encode_seconds += encoded
            stats.decode_seconds += time.perf_counter() - tic


def _with_residual_times(matrix: np.ndarray, residual: Optional[np.ndarray],
                         q: np.ndarray) -> np.ndarray:
    """P = (``matrix`` + ``residual``)·``q``, leaving the sum in ``matrix``; a block of rows
    at a time, each multiplied while it is in the cache."""
    p = np.empty((matrix.shape[0], q.shape[1]), matrix.dtype)
    for a, b in _row_blocks(matrix):
        if residual is not None:
            matrix[a:b] += residual[a:b]
        np.matmul(matrix[a:b], q, out=p[a:b])
    return p


def _expand(c: _Compressed, scratch: np.ndarray, residual: Optional[np.ndarray], size: int,
            scale: float) -> None:
    """Make ``c.matrix`` the approximated sum P·Qᵀ (times ``scale``) and ``residual`` (when
    given) this rank's share of what the approximation left out (its input minus 1/``size``
    of the sum, as DDP's averages do); a block of rows at a time, through ``scratch``."""
    kind = c.matrix.dtype.type
    for a, b in _row_blocks(c.matrix):
        approx = np.matmul(c.p[a:b], c.q.T, out=scratch[:b - a])
        rows = c.matrix[a:b]
        if residual is not None:
            np.divide(approx, kind(size), out=residual[a:b])
            np.subtract(rows, residual[a:b], out=residual[a:b])
        if scale != 1.0:
            np.multiply(approx, kind(scale), out=rows)
        else:
            rows[...] = approx
