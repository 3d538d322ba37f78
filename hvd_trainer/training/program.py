"""A step's program: what a reducer's step does on the wire, on the communication thread (or
the calling thread when it does not overlap).

1. **The agreement.** One exchange (:func:`agreement.agree`) checks that every rank has the
   same gradients (names, shapes, dtypes, storage, memory) and settings, the hook included.
   With step-time readiness it carries the freshness flags: a gradient fresh on some rank is
   reduced everywhere, stale ranks contributing zeros; one fresh nowhere is left untouched.
   With hook readiness (eager) the step starts before freshness is known, so every gradient
   is reduced and a rank that never marked one contributes zeros. The step's collectives then
   run inside :func:`agreement.covered` and skip their own exchanges, except while a rank is
   joined (:mod:`hvd_trainer.collectives.joined`: each collective then makes its own
   agreement, from which the joined rank learns what to serve with zeros) and for a user's
   hook (its collectives are checked one by one, so a mismatch raises instead of hanging).
2. **Each bucket, in order,** once its members are marked (or the step closed): opened (the
   adapter's view of its storage), its stale members zeroed, and handed to the comm hook
   (:mod:`.hooks`) as a :class:`~.hooks.GradBucket`. A bucket with members fresh nowhere hands
   over only its fresh ones, copied into one temporary buffer and back, so the others stay
   untouched, and so do their residuals. The bucket's handle completes when the hook's
   future does; the program goes on with the next bucket meanwhile.
3. **The gradients outside buckets:** row-sparse ones by :func:`sparse.allreduce_rows`, and
   the few dense ones that have no bucket (0-d) through the hook, copied into a temporary
   bucket per dtype.
"""
import contextlib
from concurrent.futures import Future
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..collectives import fusion, memory, sparse
from ..collectives.traffic import CommStats
from ..coordination import agreement
from ..runtime import runtime, timeline
from .buckets import Bucket, Gradient
from .hooks import GradBucket, done
from .step import Step

Rows = Tuple[np.ndarray, np.ndarray]


def run(reducer: Any, step: Step, flags: bool) -> None:
    """``reducer``'s program for ``step``: agree (with the freshness flags when ``flags``),
    reduce the buckets in order, then the gradients outside them; raises what a reduction
    raised, after every bucket handle has it."""
    comm = runtime.communicator(reducer.process_set)
    try:
        with agreement.covered(comm):
            with timeline.span(f"{reducer.prefix}step", "NEGOTIATE"):
                if flags:
                    step.agree(agreement.agree(comm, lambda: reducer.description, step.ready))
                else:  # no flags yet, but (empty) flags keep it an exchange when covered
                    agreement.agree(comm, lambda: reducer.description, np.zeros(0, bool))
                    step.agree(True)
            own = agreement.peers_joined(comm) or not reducer.hook.builtin
            with agreement.uncovered(comm) if own else contextlib.nullcontext():
                futures = []
                for bucket in step.buckets:
                    step.wait_for_bucket(bucket.number)
                    if not own and reducer.size > 1:
                        agreement.meet(comm)  # a late peer's wait leaves the core to backward
                    futures.append(_reduce_bucket(reducer, bucket, step))
                step.wait_for_all()
                _reduce_rest(reducer, step)
                for future in futures:
                    future.result()
    except BaseException as e:
        step.failed(e)
        raise


def _reduce_bucket(reducer: Any, bucket: Bucket, step: Step) -> "Future[Any]":
    """Hand ``bucket`` to the hook (see the module docstring); its handle completes with the
    hook's future."""
    positions = [reducer.position(k) for k in bucket.keys]
    bounds = bucket.bounds
    name = f"{reducer.prefix}bucket.{bucket.number}"
    with bucket.active():
        with timeline.span(name, "WAIT_FOR_GRADIENT"):
            array = bucket.open()
        chosen = [i for i, p in enumerate(positions) if step.fresh(p)]
        if not step.complete(bucket.number):
            for i in chosen:
                if not step.marked(positions[i]):
                    array[bounds[i]:bounds[i + 1]] = 0  # stale here: contribute zeros
        if not chosen or reducer.size == 1:
            step.reduced(bucket.number, array)
            return done(array)
        whole = len(chosen) == len(positions)
        runs = [array[bounds[i]:bounds[i + 1]] for i in chosen]
        buffer = array if whole else memory.memory_of(array).xp.concatenate(runs)
        offsets = [0]
        for run in runs:
            offsets.append(offsets[-1] + run.size)
        shapes = [reducer.gradients[positions[i]].shape for i in chosen]
        grads = GradBucket(bucket.number, buffer, tuple(bucket.keys[i] for i in chosen),
                           tuple(offsets), tuple(shapes), name, 1.0 / reducer.predivide,
                           reducer.process_set, reducer.kernels, step.stats)
        future = _call(reducer, grads)

        def finished(future: "Future[Any]") -> None:
            try:
                _take(future.result(), buffer, name)
                if not whole:
                    for run, a, b in zip(runs, offsets, offsets[1:]):
                        run[...] = buffer[a:b]
                step.reduced(bucket.number, array)
            except BaseException as e:  # the handle raises it, and so does the program
                step.failed(e)
        future.add_done_callback(finished)  # at once, in the bucket's context, when done
    return future


