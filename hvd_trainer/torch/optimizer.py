"""DistributedOptimizer: horovod.torch's optimizer wrapper, over the core's gradient reducer.

The wrapper is a subclass of the wrapped optimizer's class that shares its state; its
gradients are reduced during backward and by ``synchronize()`` (see :mod:`.gradients`),
and ``step()`` synchronizes first unless inside ``skip_synchronize()``, as in Horovod.
``op=Adasum`` combines the ranks' updates instead (:mod:`.adasum_optimizer`).
"""
import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..collectives.arguments import Average, Sum
from ..training.hooks import Hook
from ..training.reducer import Reducer
from ..training.buckets import check_settings
from ..runtime.runtime import ProcessSet, global_process_set
from ..collectives.sparse import Exchange
from .adasum_optimizer import AdasumDistributed, check_adasum
from .compression import Compression
from .gradients import ReducedGradients
from .ops import Adasum


class _Distributed(ReducedGradients):
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
        self._held: List[int] = []  # ready, held back while backward has collectives to make
        self._reducer: Optional[Reducer] = None
        if process_set.included():  # outside it: a plain local optimizer, as in Horovod
            self._set_up_reduction(compression, op, gradient_predivide_factor, num_groups,
                                   sparse_as_dense, process_set)

    @property
    def sparse_exchanges(self) -> Dict[str, Exchange]:
        """How each sparse gradient travelled in the last step, by parameter name:
        ``Exchange(dense, gathered_rows, bytes)`` (see :mod:`hvd_trainer.collectives.sparse`)."""
        if self._reducer is None:
            return {}
        return {self._names[k]: e for k, e in self._reducer.sparse_exchanges.items()}

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket)`` instead of the built-in
        sum (PyTorch DDP's ``register_comm_hook``; Horovod has none): see
        :mod:`hvd_trainer.training.hooks`. The hook gets NumPy (CuPy for CUDA parameters)
        views of the buckets and returns a future of their sum over the ranks; ``step()``
        still averages. Call it once, before the first backward pass, on every rank of the
        process set, on an optimizer made with ``compression=Compression.none``."""
        if self._reducer is not None:
            self._reducer.register_comm_hook(state, hook)

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
