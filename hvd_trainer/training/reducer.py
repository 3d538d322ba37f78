"""The gradient reducer: sums one set of gradients across a process set, step after step; the
one owner of an adapter's training steps, as PyTorch DDP's ``Reducer`` is of DDP's.

A framework adapter (the MXNet trainer, a PyTorch optimizer, TensorFlow's tapes through
array_reducer.py) describes its gradients as :class:`~.buckets.Gradient` records, backs the
reducer's buckets with its framework's flat storage, marks gradients ready, and publishes
the results. The reducer owns the rest:

- **Buckets.** Dense gradients are laid out in flat buckets (:func:`~.buckets.lay_out`), each
  reduced in place by the reducer's comm hook (:mod:`.hooks`): a plain sum, fp16, a packed
  codec, PowerSGD, Adasum or a user's hook. The adapter backs each :class:`~.buckets.Bucket`
  with its flat storage, makes the gradients views of it, and sets ``Bucket.open`` to return
  a NumPy (or CuPy) view of that storage once the framework's writes into it have finished,
  or, on a GPU, ``Bucket.active`` to a context that orders the reduction after them. A step
  copies no gradient bytes.
- **Steps.** Each step is a :class:`~.step.Step`, which owns its marks, its buckets'
  readiness, the agreed freshness and the results. :meth:`Reducer.mark` marks one gradient
  ready (from a per-parameter hook during backward), :meth:`Reducer.mark_all` many at once
  (step time); :meth:`Reducer.close` ends the marking (what is not marked is stale on this
  rank) and launches what is left; :meth:`Reducer.finish` waits for each bucket in launch
  order, hands it to the adapter, and returns the per-tensor results. With ``eager`` the
  step's program is queued at its first mark, ahead of the collectives this rank starts
  after backward, and reduces each bucket on the communication thread once it is complete.
- **Early close.** From its beginning until it is closed, an eager step is the thread's
  *closer* (:func:`hvd_trainer.coordination.work_order.on_own_collective`): a collective that
  the thread which began it starts before :meth:`close` first closes it, so the step does not
  wait for ``close()`` while ``close()`` waits for that collective. Not while the adapter's
  ``inside()`` says the thread still computes gradients (a collective made by an autograd
  function in backward).
- **Kinds.** Where the adapter learns only in backward which gradients are row-sparse, the
  ranks agree on it after the step (:mod:`.kinds`); the gradients found sparse leave the
  buckets from the next step on.
- **The program** (:mod:`.program`): the step's agreement (names, shapes, dtypes, memory,
  settings, the freshness flags), each bucket through the hook in order, then row-sparse
  gradients and the few dense ones outside buckets.
- **Autotuning.** With ``HVD_AUTOTUNE=1`` the first steps try bucket thresholds and overlap
  on and off on a schedule of step numbers (:mod:`.autotune`), the same on every rank; after
  the last sample the process set's first rank broadcasts its fastest setting.
- **State.** The hook's state (error-feedback residuals, PowerSGD's factors) moves between
  the ranks and the one rank that saves or loads a checkpoint (:mod:`.hook_state`).
"""
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..backends.halves import NUMPY, Kernels
from ..collectives import joined, objects, sparse
from ..collectives.traffic import CommStats
from ..compression import Compression
from ..coordination import work_order
from ..runtime import runtime
from ..runtime.runtime import ProcessSet, global_process_set
from . import autotune, program
from .buckets import Bucket, Gradient, check_settings, lay_out
from .hooks import CommHook, Hook, default_hook
from .kinds import Kinds
from .step import Step

Rows = Tuple[np.ndarray, np.ndarray]


