"""Comm hooks: how one bucket of gradients is reduced across the ranks, in the style of
PyTorch DDP's communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``).

A hook is a function ``hook(state, bucket) -> Future`` where ``bucket`` is a
:class:`GradBucket` (this rank's gradients of one bucket, concatenated in ``bucket.buffer``, a
NumPy array, or a CuPy one for a GPU bucket) and ``state`` is whatever the hook keeps between
steps (residuals, factors; None for the stateless ones). The future's result is the bucket's
reduced buffer: the sum over the process set's ranks of each rank's gradients times
``bucket.prescale`` (the adapter applies the average's ``1/size`` and other post-scaling
itself). A hook may reduce in place and return :func:`done` of ``bucket.buffer``, or return
another array of the same size and dtype, which the reducer copies in.

The reducer calls the hook of each bucket in bucket order on every rank, on the thread that
runs the step's reductions, once the bucket's gradients are ready (so compressed gradients are
fused and overlap backward like the others), and goes on with the next bucket without waiting
for the future: a hook may finish local work (a decode) later, on a thread of its own. A hook's
collectives must run before it returns, on the calling thread, and be the same on every rank
(they may depend on the bucket and on state that every rank keeps alike).

Built in, one per ``compression=``: :func:`sum_hook` (none), :func:`fp16_hook`,
:func:`gather_hook` (2-bit, 1-bit, top-k, scaled 2-bit and every ``GatherCompressor``, with
an :class:`~hvd_trainer.collectives.feedback.ErrorFeedbackSum` as state),
:func:`powersgd_hook` (a :class:`~hvd_trainer.collectives.powersgd.PowerSGDSum`),
:func:`compressor_hook` (a Horovod-style ``Compressor`` class); and :func:`adasum_hook`.

**Codecs in a fused bucket keep their per-gradient meaning.** The packed codecs encode each
gradient of the bucket by itself and send the bucket's payloads in one allgather; top-k sends
the ``ratio`` largest entries of each gradient (not of the bucket), scaled 2-bit scales its
threshold by each gradient's mean |g|, PowerSGD factors each gradient as its own matrix and
sums the bucket's factors in one allreduce (as DDP's ``powerSGD_hook``, not its
``batched_powerSGD_hook``), and Adasum combines each gradient with its own coefficients. So the
bucket threshold and autotuning change how the bytes travel, never the training.
"""
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..backends.halves import NUMPY, Kernels
from ..collectives import adasum, arguments, fusion, ops
from ..collectives.feedback import ErrorFeedbackSum
from ..collectives.memory import KernelMemory
from ..collectives.powersgd import PowerSGD, PowerSGDSum
from ..collectives.traffic import CommStats
from ..compression import Compression, Compressor, GatherCompressor
from ..runtime import timeline
from ..runtime.runtime import ProcessSet, global_process_set

__all__ = ["GradBucket", "Hook", "CommHook", "done", "sum_hook", "fp16_hook", "gather_hook",
           "powersgd_hook", "compressor_hook", "adasum_hook", "default_hook"]


