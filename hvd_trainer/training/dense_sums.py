"""The dense gradients a reducer sums outside its buckets, one group of tensors at a time.

A step's dense gradients that are not in buckets (those with a compressor, or all of them
when ``num_groups`` > 0) are summed in ``num_groups`` grouped calls: through the compressor
by allreduce (fp16 rounds float32 arrays straight into one float16 wire buffer and widens
the sums straight back, on the adapter's ``kernels``), or, for the arrays a
:class:`GatherCompressor` accepts, by one allgather per group with this rank's error-feedback
residuals (:class:`~hvd_trainer.collectives.feedback.ErrorFeedbackSum`), and with PowerSGD by
its factors' allreduce with its residuals and factors
(:class:`~hvd_trainer.collectives.powersgd.PowerSGDSum`).
"""
import time
from itertools import accumulate
from typing import Any, Sequence, Tuple, Union

import numpy as np

from ..collectives import arguments, fusion, ops
from ..collectives.feedback import ErrorFeedbackSum
from ..collectives.memory import KernelMemory
from ..collectives.powersgd import PowerSGD, PowerSGDSum
from ..collectives.traffic import CommStats
from ..compression import Compression, GatherCompressor
from ..runtime import timeline
from ..backends.halves import Kernels
from ..runtime.runtime import ProcessSet
from .buckets import AnyCompressor


def error_feedback(compression: Any) -> Union[ErrorFeedbackSum, PowerSGDSum, None]:
    """The per-rank state that sums gradients for ``compression``: an ``ErrorFeedbackSum``
    for a ``GatherCompressor``, a ``PowerSGDSum`` for PowerSGD, None for the others."""
    if compression is PowerSGD:
        raise ValueError("compression=Compression.powersgd must be called with its settings, "
                         "e.g. compression=Compression.powersgd(rank=4)")
    if isinstance(compression, GatherCompressor):
        return ErrorFeedbackSum(compression)
    if isinstance(compression, PowerSGD):
        return PowerSGDSum(compression)
    return None


class DenseSums:
    """Sums dense (key, array) pairs across ``process_set`` in place, with ``compression``;
    names its calls ``prefix + "grad.<first key>:<last key>"``; ``predivide`` scales every
    gradient by 1/predivide before the sum."""

    def __init__(self, *, prefix: str, compression: AnyCompressor, predivide: float,
                 num_groups: int, process_set: ProcessSet, kernels: Kernels):
        self.prefix = prefix
        self.compression = compression
        self.predivide = predivide
        self.num_groups = num_groups
        self.process_set = process_set
        self.kernels = kernels
        self._wire = fusion.BufferPool()  # fp16's float16 buffer, kept from step to step
        self.feedback = error_feedback(compression)

    @property
    def size(self) -> int:
        """The process set's number of ranks now (hvdrun --ulfm may shrink the job)."""
        return self.process_set.size()

    def sum_(self, tensors: Sequence[Tuple[int, np.ndarray]], stats: CommStats) -> None:
        """Sum (key, array) pairs across ranks in place, in ``num_groups`` grouped calls.

        Arrays the error feedback's compressor accepts go through it (a GatherCompressor's by
        allgather, PowerSGD takes all), the others by allreduce through the compressor.
        """
        feedback = self.feedback
        compressor = self.compression if feedback is None else Compression.none
        for group in fusion.split_runs(list(tensors), self.num_groups):
            name = f"{self.prefix}grad.{group[0][0]}:{group[-1][0]}"
            packed, plain = [], []
            for k, t in group:
                if feedback and feedback.compressor.accepts(t):
                    packed.append((k, t))
                else:
                    plain.append(t)
            if packed:
                feedback.sum_(packed, f"{name}.packed", 1.0 / self.predivide, self.process_set,
                              stats)
            if self.compression is Compression.fp16 and self.predivide == 1.0:
                narrowed, rest = [], []
                for t in plain:
                    (narrowed if t.dtype == np.float32 and t.flags.c_contiguous else rest).append(t)
                if narrowed:
                    self._sum_narrowed(narrowed, name, stats)
                    name = f"{name}.rest"
                plain = rest
            if not plain:
                continue
            tic = time.perf_counter()
            with timeline.span(name, "COMPRESS"):
                payloads, ctxs = zip(*(compressor.compress(t) for t in plain))
            stats.encode_seconds += time.perf_counter() - tic
            ops.grouped_allreduce_(list(payloads), arguments.Sum, name,
                                   prescale_factor=1.0 / self.predivide,
                                   process_set=self.process_set)
            stats.add_allreduce(sum(p.nbytes for p in payloads),
                                sum(t.nbytes for t in plain), self.size)
            tic = time.perf_counter()
            with timeline.span(name, "DECODE"):
                for t, payload, ctx in zip(plain, payloads, ctxs):
                    if payload is not t:
                        t[...] = compressor.decompress(payload, ctx)
            stats.decode_seconds += time.perf_counter() - tic

    def _sum_narrowed(self, tensors: Sequence[np.ndarray], name: str, stats: CommStats) -> None:
        """fp16 compression of C-contiguous float32 arrays, in place, with one pass each way
        and no new arrays: each is rounded to float16 straight into its slice of one wire
        buffer, the buffer is summed around the ring (each hop's float16 sum rounded once),
        and the sums are widened straight back into the arrays.

        Only without a predivide factor: a scaled float16 sum is summed in float32 (see
        ``ops.half_in_float32``), so the generic path keeps that rule.
        """
        bounds = list(accumulate((t.size for t in tensors), initial=0))
        wire = self._wire.get(np.dtype(np.float16), 0, bounds[-1])
        tic = time.perf_counter()
        with timeline.span(name, "COMPRESS"):
            for t, a, b in zip(tensors, bounds, bounds[1:]):
                self.kernels.narrow(t.reshape(-1), wire[a:b])
        stats.encode_seconds += time.perf_counter() - tic
        ops.reduce_group(KernelMemory(self.kernels), [wire], arguments.Sum, name,
                         process_set=self.process_set, kind="grouped_allreduce", inplace=True)
        stats.add_allreduce(wire.nbytes, 2 * wire.nbytes, self.size)
        tic = time.perf_counter()
        with timeline.span(name, "DECODE"):
            for t, a, b in zip(tensors, bounds, bounds[1:]):
                self.kernels.widen(wire[a:b], t.reshape(-1))
        stats.decode_seconds += time.perf_counter() - tic
