"""The gradient reducer: sums one set of gradients across a process set, step after step.

A framework adapter (the MXNet trainer, a PyTorch optimizer) describes its gradients as
:class:`~.buckets.Gradient` records and hands their values over as NumPy arrays; the reducer owns
the rest, as PyTorch DDP's ``Reducer`` does for DDP:

- **Buckets.** Dense gradients (without a compressor) are laid out in flat buckets:
  in reverse registration order (backward produces the last layers' gradients first), one
  dtype and one memory (host or GPU) per bucket, at most ``HVD_BUCKET_THRESHOLD`` bytes each
  (``num_groups`` > 0 sets the number of buckets instead). The adapter backs each
  :class:`Bucket` with its framework's flat storage, makes the gradients views of it, and
  sets ``Bucket.open`` to return a NumPy (or CuPy) view of that storage once the framework's
  writes into it have finished, or, on a GPU, ``Bucket.active`` to a context that orders the
  reduction after them. A bucket is then reduced in place: a step copies no gradient bytes.
- **Readiness.** :meth:`Reducer.mark_ready` marks one gradient ready, from a per-parameter
  hook during backward or for every gradient in turn at step time. A bucket is launched when
  all its members are ready, buckets in the same order on every rank. The order in which
  gradients became ready is recorded (``ready_order``), but buckets are *not* rebuilt from
  it: a rebuilt layout would need the ranks to agree on one order (theirs may differ) and
  the adapter to install new views, and at step-time readiness (MXNet) the order is only the
  adapter's loop.
- **Handles.** Reductions run in one program per step: on the communication thread
  (:mod:`hvd_trainer.coordination.work_order`), or on the calling thread when overlap is off. Each
  launched bucket has a :class:`~hvd_trainer.coordination.handles.Handle`; the adapter waits for it
  and then uses the bucket (an optimizer update while the next bucket is on the wire).
- **Agreement.** Each step makes one exchange (:func:`agreement.agree`) that checks every
  rank has the same gradients (names, shapes, dtypes, storage, memory) and settings. With
  step-time readiness it carries the freshness flags: a gradient fresh on some rank is
  reduced everywhere, stale ranks contributing zeros; one fresh nowhere is left untouched.
  With hook readiness the step starts before freshness is known, so every gradient is
  reduced and a rank that never marked one ready contributes zeros. The step's collectives
  then run inside :func:`agreement.covered` and skip their own exchanges, except while a
  rank is joined (:mod:`hvd_trainer.collectives.joined`): then each makes its own agreement, from
  which the joined rank learns what to serve with zeros.
- **Per-tensor paths.** Other gradients are reduced after the buckets: row-sparse ones by
  :func:`sparse.allreduce_rows`; dense ones (dense_sums.py) in ``num_groups`` grouped calls,
  through the compressor (fp16 by allreduce; a :class:`GatherCompressor` by allgather,
  PowerSGD by its factors' allreduce, both with this rank's error-feedback state). fp16 rounds the float32 gradients straight into one float16
  buffer, sums it and widens the sums straight back, on the adapter's ``kernels`` (see
  backends/halves.py). ``gradient_predivide_factor`` f scales every gradient by 1/f before
  the sum; the adapter folds f/size into its optimizer.
- **Autotuning.** With ``HVD_AUTOTUNE=1`` the first steps try bucket thresholds and overlap
  on and off on a schedule of step numbers (:mod:`hvd_trainer.training.autotune`), the same on every
  rank; :meth:`Reducer.finish` moves to the next step's setting (laying out new buckets, which
  the adapter backs before the next step). After the last sample the process set's first
  rank broadcasts its fastest setting, and every rank keeps it from the next step on.
- **State.** :meth:`Reducer.gather_state` and :meth:`Reducer.scatter_state` move the residuals
  (and PowerSGD's factors) and the settings they depend on between the ranks and the one rank that saves or loads a
  checkpoint, without gathering every rank's residuals onto every rank.
"""
import contextlib
import functools
import threading
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..coordination import agreement, work_order
from . import autotune
from ..collectives import arguments, fusion, objects, ops, sparse
from ..runtime import runtime, timeline
from ..backends.halves import NUMPY, Kernels
from ..compression import Compression
from ..runtime.runtime import ProcessSet, global_process_set
from ..collectives.traffic import CommStats
from .dense_sums import DenseSums
from .buckets import AnyCompressor, Bucket, Gradient, ReducerStep, check_settings, compression_key