def _call(reducer: Any, bucket: GradBucket) -> "Future[Any]":
    """The reducer's hook on ``bucket``; a TypeError unless it returns a future."""
    future = reducer.hook.hook(reducer.hook.state, bucket)
    if not isinstance(future, Future):
        raise TypeError(f"the comm hook {reducer.hook.describe()} returned "
                        f"{type(future).__name__}; a hook returns a concurrent.futures.Future "
                        "of the reduced buffer (hooks.done(bucket.buffer) when it is ready)")
    return future


def _take(result: Any, buffer: Any, name: str) -> None:
    """Make ``buffer`` hold a hook's ``result`` (unless it is the buffer itself)."""
    if result is buffer:
        return
    if getattr(result, "shape", None) != buffer.shape or result.dtype != buffer.dtype:
        raise ValueError(f"the comm hook returned {getattr(result, 'dtype', type(result))} of "
                         f"shape {getattr(result, 'shape', None)} for {name}; it must return "
                         f"the bucket's buffer or an array like it ({buffer.dtype}, "
                         f"{buffer.shape})")
    buffer[...] = result


def _reduce_rest(reducer: Any, step: Step) -> None:
    """The gradients outside buckets: row-sparse ones, then dense ones by dtype."""
    loose: List[Tuple[int, np.ndarray]] = []
    for p, g in enumerate(reducer.gradients):
        if g.bucketed or not step.fresh(p):
            continue
        value = step.value(p)
        if g.sparse:
            step.result(g.key, sum_rows(reducer, g, value, step))
        else:
            loose.append((g.key, np.zeros(g.shape, g.dtype) if value is None else value))
    if reducer.size > 1 and loose:
        sum_outside(reducer, loose, step.stats)
    for key, value in loose:
        step.result(key, value)


def sum_rows(reducer: Any, g: Gradient, value: Optional[Rows], step: Step) -> Rows:
    """Sum row-sparse gradient ``g``'s (ids, rows) across the ranks (None: no rows here) and
    record how they travelled in ``step``. A collective."""
    if value is None:
        value = (np.empty(0, sparse.ID_DTYPE), np.empty((0,) + g.shape[1:], g.dtype))
    ids, rows, exchange = sparse.allreduce_rows(
        value[0], value[1], g.shape[0], reducer.name(g.key),
        prescale_factor=1.0 / reducer.predivide if reducer.size > 1 else 1.0,
        force_dense=reducer.sparse_as_dense, process_set=reducer.process_set)
    step.exchanges[g.key] = exchange
    return ids, rows


def sum_outside(reducer: Any, tensors: Sequence[Tuple[int, np.ndarray]],
                stats: CommStats) -> None:
    """Sum (key, array) pairs in place through the reducer's hook, in ``num_groups`` groups
    (one for 0), each copied into a temporary bucket per dtype. A collective."""
    for group in fusion.split_runs(list(tensors), reducer.num_groups):
        for dtype in sorted({t.dtype.str for _, t in group}):
            members = [(k, t) for k, t in group if t.dtype.str == dtype]
            offsets = [0]
            for _, t in members:
                offsets.append(offsets[-1] + t.size)
            buffer = np.empty(offsets[-1], dtype)
            for (_, t), a, b in zip(members, offsets, offsets[1:]):
                buffer[a:b] = t.reshape(-1)
            name = f"{reducer.prefix}grad.{members[0][0]}:{members[-1][0]}"
            bucket = GradBucket(-1, buffer, tuple(k for k, _ in members), tuple(offsets),
                                tuple(t.shape for _, t in members), name,
                                1.0 / reducer.predivide, reducer.process_set, reducer.kernels,
                                stats)
            _take(_call(reducer, bucket).result(), buffer, name)
            for (_, t), a, b in zip(members, offsets, offsets[1:]):
                t[...] = buffer[a:b].reshape(t.shape)