@dataclass
class GradBucket:
    """One bucket of one step, as a hook sees it.

    ``buffer`` holds this rank's gradients of the bucket back to back (gradient ``keys[i]``,
    of shape ``shapes[i]``, is ``buffer[offsets[i]:offsets[i + 1]]``); a gradient that is
    stale on this rank holds zeros. ``index`` is the bucket's number (hooks run in index order
    on every rank), ``name`` names its collectives, ``prescale`` multiplies each rank's
    gradients before the sum (1/``gradient_predivide_factor``), ``kernels`` convert and sum
    16-bit floats (the adapter's framework's), ``stats`` counts the step's traffic.
    """

    index: int
    buffer: Any
    keys: Tuple[int, ...]
    offsets: Tuple[int, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    name: str
    prescale: float = 1.0
    process_set: ProcessSet = global_process_set
    kernels: Kernels = NUMPY
    stats: Optional[CommStats] = None

    def gradients(self) -> List[Any]:
        """Each gradient of the bucket as a view of ``buffer``, in its shape."""
        return [self.buffer[a:b].reshape(shape)
                for a, b, shape in zip(self.offsets, self.offsets[1:], self.shapes)]

    def named(self) -> List[Tuple[int, Any]]:
        """(key, view) for each gradient of the bucket."""
        return list(zip(self.keys, self.gradients()))

    def runs(self, chosen: Sequence[int]) -> List[Any]:
        """The flat slices of ``buffer`` that hold the gradients at indices ``chosen``
        (ascending), neighbours merged into one slice."""
        runs: List[List[int]] = []
        for i in chosen:
            start, end = self.offsets[i], self.offsets[i + 1]
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        return [self.buffer[a:b] for a, b in runs]


Hook = Callable[[Any, GradBucket], "Future[Any]"]


class CommHook(NamedTuple):
    """A hook with its state; ``builtin`` hooks' collectives are fixed by the step's agreement
    (a user's hook makes its own agreements, so a mismatch raises instead of hanging)."""

    state: Any
    hook: Hook
    builtin: bool = False

    def describe(self) -> str:
        """The hook and its settings as text that is the same on every rank."""
        if self.builtin:
            return compression_key(getattr(self.state, "compressor", self.state))
        name = getattr(self.hook, "__qualname__", type(self.hook).__name__)
        return f"{getattr(self.hook, '__module__', '')}.{name}({type(self.state).__name__})"


def compression_key(compression: Any) -> str:
    """A compressor and its settings as text that is the same on every rank."""
    if compression is None:
        return Compression.none.__name__
    if isinstance(compression, fusion.BufferPool):
        return Compression.fp16.__name__
    if isinstance(compression, type):
        return compression.__name__
    settings = sorted((key, str(value)) for key, value in vars(compression).items())
    return f"{type(compression).__name__}{settings}"


def done(result: Any) -> "Future[Any]":
    """A future that already holds ``result``."""
    future: "Future[Any]" = Future()
    future.set_result(result)
    return future


def _sum(arrays: Sequence[Any], bucket: GradBucket, name: str) -> None:
    """Sum ``arrays`` (views of the bucket's buffer) across the ranks in place, prescaled."""
    if arrays:
        ops.grouped_allreduce_(list(arrays), arguments.Sum, name,
                               prescale_factor=bucket.prescale, process_set=bucket.process_set)
        if bucket.stats is not None:
            nbytes = sum(a.nbytes for a in arrays)
            bucket.stats.add_allreduce(nbytes, nbytes, bucket.process_set.size())


def sum_hook(state: None, bucket: GradBucket) -> "Future[Any]":
    """Sum the bucket as it is: one allreduce of its buffer (``compression=none``)."""
    _sum([bucket.buffer], bucket, bucket.name)
    return done(bucket.buffer)


def fp16_hook(state: Optional[fusion.BufferPool], bucket: GradBucket) -> "Future[Any]":
    """Sum the bucket as float16 (``Compression.fp16``): a float32 bucket is rounded into one
    float16 wire buffer (``state``, a BufferPool, keeps it from step to step; None: a new
    one each time), summed around the ring (each hop's float16 sum rounded once) and widened
    back, on ``bucket.kernels``. With a prescale the float16 payload is summed in float32
    (``hvd_trainer.collectives.arguments.half_in_float32``); other floating buckets are cast,
    others summed as they are."""
    buffer = bucket.buffer
    if buffer.dtype == np.float16 or buffer.dtype.kind != "f":
        return sum_hook(None, bucket)
    size = bucket.process_set.size()
    tic = time.perf_counter()
    with timeline.span(bucket.name, "COMPRESS"):
        if buffer.dtype == np.float32 and bucket.prescale == 1.0 \
                and isinstance(buffer, np.ndarray):
            pool = state if state is not None else fusion.BufferPool()
            wire = pool.get(np.dtype(np.float16), 0, buffer.size)
            bucket.kernels.narrow(buffer, wire)
            narrowed = True
        else:
            wire = buffer.astype(np.float16)
            narrowed = False
    encoded = time.perf_counter()
    if narrowed:
        ops.reduce_group(KernelMemory(bucket.kernels), [wire], arguments.Sum, bucket.name,
                         process_set=bucket.process_set, kind="grouped_allreduce",
                         inplace=True)
    else:
        ops.grouped_allreduce_([wire], arguments.Sum, bucket.name,
                               prescale_factor=bucket.prescale, process_set=bucket.process_set)
    reduced = time.perf_counter()
    with timeline.span(bucket.name, "DECODE"):
        if narrowed:
            bucket.kernels.widen(wire, buffer)
        else:
            buffer[...] = wire
    if bucket.stats is not None:
        bucket.stats.add_allreduce(wire.nbytes, buffer.nbytes, size)
        bucket.stats.encode_seconds += encoded - tic
        bucket.stats.decode_seconds += time.perf_counter() - reduced
    return done(buffer)


def compressor_hook(state: Any, bucket: GradBucket) -> "Future[Any]":
    """Sum the bucket through a Horovod-style compressor ``state`` (a ``Compressor`` class,
    or anything with ``compress`` and ``decompress``): each gradient compressed by itself,
    the payloads summed in one grouped allreduce, each decompressed back into its place."""
    views = bucket.gradients()
    tic = time.perf_counter()
    with timeline.span(bucket.name, "COMPRESS"):
        payloads, contexts = zip(*(state.compress(v) for v in views))
    encoded = time.perf_counter()
    ops.grouped_allreduce_(list(payloads), arguments.Sum, bucket.name,
                           prescale_factor=bucket.prescale, process_set=bucket.process_set)
    reduced = time.perf_counter()
    with timeline.span(bucket.name, "DECODE"):
        for view, payload, context in zip(views, payloads, contexts):
            if payload is not view:
                view[...] = state.decompress(payload, context)
    if bucket.stats is not None:
        bucket.stats.add_allreduce(sum(p.nbytes for p in payloads), bucket.buffer.nbytes,
                                   bucket.process_set.size())
        bucket.stats.encode_seconds += encoded - tic
        bucket.stats.decode_seconds += time.perf_counter() - reduced
    return done(bucket.buffer)


def gather_hook(state: ErrorFeedbackSum, bucket: GradBucket) -> "Future[Any]":
    """Sum the bucket through a packed codec with error feedback (``state``: an
    ``ErrorFeedbackSum`` of a ``GatherCompressor``): each gradient the codec accepts is
    encoded by itself with its residual, the bucket's payloads travel in one allgather and
    every rank decodes them in rank order; the others are summed in one allreduce."""
    _on_host(bucket, "the packed codecs")
    accepts = state.compressor.accepts
    named = bucket.named()
    packed = [i for i, (_, view) in enumerate(named) if accepts(view)]
    if packed:
        state.sum_([named[i] for i in packed], f"{bucket.name}.packed", bucket.prescale,
                   bucket.process_set, bucket.stats)
    taken = set(packed)
    _sum(bucket.runs([i for i in range(len(named)) if i not in taken]), bucket, bucket.name)
    return done(bucket.buffer)


def powersgd_hook(state: PowerSGDSum, bucket: GradBucket) -> "Future[Any]":
    """Sum the bucket by PowerSGD (``state``: a ``PowerSGDSum``): each gradient of two or
    more dimensions that pays is factored as its own matrix, the bucket's P factors and the
    gradients summed exactly travel in one allreduce, its Q factors in a second."""
    _on_host(bucket, "PowerSGD")
    state.sum_(bucket.named(), bucket.name, bucket.prescale, bucket.process_set, bucket.stats)
    return done(bucket.buffer)


def _on_host(bucket: GradBucket, what: str) -> None:
    """Refuse a GPU bucket for a hook whose state lives on the host."""
    if not isinstance(bucket.buffer, np.ndarray):
        raise TypeError(f"{what} reduce host gradients only; {bucket.name} is a GPU bucket: "
                        "use compression=Compression.none (or fp16) for GPU gradients")


def adasum_hook(state: None, bucket: GradBucket) -> "Future[Any]":
    """Combine the ranks' gradients by Adasum (:mod:`hvd_trainer.collectives.adasum`), each
    gradient of the bucket with its own coefficients; the process set's size must be a power
    of two. (``DistributedOptimizer(op=Adasum)`` combines the ranks' updates instead, as
    Horovod's does.)"""
    adasum.grouped_allreduce(bucket.gradients(), bucket.name, prescale_factor=bucket.prescale,
                             process_set=bucket.process_set, inplace=True)
    return done(bucket.buffer)


def default_hook(compression: Any) -> CommHook:
    """The built-in hook and a fresh state for ``compression=``: none, fp16, a
    ``GatherCompressor``, ``Compression.powersgd(...)``, or a Horovod-style compressor."""
    if compression is None or compression is Compression.none:
        return CommHook(None, sum_hook, True)
    if compression is Compression.fp16:
        return CommHook(fusion.BufferPool(), fp16_hook, True)
    if compression is PowerSGD:
        raise ValueError("compression=Compression.powersgd must be called with its settings, "
                         "e.g. compression=Compression.powersgd(rank=4)")
    if isinstance(compression, GatherCompressor):
        return CommHook(ErrorFeedbackSum(compression), gather_hook, True)
    if isinstance(compression, PowerSGD):
        return CommHook(PowerSGDSum(compression), powersgd_hook, True)
    if (isinstance(compression, type) and issubclass(compression, Compressor)) or (
            hasattr(compression, "compress") and hasattr(compression, "decompress")):
        return CommHook(compression, compressor_hook, True)
    raise TypeError(f"compression={compression!r}: pass Compression.none, Compression.fp16, "
                    "a GatherCompressor, Compression.powersgd(...) or a Compressor subclass")