class Reducer:
    """Sums a set of gradients across ``process_set``; see the module docstring.

    Only members of the process set may use it (its steps are collectives over the set).
    ``eager=True`` launches buckets as
    their gradients become ready (hooks during backward); otherwise nothing moves before
    :meth:`launch`, which then knows every gradient's freshness. An eager step holds the
    process set's turn (see :mod:`hvd_trainer.coordination.scheduler`) from its first ready gradient
    until its reductions end, so other collectives on the set wait for it: call
    :meth:`launch` every step, from a thread that is not itself waiting for such a
    collective. ``overlap`` runs the
    reductions on the communication thread (default: the agreed ``HVD_OVERLAP`` setting).
    An eager step is queued at its first ready gradient (or :meth:`begin`), so on every rank
    it goes ahead of the collectives the rank starts after backward; it runs on the
    communication thread while gradients are still to come, and in :meth:`launch` when they
    all came at once and nothing else was started meanwhile (two thread switches saved).
    ``kernels`` convert and sum 16-bit floats for fp16 compression (an adapter passes its
    framework's; NumPy's by default).
    """

    def __init__(self, *, prefix: str = "", compression: AnyCompressor = Compression.none,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set,
                 eager: bool = False, kernels: Kernels = NUMPY):
        check_settings(gradient_predivide_factor, num_groups)
        runtime.init()
        self.prefix = prefix
        self.compression = compression
        self.kernels = kernels
        self.predivide = float(gradient_predivide_factor)
        self.num_groups = int(num_groups)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self.dense = DenseSums(prefix=prefix, compression=compression, predivide=self.predivide,
                               num_groups=self.num_groups, process_set=process_set,
                               kernels=kernels)
        self.feedback = self.dense.feedback  # a GatherCompressor's residuals, or None
        self.eager = eager
        # Rank 0's settings, so that every rank lays out the same buckets.
        self.bucket_threshold = runtime.setting("BUCKET_THRESHOLD")
        self.overlap = runtime.setting("OVERLAP") != 0
        self.gradients: Tuple[Gradient, ...] = ()
        self.buckets: List[Bucket] = []
        self.stats = CommStats()
        self.sparse_exchanges: Dict[int, sparse.Exchange] = {}
        self.ready_order: List[int] = []
        self._position: Dict[int, int] = {}
        self._bucket_of: List[int] = []
        self._description: Dict[str, Any] = {}
        self._step: Optional[ReducerStep] = None
        self._lock = threading.Lock()
        self._launched = 0  # steps launched so far
        self.autotuner = self._autotuner() if runtime.setting("AUTOTUNE") else None

    @property
    def size(self) -> int:
        """The process set's number of ranks now (hvdrun --ulfm may shrink the job)."""
        return self.process_set.size()

    def _autotuner(self) -> autotune.Autotuner:
        """The autotuner over what can vary here: thresholds only when they lay out the
        buckets, overlap only when a step may run on the communication thread."""
        bucketed = self.num_groups == 0 and self.compression is Compression.none
        thresholds = autotune.THRESHOLDS if bucketed else (self.bucket_threshold,)
        overlaps = ((False, True) if not self.eager and self.size > 1
                    and runtime.mpi_threads_supported() else (self.overlap,))
        first = self.process_set.included() and self.process_set.rank() == 0
        return autotune.Autotuner(
            autotune.Setting(self.bucket_threshold, self.overlap),
            autotune.candidates(thresholds, overlaps),
            runtime.setting("AUTOTUNE_WARMUP_SAMPLES"),
            runtime.setting("AUTOTUNE_STEPS_PER_SAMPLE"),
            log_path=runtime.setting("AUTOTUNE_LOG") if first else None,
            name=f"{self.prefix}step")

    # -- the gradients and their layout -----------------------------------------------------
    def set_gradients(self, gradients: Sequence[Gradient]) -> bool:
        """Reduce ``gradients`` from the next step on. When they differ from the current ones,
        the buckets are laid out anew (the adapter must back them) and True is returned."""
        gradients = tuple(gradients)
        if gradients == self.gradients:
            return False
        self.gradients = gradients
        self._position = {g.key: k for k, g in enumerate(gradients)}
        self._description = self._describe()
        self.lay_out()
        return True

    def lay_out(self) -> List[Bucket]:
        """Lay out new buckets for the current gradients (see the module docstring)."""
        bucketed = [g for g in self.gradients if self._bucketed(g)]
        plan = fusion.plan_gradient_buckets(
            [g.size * np.dtype(g.dtype).itemsize for g in bucketed],
            [(np.dtype(g.dtype), g.memory) for g in bucketed], self.bucket_threshold,
            self.num_groups)
        self.buckets = []
        self._bucket_of = [-1] * len(self.gradients)
        for number, members in enumerate(plan):
            for k in members:
                self._bucket_of[self._position[bucketed[k].key]] = number
            bounds = [0]
            for k in members:
                bounds.append(bounds[-1] + bucketed[k].size)
            first = bucketed[members[0]]
            self.buckets.append(Bucket(number, [bucketed[k].key for k in members], bounds,
                                       np.dtype(first.dtype), first.memory))
        return self.buckets

    def _bucketed(self, g: Gradient) -> bool:
        return (self.compression is Compression.none and not g.sparse
                and len(g.shape) > 0 and g.size > 0)

    def name(self, key: int) -> str:
        """The name of gradient ``key`` in collectives and the timeline."""
        return f"{self.prefix}grad.{key}"

    def description(self) -> Dict[str, Any]:
        """What the step's agreement checks (the same object while the gradients stay)."""
        return self._description

    def _describe(self) -> Dict[str, Any]:
        """Everything that fixes a step's collectives; kept while the gradients stay the same,
        so the agreement reuses its digest."""
        return {"kind": "trainer step", "name": f"{self.prefix}step",
                "compression": compression_key(self.compression),
                "num_groups": self.num_groups, "gradient_predivide_factor": self.predivide,
                "sparse_as_dense": self.sparse_as_dense,
                "tensors": [{"name": self.name(g.key), "shape": tuple(g.shape),
                             "dtype": g.dtype, "stype": "row_sparse" if g.sparse else "default",
                             "memory": g.memory} for g in self.gradients]}

    # -- readiness --------------------------------------------------------------------------
    def _current(self) -> ReducerStep:
        if self._step is None:
            self._step = ReducerStep(len(self.gradients), self.buckets, self._bucket_of,
                                     self._lock)
        return self._step

    def mark_ready(self, key: int, value: Any = None) -> None:
        """Gradient ``key`` is ready on this rank: its bucket view holds it, or ``value`` is
        its NumPy array (row-sparse: (ids, rows)) when it is not in a bucket.

        Thread-safe; with ``eager`` the first call of a step starts its reductions.
        """
        self.mark_all_ready(((key, value),))

    def mark_all_ready(self, ready: Iterable[Tuple[int, Any]]) -> None:
        """:meth:`mark_ready` for each (key, value) pair, in one call (step-time readiness)."""
        with self._lock:
            step = self._step or self._current()
            completes = False
            for key, value in ready:
                position = self._position.get(key)
                if position is None:
                    raise ValueError(f"gradient key {key!r} is not one of this reducer's "
                                     "gradients; pass it to set_gradients() first")
                if step._marks[position]:
                    raise RuntimeError(f"gradient {self.name(key)!r} was marked ready twice "
                                       "in one step")
                step._marks[position] = 1
                step.order.append(key)
                if value is not None:
                    step.values[position] = value
                step._unmarked -= 1
                number = step._bucket_of[position]
                if number >= 0:
                    step._unmarked_in[number] -= 1
                    completes = completes or step._unmarked_in[number] == 0
            completes = completes or step._unmarked == 0
            if self.eager:
                if completes:
                    step.changed.notify_all()
                self._start(step)
                if step._unmarked:  # gradients are still to come: reduce while they do
                    work_order.flush()

    def begin(self) -> None:
        """Queue this step's reductions now (``eager`` only), before any gradient is marked:
        from here the step goes ahead of whatever this rank starts next, as on the ranks
        whose first mark came earlier. Idempotent."""
        if not self.eager:
            raise RuntimeError("Reducer.begin() is for eager reducers; the others start "
                               "their step in launch()")
        with self._lock:
            self._start(self._step or self._current())

    def _start(self, step: ReducerStep) -> None:
        # Under the lock: an eager step's program, queued once. Deferred (work_order.defer):
        # handed to the communication thread when a mark leaves gradients still to come or
        # when this rank starts another collective, and run by launch() otherwise.
        if step.program is None:
            step.overlapped = True
            step.program = work_order.defer(functools.partial(self._run, step, False))

    def launch(self) -> ReducerStep:
        """Every gradient not marked ready is stale on this rank; launch what is left.

        A collective over the process set. Without ``eager`` this makes the step's agreement
        (with the freshness flags) and launches every bucket, on the communication thread
        with overlap or behind earlier work still there, here otherwise (the returned handles
        are then done). Either way the step comes after what this rank started before. Wait for the
        bucket handles or for :meth:`finish`, which raise what a reduction raised.
        """
        now = time.perf_counter()
        with self._lock:
            step = self._current()
            self._step = None
            step.number = self._launched
            self._launched += 1
            if self.autotuner is not None:
                self.autotuner.launched(step.number, now)
            step.closed = True
            step.changed.notify_all()
            if self.eager:
                self._start(step)
            elif step.program is None and self.overlap and self.size > 1 and \
                    runtime.mpi_threads_supported():
                step.overlapped = True
                step.program = work_order.start(functools.partial(self._run, step, True))
        if not self.eager and step.program is None:
            # Overlap off: reduce here, now, unless this rank's earlier work (an asynchronous
            # collective submitted before the step) is still on the communication thread;
            # then behind it there, so that every rank runs the two in the same order.
            step.program = work_order.defer(functools.partial(self._run, step, True))
        work_order.run_deferred(step.program)  # nothing came between: run it here
        return step

    def finish(self, step: ReducerStep) -> Dict[int, Any]:
        """Wait for ``step``'s reductions; return its reduced per-tensor gradients by key
        (a NumPy array, or (ids, rows) for a row-sparse one). Raises what a reduction raised.

        While autotuning, the reducer then takes the next step's setting: new buckets when
        the threshold changes (the adapter must back them), and after the last sample a
        broadcast of the first rank's choice (a collective at the same step on every rank).
        """
        step.program.result()
        for handle in step.handles:
            handle.wait()
        tuner = self.autotuner
        if tuner is not None and step.number <= tuner.last_step:
            if step.number == tuner.last_step:
                mine = tuple(tuner.best()) if self.process_set.rank() == 0 else None
                tuner.adopt(objects.broadcast_object(mine, self.process_set.ranks[0],
                                                     f"{self.prefix}autotune", self.process_set))
            self._use(tuner.setting(step.number + 1))
        return step.results

    def _use(self, setting: autotune.Setting) -> None:
        """Reduce with ``setting`` from the next step on."""
        self.overlap = setting.overlap
        if setting.bucket_threshold != self.bucket_threshold:
            self.bucket_threshold = setting.bucket_threshold
            if self.gradients:
                self.lay_out()

    def fresh(self, step: ReducerStep, key: int) -> bool:
        """Whether gradient ``key`` was reduced in ``step``."""
        return bool(step.fresh[self._position[key]])

    # -- the step's program -----------------------------------------------------------------
    def _wait_for(self, step: ReducerStep, positions: Sequence[int]) -> None:
        with step.changed:
            while not step.closed and not step.ready[positions].all():
                step.changed.wait()

    def _run(self, step: ReducerStep, flags: bool) -> None:
        """Agree, reduce the buckets in order, then the per-tensor gradients."""
        comm = runtime.communicator(self.process_set)
        stats = self.stats = CommStats()
        try:
            with agreement.covered(comm):
                with timeline.span(f"{self.prefix}step", "NEGOTIATE"):
                    if flags:
                        step.fresh[:] = agreement.agree(comm, lambda: self._description,
                                                          step.ready)
                    else:  # no flags yet, but (empty) flags keep it an exchange when covered
                        agreement.agree(comm, lambda: self._description, np.zeros(0, bool))
                        step.fresh[:] = True
                # A joined rank (see joined.py) learns each collective from its own agreement.
                with (agreement.uncovered(comm) if agreement.peers_joined(comm)
                      else contextlib.nullcontext()):
                    for bucket, done in zip(step.buckets, step._done):
                        positions = [self._position[k] for k in bucket.keys]
                        self._wait_for(step, positions)
                        self._reduce_bucket(bucket, positions, step, stats)
                        done.set_result(bucket)
                    self._wait_for(step, list(range(len(self.gradients))))
                    self._reduce_rest(step, stats)
        except BaseException as e:
            for done in step._done:
                if not done.done():
                    done.set_exception(e)
            raise
        finally:
            self.ready_order = step.order

    def _reduce_bucket(self, bucket: Bucket, positions: List[int], step: ReducerStep,
                       stats: CommStats) -> None:
        """Reduce ``bucket`` in place: whole when every member is ready here, otherwise the
        members fresh somewhere (zeros where stale here), in contiguous runs."""
        with bucket.active():
            self._reduce_open_bucket(bucket, positions, step, stats)

    def _reduce_open_bucket(self, bucket: Bucket, positions: List[int], step: ReducerStep,
                            stats: CommStats) -> None:
        name = f"{self.prefix}bucket.{bucket.number}"
        with timeline.span(name, "WAIT_FOR_GRADIENT"):
            host = bucket.host = bucket.open()
        whole = step.whole[bucket.number] = bool(step.ready[positions].all())
        runs: List[List[int]] = [[0, host.size]] if whole else []
        for p, start, end in zip(positions, bucket.bounds, bucket.bounds[1:]):
            if whole or not step.fresh[p]:
                continue
            if not step.ready[p]:
                host[start:end] = 0  # stale here: contribute zeros
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        if self.size > 1 and runs:
            ops.grouped_allreduce_([host[a:b] for a, b in runs], arguments.Sum, name,
                                   prescale_factor=1.0 / self.predivide,
                                   process_set=self.process_set)
            nbytes = sum(b - a for a, b in runs) * host.itemsize
            stats.add_allreduce(nbytes, nbytes, self.size)

    def _reduce_rest(self, step: ReducerStep, stats: CommStats) -> None:
        """The gradients outside buckets: row-sparse ones, then dense ones by group."""
        in_bucket = {k for b in step.buckets for k in b.keys}
        dense: List[Tuple[int, np.ndarray]] = []
        for p, g in enumerate(self.gradients):
            if not step.fresh[p] or g.key in in_bucket:
                continue
            value = step.values.get(p)
            if g.sparse:
                step.results[g.key] = self._sum_rows(g, value)
            else:
                dense.append((g.key, np.zeros(g.shape, g.dtype) if value is None else value))
        if self.size > 1 and dense:
            self.dense.sum_(dense, stats)
        step.results.update(dense)

    def _sum_rows(self, g: Gradient, value: Optional[Tuple[np.ndarray, np.ndarray]]
                  ) -> Tuple[np.ndarray, np.ndarray]:
        """Sum row-sparse gradient ``g``'s (ids, rows) across ranks (None: no rows here)."""
        if value is None:
            value = (np.empty(0, sparse.ID_DTYPE), np.empty((0,) + g.shape[1:], g.dtype))
        ids, rows, exchange = sparse.allreduce_rows(
            value[0], value[1], g.shape[0], self.name(g.key),
            prescale_factor=1.0 / self.predivide if self.size > 1 else 1.0,
            force_dense=self.sparse_as_dense, process_set=self.process_set)
        self.sparse_exchanges[g.key] = exchange
        return ids, rows

    def sum_rows_now(self, key: int, value: Optional[Tuple[np.ndarray, np.ndarray]]
                     ) -> Tuple[np.ndarray, np.ndarray]:
        """Sum row-sparse gradient ``key``'s (ids, rows) across the process set right now,
        outside any step, as a step would (None: no rows on this rank); return the summed
        (ids, rows). For an adapter that learns only after a step that a gradient is
        row-sparse. A collective."""
        return self._sum_rows(self.gradients[self._position[key]], value)

    def sum_now(self, tensors: Sequence[Tuple[int, np.ndarray]]) -> None:
        """Sum (key, array) pairs across the process set in place, right now, outside any step:
        ``num_groups`` grouped calls, each with its own agreement (for callers that reduce a
        few gradients at a time, such as an optimizer's update). A collective."""
        if self.size > 1 and tensors:
            stats = self.stats = CommStats()
            self.dense.sum_(tensors, stats)

    # -- state for exact resume -------------------------------------------------------------
    def _settings(self) -> Dict[str, Any]:
        return {"compression": compression_key(self.compression), "size": self.size}

    def gather_state(self, name: str) -> Optional[Dict[str, Any]]:
        """Every member's error-feedback state and the settings it belongs to, on the set's
        first rank (None on the others); None everywhere without error feedback. A collective."""
        if self.feedback is None:
            return None
        every = objects.gather_object(self.feedback.state(), self.process_set.ranks[0],
                                      name, self.process_set)
        return None if every is None else dict(self._settings(), residuals=every)

    def shared_state(self, name: str) -> Optional[Dict[str, Any]]:
        """What :meth:`gather_state` returns, on every member: an elastic commit, which any
        one rank's copy may have to restore, holds every member's residuals. A collective."""
        if self.feedback is None:
            return None
        return objects.broadcast_object(self.gather_state(name), self.process_set.ranks[0], name,
                                        self.process_set)

    def scatter_state(self, state: Optional[Dict[str, Any]], name: str) -> None:
        """Give each member its residuals from ``state`` (what :meth:`gather_state` returned,
        read on the set's first rank; ignored elsewhere). Residuals saved with other settings
        (another compressor or number of ranks) start again from zero, with a warning.
        A collective."""
        if self.feedback is None:
            return
        root = self.process_set.rank() == 0
        every = None
        if root and state is not None:
            saved = state if isinstance(state, dict) else {}
            if {k: saved.get(k) for k in self._settings()} == self._settings():
                every = state["residuals"]
            else:
                warnings.warn(f"the saved error-feedback residuals come from "
                              f"{saved.get('size')} ranks with {saved.get('compression')}, "
                              f"this job has {self.size} with {self._settings()['compression']}"
                              "; they start again from zero")
        if root and every is None:
            every = [None] * self.size
        mine = objects.scatter_object(every, self.process_set.ranks[0], name, self.process_set)
        self.feedback.restore(mine)
