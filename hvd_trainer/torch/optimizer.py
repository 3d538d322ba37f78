"""DistributedOptimizer: horovod.torch's optimizer wrapper, over the core's gradient reducer.

Per-parameter post-accumulate-grad hooks mark each gradient ready with the reducer (built with
``eager=True``) as backward produces it, so the reducer's buckets are reduced on the
communication thread while backward still computes earlier layers; ``synchronize()`` (called
by ``step()``) launches what is left, waits, and leaves every gradient averaged or summed.
Gradients that become ready while backward has still to make a collective of its own
(SyncBatchNorm's, see :mod:`.backward_collectives`) are held back until it has run.

**Gradients are views into the buckets.** Each bucket is one flat CPU tensor and each of its
parameters' ``.grad`` is set to a view of it, so the reducer's NumPy view of the flat tensor
is the gradients' own memory and a bucket is reduced in place. While ``.grad`` is that view
(after a step, and after ``zero_grad(set_to_none=False)``), backward accumulates straight into
the bucket and a step copies no gradient bytes. After ``zero_grad()`` (``set_to_none=True``,
PyTorch's default) backward makes a fresh ``.grad``; the hook then copies it into the bucket
once and installs the view again, as PyTorch DDP does with ``gradient_as_bucket_view``.

**CUDA parameters.** Their buckets are flat tensors on the parameters' GPU, handed to the core
as CuPy arrays (bridge.py), so gradients never leave the device. The stream rule: a bucket
is reduced on a stream of the optimizer's own, which first waits for the streams that
produced its gradients (an event recorded when each is marked ready, on the stream current
in its hook), and ``synchronize()`` makes the caller's current stream wait for each bucket
before it scales the bucket or returns, so what PyTorch queues afterwards (``step()``'s
update) sees the reduced gradients. The host waits only for the collectives to be queued.
CUDA parameters need ``compression=Compression.none`` and at least one element each; their
sparse gradients are reduced densely.

**Sparse gradients** (``nn.Embedding(sparse=True)``) are summed by the core's row allgather
(:func:`hvd_trainer.sparse.allreduce_rows`, dense fallback included) unless
``sparse_as_dense``. Which gradients are sparse shows only in backward, and a rank that has no
gradient for a parameter cannot tell, so the ranks agree on each parameter's kind in one
small exchange after the steps in which some parameter has had no gradient on any rank yet
(usually the first step only). Until then a parameter's gradient is in a bucket: a sparse one
travels densely in the step that reveals it (then by rows as well, which the result is taken
from), and leaves the buckets from the next step on.
"""
import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch

from .. import compression as core_compression
from .. import handles, joined
from .. import ops as core_ops
from .. import sparse
from ..ops import Average, Sum
from ..reducer import Bucket, Gradient, Reducer, check_settings
from ..runtime import ProcessSet, global_process_set
from . import backward_collectives, bridge
from . import sparse as torch_sparse
from .adasum_optimizer import AdasumDistributed, check_adasum
from .compression import KERNELS, Compression, FP16Compressor
from .ops import Adasum

# A gradient's kind as the ranks agree on it; the largest code wins, so dense beats sparse.
# Sparse COO gradients with s sparse dimensions have the code s (1, 2, ...).
_NONE = 0    # no rank has had a gradient for the parameter yet
_DENSE = 64


def _core_compressor(compression: Any) -> Any:
    """The core compressor (which works on NumPy arrays) for ``compression``."""
    if compression is FP16Compressor:
        return core_compression.Compression.fp16
    return compression