class Reducer:
    """Sums a set of gradients across ``process_set``, step after step (see the module
    docstring). Only members of the process set may use it (its steps are collectives over
    the set).

    ``eager=True`` launches buckets as their gradients become ready (hooks during backward);
    an eager step holds the process set's turn from its first ready gradient until its
    reductions end, so call :meth:`close` every step, from a thread that is not itself
    waiting for another collective. Otherwise nothing moves before :meth:`close`, which then
    knows every gradient's freshness: a gradient fresh on some rank is reduced everywhere,
    stale ranks contributing zeros; one fresh nowhere is left untouched. ``kernels`` convert
    and sum 16-bit floats for fp16 (an adapter passes its framework's; NumPy's by default).
    """

    def __init__(self, *, prefix: str = "", compression: Any = Compression.none,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set,
                 eager: bool = False, kernels: Kernels = NUMPY):
        check_settings(gradient_predivide_factor, num_groups)
        runtime.init()
        self.prefix = prefix
        self.compression = compression
        self.hook: CommHook = default_hook(compression)
        self.kernels = kernels
        self.predivide = float(gradient_predivide_factor)
        self.num_groups = int(num_groups)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self.eager = eager
        # Rank 0's settings, so that every rank lays out the same buckets.
        self.bucket_threshold = runtime.setting("BUCKET_THRESHOLD")
        self.overlap = runtime.setting("OVERLAP") != 0
        self.gradients: Tuple[Gradient, ...] = ()
        self.buckets: List[Bucket] = []
        self.description: Dict[str, Any] = {}  # what the step's agreement checks
        self._position: Dict[int, int] = {}
        self._bucket_of: List[int] = []
        self._lock = threading.Lock()
        self._step: Optional[Step] = None      # the step being marked
        self._early: Optional[Tuple[Step, bool]] = None  # closed by a collective, not close()
        self._last: Optional[Step] = None      # the last step finished
        self._launched = 0                     # steps launched so far
        self._back: Callable[[List[Bucket]], None] = lambda buckets: None
        self._backed: Optional[List[Bucket]] = None
        self._rows: Callable[[int, Any], Optional[Rows]] = lambda k, value: value
        self._fill: Callable[[Sequence[bool]], None] = lambda ready: None
        self._inside: Callable[[], bool] = lambda: False
        self.kinds: Optional[Kinds] = None
        self.autotuner = self._autotuner() if runtime.setting("AUTOTUNE") else None

    @property
    def size(self) -> int:
        """The process set's number of ranks now (hvdrun --ulfm may shrink the job)."""
        return self.process_set.size()

    def _autotuner(self) -> autotune.Autotuner:
        """The autotuner over what can vary here: thresholds only when they lay out the
        buckets, overlap only when a step may run on the communication thread."""
        thresholds = autotune.THRESHOLDS if self.num_groups == 0 else (self.bucket_threshold,)
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

    # -- the adapter ------------------------------------------------------------------------
    def attach(self, back: Callable[[List[Bucket]], None], *,
               kinds: Optional[Kinds] = None,
               rows: Optional[Callable[[int, Any], Optional[Rows]]] = None,
               fill: Optional[Callable[[Sequence[bool]], None]] = None,
               inside: Optional[Callable[[], bool]] = None) -> None:
        """The adapter's side of the steps. ``back(buckets)`` backs a new layout of buckets;
        ``kinds``: the gradients' kinds, where they are to be agreed after the steps that
        reveal them; ``rows(k, value)`` makes a revealing sparse gradient (as given to
        :meth:`see`) the (ids, rows) of its agreed kind; ``fill(ready)`` marks, when a step
        closes, what this rank has not marked yet but should; ``inside()`` says whether the
        calling thread still computes gradients (no early close then)."""
        self._back = back
        self._rows = rows or self._rows
        self._fill = fill or self._fill
        self._inside = inside or self._inside
        if kinds is not None:
            self.kinds = kinds
            self.set_gradients(kinds.gradients())
            joined.after_join(self._settle)
        self.back_if_relaid()

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (see :mod:`.hooks`) from the next
        step on, instead of the hook of ``compression=``. Once, before the first step, with
        the same hook on every rank (the step's agreement checks its name)."""
        if not callable(hook):
            raise TypeError(f"hook={hook!r} must be a function hook(state, bucket) -> Future")
        if self.compression is not Compression.none or not self.hook.builtin:
            raise ValueError("a comm hook replaces compression=: register it once, on a "
                             "DistributedOptimizer/DistributedTrainer made with "
                             "compression=Compression.none")
        if self._launched or self._step is not None:
            raise ValueError("register_comm_hook() must be called before the first step "
                             "(before the first backward pass)")
        self.hook = CommHook(state, hook)
        self.description = self._describe()

    def back_if_relaid(self) -> bool:
        """Have the adapter back the reducer's buckets if they are not the ones it backed
        last; True if it did."""
        if self.buckets is self._backed:
            return False
        self._back(self.buckets)
        self._backed = self.buckets
        return True

    def see(self, k: int, kind: int, revealing: Any = None) -> None:
        """This rank's gradient ``k``, of a kind not agreed yet, is of ``kind`` (see
        :meth:`.kinds.Kinds.see`)."""
        self.kinds.see(k, kind, revealing)

    # -- the gradients and their layout -----------------------------------------------------
    def set_gradients(self, gradients: Sequence[Gradient]) -> bool:
        """Reduce ``gradients`` from the next step on. When they differ from the current ones,
        the buckets are laid out anew (the adapter must back them) and True is returned."""
        gradients = tuple(gradients)
        if gradients == self.gradients:
            return False
        self.gradients = gradients
        self._position = {g.key: k for k, g in enumerate(gradients)}
        self.description = self._describe()
        self.lay_out()
        return True

    def lay_out(self) -> List[Bucket]:
        """Lay out new buckets for the current gradients (see :func:`.buckets.lay_out`)."""
        self.buckets, self._bucket_of = lay_out(self.gradients, self.bucket_threshold,
                                                self.num_groups)
        return self.buckets

    def name(self, key: int) -> str:
        """The name of gradient ``key`` in collectives and the timeline."""
        return f"{self.prefix}grad.{key}"

    def position(self, key: int) -> int:
        """Where gradient ``key`` is among the current gradients."""
        position = self._position.get(key)
        if position is None:
            raise ValueError(f"gradient key {key!r} is not one of this reducer's gradients; "
                             "pass it to set_gradients() first")
        return position

    def _describe(self) -> Dict[str, Any]:
        """Everything that fixes a step's collectives; kept while the gradients stay the same,
        so the agreement reuses its digest."""
        return {"kind": "trainer step", "name": f"{self.prefix}step",
                "compression": self.hook.describe(),
                "num_groups": self.num_groups, "gradient_predivide_factor": self.predivide,
                "sparse_as_dense": self.sparse_as_dense,
                "tensors": [{"name": self.name(g.key), "shape": tuple(g.shape),
                             "dtype": g.dtype, "stype": "row_sparse" if g.sparse else "default",
                             "memory": g.memory} for g in self.gradients]}

    # -- readiness --------------------------------------------------------------------------
    def _current(self) -> Step:
        """The step being marked, made (and with ``eager``, queued) by the first mark."""
        step = self._step
        if step is not None:
            return step
        with self._lock:  # two backward threads (CPU and GPU gradients) may mark first at once
            made = self._step is None
            if made:
                self._step = Step(self.buckets, self._bucket_of, self._lock)
                if self.eager:
                    self._start(self._step)
            step = self._step
        if made and self.eager:
            work_order.on_own_collective(self._close_early)
        return step

    def begin(self) -> None:
        """Queue this step's reductions now (``eager`` only), before any gradient is marked:
        from here the step goes ahead of whatever this rank starts next. Idempotent."""
        if not self.eager:
            raise RuntimeError("Reducer.begin() is for eager reducers; the others start "
                               "their step in close()")
        self._current()

    def mark(self, key: int, value: Any = None) -> None:
        """Gradient ``key`` is ready on this rank: its bucket view holds it, or ``value`` is
        its NumPy array (row-sparse: (ids, rows)) when it is not in a bucket."""
        step = self._current()
        position = self.position(key)
        if step.marked(position):
            raise RuntimeError(f"gradient {self.name(key)!r} was marked ready twice in one "
                               "step")
        if step.mark(position, value) and self.eager and step.pending():
            work_order.flush()  # gradients are still to come: reduce while they do

    def mark_all(self, ready: Iterable[Tuple[int, Any]]) -> None:
        """:meth:`mark` for each (key, value) pair, in one call (step-time readiness)."""
        step = self._current()
        marks, seen = [], set()
        for key, value in ready:
            position = self.position(key)
            if step.marked(position) or position in seen:
                raise RuntimeError(f"gradient {self.name(key)!r} was marked ready twice in "
                                   "one step")
            seen.add(position)
            marks.append((position, value))
        step.mark_all(marks)
        if self.eager and step.pending():
            work_order.flush()

    def _start(self, step: Step) -> None:
        # Under the lock: an eager step's program, queued once. Deferred (work_order.defer):
        # handed to the communication thread when a mark leaves gradients still to come or
        # when this rank starts another collective, and run by close() otherwise.
        if step.program is None:
            step.overlapped = True
            step.program = work_order.defer(lambda: program.run(self, step, False))

    # -- closing ----------------------------------------------------------------------------
    def _close_early(self) -> bool:
        """The closer: close the step now, unless the thread still computes gradients."""
        if self._inside():
            return False
        self._early = self._launch()
        return True

    def close(self) -> Tuple[Step, bool]:
        """Close this step (what is not marked is stale here) and launch it, unless a
        collective closed it already; return it and whether every gradient had been marked
        before. A collective over the process set."""
        work_order.forget_closer(self._close_early)
        if self._early is not None:
            closed, self._early = self._early, None
            return closed
        return self._launch()

    def _launch(self) -> Tuple[Step, bool]:
        step = self._step
        if step is None:  # nothing marked: the adapter's fill() may mark into it
            step = self._step = Step(self.buckets, self._bucket_of, self._lock)
        every_marked = bool(step.ready.all())
        self._fill(step.ready)
        now = time.perf_counter()
        with self._lock:
            self._step = None
            step.number = self._launched
            self._launched += 1
            if self.autotuner is not None:
                self.autotuner.launched(step.number, now)
            if self.eager:
                self._start(step)
            elif self.overlap and self.size > 1 and runtime.mpi_threads_supported():
                step.overlapped = True
                step.program = work_order.start(lambda: program.run(self, step, True))
        step.close()
        if step.program is None:
            # Overlap off: reduce here, now, unless this rank's earlier work (an asynchronous
            # collective submitted before the step) is still on the communication thread;
            # then behind it there, so that every rank runs the two in the same order.
            step.program = work_order.defer(lambda: program.run(self, step, True))
        work_order.run_deferred(step.program)  # nothing came between: run it here
        return step, every_marked

    def fresh(self, step: Step, key: int) -> bool:
        """Whether gradient ``key`` was reduced in ``step``."""
        return step.fresh(self._position[key])

    # -- finishing --------------------------------------------------------------------------
    def finish(self, step: Step, on_bucket: Callable[[Bucket], None] = lambda bucket: None
               ) -> Tuple[Dict[int, Any], bool]:
        """Wait for each bucket of ``step`` in launch order and call ``on_bucket`` with it;
        agree on the kinds not agreed yet; return the reduced per-tensor gradients by key (a
        NumPy array, or (ids, rows)) and whether the buckets were laid out anew (and backed).
        Raises what a reduction raised, after the reductions have ended.

        While autotuning, the reducer then takes the next step's setting: new buckets when
        the threshold changes, and after the last sample a broadcast of the first rank's
        choice (a collective at the same step on every rank)."""
        try:
            for bucket, handle in step.launched():
                handle.wait()
                on_bucket(bucket)
            step.program.result()
            found, revealing = ([], {}) if self.kinds is None else self.kinds.agree(
                f"{self.prefix}gradient_kinds", self.process_set)
        except BaseException:
            step.program.exception()  # let the reductions end before leaving
            if self.kinds is not None:
                self.kinds.forget()
            raise
        self._last = step
        self._tune(step)
        if found:
            self.set_gradients(self.kinds.gradients())
        relaid = self.back_if_relaid()
        results = step.results
        for k in found:  # every rank's first gradient was sparse: sum it by rows as well
            results[k] = program.sum_rows(self, self.gradients[self._position[k]],
                                          self._rows(k, revealing.get(k)), step)
        return results, relaid

    def _tune(self, step: Step) -> None:
        tuner = self.autotuner
        if tuner is None or step.number > tuner.last_step:
            return
        if step.number == tuner.last_step:
            mine = tuple(tuner.best()) if self.process_set.rank() == 0 else None
            tuner.adopt(objects.broadcast_object(mine, self.process_set.ranks[0],
                                                 f"{self.prefix}autotune", self.process_set))
        setting = tuner.setting(step.number + 1)
        self.overlap = setting.overlap
        if setting.bucket_threshold != self.bucket_threshold:
            self.bucket_threshold = setting.bucket_threshold
            if self.gradients:
                self.lay_out()

    def _settle(self) -> None:
        """At the end of join(): take the kinds that the other ranks decided while this rank
        was joined. A collective over the process set (its members)."""
        if not self.process_set.included():
            return
        if self.kinds.settle(f"{self.prefix}settled_kinds", self.process_set):
            self.set_gradients(self.kinds.gradients())
        self.back_if_relaid()

    @property
    def stats(self) -> CommStats:
        """The traffic and codec time of the last step (or :meth:`sum_now` call)."""
        return self._last.stats if self._last is not None else CommStats()

    @property
    def sparse_exchanges(self) -> Dict[int, sparse.Exchange]:
        """How each row-sparse gradient travelled in the last step, by key."""
        return self._last.exchanges if self._last is not None else {}

    def sum_now(self, tensors: Sequence[Tuple[int, np.ndarray]]) -> None:
        """Sum (key, array) pairs across the process set in place, right now, outside any
        step, through the hook: ``num_groups`` groups (one for 0), each with its own
        agreements (for callers that reduce a few gradients at a time, such as an
        optimizer's update). A collective."""
        step = Step([], [], self._lock)
        if self.size > 1 and tensors:
            program.sum_outside(self, list(tensors), step.stats)
        self._last = step