class _Distributed:
    """The methods that DistributedOptimizer adds to the wrapped optimizer's class."""

    def _set_up(self, names: Dict[int, str], compression: Any, backward_passes_per_step: int,
                op: Any, gradient_predivide_factor: float, num_groups: int,
                sparse_as_dense: bool, process_set: ProcessSet) -> None:
        self._process_set = process_set
        self._passes = backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True
        self._hooks: List[Any] = []
        self._parameter_names = _parameter_names(self, names)
        self._params: List[torch.nn.Parameter] = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._names = [self._parameter_names[p] for p in self._params]
        self._left = [backward_passes_per_step] * len(self._params)  # passes until ready
        self._marked = [False] * len(self._params)
        self._begun = False  # this step's reductions have started
        self._early: Optional[Tuple[Any, bool]] = None  # the step, closed before step()
        self._held: List[int] = []  # ready, held back while backward has collectives to make
        self._views: Dict[int, torch.Tensor] = {}
        self._flats: List[torch.Tensor] = []
        self._backed: List[Bucket] = []
        self._kinds = [_DENSE if sparse_as_dense else _NONE] * len(self._params)
        self._seen = [_NONE] * len(self._params)  # this step's kinds, of the undecided ones
        self._revealing: Dict[int, torch.Tensor] = {}  # first sparse gradients, by key
        # Gradients that backward made sparse on this rank and that are reduced densely, with
        # their sparse dimensions (see synchronize)
        self._densified: Dict[int, int] = {}
        self._reducer: Optional[Reducer] = None
        if not process_set.included():
            return  # a plain local optimizer, as in Horovod
        gpu = [k for k, p in enumerate(self._params) if bridge.is_cuda(p)]
        for k in gpu:
            _check_gpu_parameter(self._params[k], self._names[k], compression)
            self._kinds[k] = _DENSE
        # CUDA parameters: the stream their buckets are reduced on, an event per gradient
        # (its producer's stream, when marked ready) and per bucket (reduced).
        self._stream = torch.cuda.Stream(self._params[gpu[0]].device) if gpu else None
        self._produced = {k: torch.cuda.Event() for k in gpu}
        self._reduced: Dict[int, Any] = {}
        size = process_set.size()
        # The reducer sums with 1/f before; Average multiplies by f/size after.
        self._postscale = gradient_predivide_factor / size if op == Average else 1.0
        self._reducer = Reducer(prefix="DistributedOptimizer.",
                                compression=_core_compressor(compression),
                                gradient_predivide_factor=gradient_predivide_factor,
                                num_groups=num_groups, sparse_as_dense=sparse_as_dense,
                                process_set=process_set, eager=True, kernels=KERNELS)
        self._reducer.set_gradients(self._gradients())
        self._back_buckets()
        joined.after_join(self._settle_kinds)
        for k, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._on_gradient, k)))

    def _gradients(self) -> List[Gradient]:
        """The gradients as the reducer must know them: row-sparse where agreed sparse."""
        gradients = []
        for k, p in enumerate(self._params):
            kind = self._kinds[k]
            if _NONE < kind < _DENSE:
                dtype = str(bridge.view(p.detach()).dtype)
                gradients.append(Gradient(k, torch_sparse.table_shape(p.shape, kind), dtype,
                                          sparse=True))
            else:
                gradients.append(_gradient(k, p))
        return gradients

    def _back_buckets(self) -> None:
        """Back each of the reducer's buckets with a flat tensor whose views become the
        gradients; values in the previous views move into the new ones."""
        previous = self._views
        self._views, self._flats = {}, []
        self._bucket_of: Dict[int, int] = {}
        for bucket in self._reducer.buckets:
            first = self._params[bucket.keys[0]]
            flat = torch.zeros(bucket.bounds[-1], dtype=first.dtype, device=first.device)
            self._flats.append(flat)
            for k, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                view = self._views[k] = flat[start:end].view(self._params[k].shape)
                self._bucket_of[k] = bucket.number
                if k in previous:
                    view.copy_(previous[k])
            bucket.open = functools.partial(bridge.view, flat)
            if bridge.is_cuda(flat):
                self._reduced[bucket.number] = torch.cuda.Event()
                bucket.active = functools.partial(self._on_stream, bucket)
        self._backed = self._reducer.buckets
        self._loose = [k for k in range(len(self._params)) if k not in self._views]
        self._bucket_sizes = [len(bucket.keys) for bucket in self._backed]
        # Gradients ready here, per bucket, until the whole bucket goes to the reducer in one
        # call: one lock and one wake-up of its program per bucket instead of per gradient.
        self._in_bucket: List[List[int]] = [[] for _ in self._backed]

    @contextlib.contextmanager
    def _on_stream(self, bucket: Bucket) -> Iterator[None]:
        """A GPU bucket's reduction (on the communication thread): on the optimizer's stream,
        after its gradients' producers; the bucket's event marks its end."""
        for k in bucket.keys:
            self._stream.wait_event(self._produced[k])
        with bridge.on_stream(self._stream):
            yield
        self._reduced[bucket.number].record(self._stream)

    def _on_gradient(self, k: int, param: torch.Tensor) -> None:
        """Backward accumulated parameter ``k``'s gradient: count the pass, and after the
        last of ``backward_passes_per_step`` mark the gradient ready."""
        if self._left[k] <= 0:
            raise RuntimeError(
                f"the gradient of {self._names[k]!r} was computed more than "
                f"backward_passes_per_step={self._passes} times before step() or "
                "synchronize(); raise backward_passes_per_step to accumulate more passes")
        left = self._left[k] = self._left[k] - 1
        if left:
            return
        if backward_collectives.pending():
            self._held.append(k)
            return
        if self._held:
            held, self._held = self._held, []
            for h in held:
                self._mark(h)
        self._mark(k)

    def _mark(self, k: int) -> None:
        """Hand gradient ``k`` to the reducer: as (ids, rows) where agreed sparse, otherwise
        dense, in its bucket view or as a NumPy view."""
        if not self._begun:
            # The step starts at its first ready gradient, as the reducer's per-gradient
            # marks used to start it, even though marks now go to it a bucket at a time.
            self._begun = True
            self._reducer.begin()
            handles.on_own_collective(self._close_early)
        p = self._params[k]
        grad = p.grad
        kind = self._kinds[k]
        self._marked[k] = True
        if kind == _NONE:
            is_sparse = grad.layout == torch.sparse_coo
            self._seen[k] = grad.sparse_dim() if is_sparse else _DENSE
            if is_sparse:  # kept for the rows, in case every rank's first gradient is sparse
                self._revealing[k] = grad
        elif kind != _DENSE:
            self._reducer.mark_ready(k, self._rows(k, grad))
            return
        if grad.layout != torch.strided:
            if kind == _DENSE:  # sparse_as_dense, or a CUDA parameter: it goes back sparse
                self._densified[k] = grad.sparse_dim()
            grad = p.grad = grad.to_dense()
        view = self._views.get(k)
        if view is not None:
            self._into_bucket(k, p, grad, view)
        else:
            if not grad.is_contiguous():
                grad = p.grad = grad.contiguous()
            self._reducer.mark_ready(k, bridge.view(grad))

    def _into_bucket(self, k: int, p: torch.Tensor, grad: torch.Tensor,
                     view: torch.Tensor) -> None:
        """Make dense gradient ``k`` its bucket view; once the bucket's gradients are all in,
        hand the bucket to the reducer."""
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            p.grad = view
        if k in self._produced:  # on the stream current here, which wrote it
            self._produced[k].record(torch.cuda.current_stream(p.device))
        number = self._bucket_of[k]
        ready = self._in_bucket[number]
        ready.append(k)
        if len(ready) == self._bucket_sizes[number]:
            self._reducer.mark_all_ready([(key, None) for key in ready])

    def _rows(self, k: int, grad: Optional[torch.Tensor]
              ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Sparse gradient ``k`` as (ids, rows); a gradient in another form (dense, or other
        sparse dimensions) as all its rows; None for no gradient."""
        if grad is None:
            return None
        sparse_dim = self._kinds[k]
        if grad.layout == torch.sparse_coo and grad.sparse_dim() == sparse_dim:
            return torch_sparse.to_rows(grad)
        table = grad.detach().to_dense().reshape(
            torch_sparse.table_shape(grad.shape, sparse_dim)).contiguous()
        return np.arange(table.shape[0], dtype=np.int64), bridge.view(table)

    def _agree_kinds(self) -> List[int]:
        """Agree with the other ranks on the kind of each gradient that has been on no rank
        before this step; lay out the buckets again without those found sparse, and return
        them. A collective (a small allreduce) in steps that have such gradients."""
        undecided = [k for k, kind in enumerate(self._kinds) if kind == _NONE]
        if not undecided:
            return []
        return self._take_kinds(undecided, [self._seen[k] for k in undecided], "gradient_kinds")

    def _take_kinds(self, keys: List[int], mine: List[int], name: str) -> List[int]:
        """Adopt, for gradients ``keys``, the largest of the ranks' kinds (``mine`` here); lay
        out the reducer's gradients again when one is sparse, and return those. A collective
        (a small allreduce over the process set)."""
        agreed = core_ops.allreduce(np.array(mine, np.int8), core_ops.Max,
                                    f"{self._reducer.prefix}{name}",
                                    process_set=self._process_set)
        for k, kind in zip(keys, agreed):
            self._kinds[k] = int(kind)
        found = [k for k, kind in zip(keys, agreed) if _NONE < kind < _DENSE]
        if found:
            self._reducer.set_gradients(self._gradients())
        return found

    def _settle_kinds(self) -> None:
        """At the end of join(): take the gradient kinds that the other ranks decided while
        this rank was joined (or keep one's own), so that every rank's next steps agree on
        the same gradients. A collective over the process set (on its members)."""
        if not self._process_set.included():
            return
        self._take_kinds(list(range(len(self._kinds))), self._kinds, "settled_kinds")
        if self._reducer.buckets is not self._backed:
            self._back_buckets()

    def _close_early(self) -> bool:
        """This thread, which ran backward, starts a synchronous collective before step():
        backward is over, so close the step now (see :func:`_close`); not from inside a
        backward (a custom autograd function's collective), where gradients are still to
        come. True once closed."""
        if torch._C._current_graph_task_id() != -1:
            return False
        self._early = self._close()
        return True

    def _close(self) -> Tuple[Any, bool]:
        """Hand the reducer what the hooks did not (no gradient: zeros) and launch the step;
        return it and whether the hooks had marked every gradient."""
        backward_collectives.forget()
        self._held = []
        marked = self._marked
        every_marked = all(marked)
        if not every_marked:
            for k, p in enumerate(self._params):
                if not marked[k] and p.grad is not None:
                    self._mark(k)
        for k, event in self._produced.items():
            if not marked[k]:  # its bucket's zeros come after what the caller queued so far
                event.record(torch.cuda.current_stream(self._params[k].device))
        for number, ready in enumerate(self._in_bucket):
            if ready and len(ready) < self._bucket_sizes[number]:
                self._reducer.mark_all_ready([(key, None) for key in ready])
        self._in_bucket = [[] for _ in self._backed]
        return self._reducer.launch(), every_marked

    def synchronize(self) -> None:
        """Finish reducing every gradient; afterwards each ``.grad`` holds the average (or
        sum) over the process set. A collective: every member calls it once per step."""
        if self._reducer is None:
            return
        handles.forget_closer(self._close_early)
        if self._early is not None:  # closed by a collective between backward and here
            (step, every_marked), self._early = self._early, None
        else:
            self._begun = True  # launch() starts the step; no closer from here on
            step, every_marked = self._close()
        revealing, self._revealing = self._revealing, {}
        try:
            for bucket, handle in step.launched():
                handle.wait()
                flat = self._flats[bucket.number]
                if bucket.number in self._reduced:
                    torch.cuda.current_stream(flat.device).wait_event(
                        self._reduced[bucket.number])
                if self._postscale != 1.0:
                    flat.mul_(self._postscale)
            results = self._reducer.finish(step)
            found = self._agree_kinds()
        finally:
            self._left = [self._passes] * len(self._params)
            self._marked = [False] * len(self._params)
            self._seen = [_NONE] * len(self._params)
            self._begun = False
        relaid = self._reducer.buckets is not self._backed
        if relaid:
            self._back_buckets()
        for k in found:  # every rank's first gradient was sparse: sum it by rows as well
            results[k] = self._reducer.sum_rows_now(k, self._rows(k, revealing.get(k)))
        # A gradient the hooks marked in a bucket is already its view (see _mark).
        keys = (self._loose if every_marked and not relaid else range(len(self._params)))
        for k in keys:
            p = self._params[k]
            kind = self._kinds[k]
            if kind == _NONE:
                continue  # no rank has had a gradient: its kind, dense or sparse, is unknown
            if kind != _DENSE:
                ids, rows = results[k]
                rows = bridge.adopt(rows)
                if self._postscale != 1.0:
                    rows.mul_(self._postscale)
                p.grad = torch_sparse.from_rows(ids, rows, p.shape)
                continue
            view = self._views.get(k)
            if view is not None:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
                continue
            result = results[k]
            if p.grad is None or result.ctypes.data != p.grad.data_ptr():
                p.grad = bridge.adopt(result)
            if self._postscale != 1.0:
                p.grad.mul_(self._postscale)
        for k, sparse_dim in self._densified.items():
            # Horovod's sparse_as_dense hands the reduced gradient back sparse, so optimizers
            # that take only sparse gradients (SparseAdam) still step; rows that sum to zero
            # are left out, as its to_sparse() leaves them.
            p = self._params[k]
            p.grad = p.grad.to_sparse(sparse_dim)
        self._synchronized = True

    @property
    def sparse_exchanges(self) -> Dict[str, sparse.Exchange]:
        """How each sparse gradient travelled in the last step, by parameter name:
        ``Exchange(dense, gathered_rows, bytes)`` (see :mod:`hvd_trainer.sparse`)."""
        if self._reducer is None:
            return {}
        return {self._names[k]: e for k, e in self._reducer.sparse_exchanges.items()}

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per step from now on; call it between steps."""
        _check_passes(passes)
        self._passes = int(passes)
        self._left = [self._passes] * len(self._params)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize: call ``synchronize()`` first
        (e.g. to clip the reduced gradients), then ``step()`` here."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then the wrapped step."""
        if self._should_synchronize:
            if self._synchronized:
                # The warning's first words are Horovod's, which scripts and tests match.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): the gradients are "
                              "reduced again. Call step() inside "
                              "`with optimizer.skip_synchronize():` after synchronize()")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped ``zero_grad``; refused between backward and step()/synchronize(),
        while gradients are being reduced."""
        if any(left != self._passes for left in self._left):
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but "
                               "before optimizer.step() or optimizer.synchronize(); call it "
                               "before backward (or after step) instead")
        super().zero_grad(set_to_none=set_to_none)


def _gradient(k: int, p: torch.Tensor) -> Gradient:
    """Parameter ``k``'s dense gradient as the reducer describes it. A CUDA one lives on the
    GPU, and a 0-d one there is described as one element so that it gets a bucket like the
    rest."""
    dtype = str(bridge.view(torch.empty(0, dtype=p.dtype)).dtype)
    if bridge.is_cuda(p):
        return Gradient(k, tuple(p.shape) or (1,), dtype, memory="gpu")
    return Gradient(k, tuple(p.shape), dtype)


def _check_gpu_parameter(p: torch.Tensor, name: str, compression: Any) -> None:
    """Refuse a CUDA parameter whose gradient cannot be reduced in a GPU bucket."""
    bridge.check_gpu(p, f"parameter {name!r}")
    if compression is not Compression.none:
        raise ValueError(f"parameter {name!r} is on {p.device}, and compression= works on "
                         "host gradients only; pass compression=Compression.none for CUDA "
                         "parameters")
    if p.numel() == 0:
        raise ValueError(f"parameter {name!r} on {p.device} has no elements; CUDA parameters "
                         "need at least one (drop it from the optimizer)")


@functools.lru_cache(maxsize=None)
def _distributed_class(base: type, mixin: type) -> type:
    """The wrapped optimizer's class with ``mixin``'s methods in front."""
    return type(base.__name__, (mixin, base), {"__doc__": base.__doc__})


def _parameter_names(optimizer: torch.optim.Optimizer,
                     names: Dict[int, str]) -> Dict[torch.Tensor, str]:
    """Every parameter of the optimizer's groups with its name (Horovod's attribute
    ``_parameter_names``): the given one, else Horovod's ``allreduce.noname.<group>.<index>``."""
    return {p: names.get(id(p), f"allreduce.noname.{i}.{j}")
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])}


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Optional[Any] = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op=Average``) or
    summed (``op=Sum``) over ``process_set``, or the ranks' updates combined by Adasum
    (``op=Adasum``, see :mod:`.adasum_optimizer`), as horovod.torch's DistributedOptimizer.

    Returns an instance of a subclass of the optimizer's class sharing its parameter groups,
    options and state (use it in place of ``optimizer``, also for LR schedulers). Gradients
    are reduced in buckets during backward and live in them as views (see the module
    docstring). ``backward_passes_per_step`` passes accumulate locally before a reduction;
    a parameter without a gradient on a rank contributes zeros there (if no rank has one,
    it gets a zero gradient, as in Horovod; before any rank has had one, it keeps none).
    ``gradient_predivide_factor`` f (Average only) scales by 1/f before the sum and f/size
    after. ``num_groups`` > 0 sets the number of buckets. ``compression``:
    ``Compression.none``, ``Compression.fp16`` or a core packed compressor
    (``hvd_trainer.compression``); it applies to dense CPU gradients only. CUDA parameters are
    reduced in buckets on their GPU, in order with PyTorch's streams (see the module
    docstring). Sparse COO gradients
    (``nn.Embedding(sparse=True)``) stay sparse: the result holds the rows touched on any
    rank, summed by the core's row allgather, or by a dense allreduce where that moves fewer
    bytes; ``sparse_as_dense=True`` makes them dense before the reduction, and sparse again
    after it, as in Horovod. ``groups`` is refused (see docs/migrating/horovod-torch.md).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, (_Distributed, AdasumDistributed)):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap it only once")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op={op!r}: DistributedOptimizer takes op=hvd.Average, op=hvd.Sum "
                         "or op=hvd.Adasum")
    if op != Average and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average; pass "
                         "gradient_predivide_factor=1.0 with op=hvd.Sum")
    if groups is not None:
        raise ValueError("groups= is not supported by hvd_trainer.torch.DistributedOptimizer: "
                         "the reducer lays out its own buckets; pass num_groups= instead")
    _check_passes(backward_passes_per_step)
    check_settings(gradient_predivide_factor, num_groups)
    names = _check_names(optimizer, named_parameters)
    adasum = op == Adasum
    if adasum:
        check_adasum(compression, process_set)
    cls = _distributed_class(type(optimizer), AdasumDistributed if adasum else _Distributed)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._patch_step_function()  # step hooks and profiling, as Optimizer.__init__ does
    if adasum:  # sparse_as_dense and num_groups have nothing to act on (docs/migrating/horovod-torch.md)
        wrapped._set_up(_parameter_names(optimizer, names), compression,
                        int(backward_passes_per_step), process_set)
    else:
        wrapped._set_up(names, compression, int(backward_passes_per_step), op,
                        float(gradient_predivide_factor), int(num_groups),
                        bool(sparse_as_dense), process_set)
    return wrapped


def _check_passes(passes: int) -> None:
    if int(passes) != passes or passes < 1:
        raise ValueError(f"backward_passes_per_step={passes!r} must be a positive integer")


def _check_names(optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]) -> Dict[int, str]:
    """The parameters' names by id, checked as Horovod checks them."""
    if named_parameters is None:
        return {}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, as "
                         "model.named_parameters() gives")
    seen: Dict[str, int] = {}
    for name, _ in named:
        seen[name] = seen.get(name, 0) + 1
    twice = sorted(n for n, c in seen.items() if c > 1)
    if twice:
        raise ValueError(f"named_parameters has duplicate names {twice}; give each parameter "
                         "its own name")
    names = {id(p): name for name, p in named}
    unnamed = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if unnamed:
        raise ValueError(f"named_parameters does not name {len(unnamed)} of the optimizer's "
                         "parameters (shapes "
                         f"{[tuple(p.shape) for p in unnamed]}); pass model.named_parameters() "
                         "of the model the optimizer trains")
    return names
