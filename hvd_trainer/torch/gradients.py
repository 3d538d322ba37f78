"""The gradient side of horovod.torch's DistributedOptimizer: tensors bridged to the core's step.

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
(:func:`hvd_trainer.collectives.sparse.allreduce_rows`, dense fallback included) unless
``sparse_as_dense``; which gradients are sparse shows only in backward, so the ranks agree on
it after the first steps (see :mod:`hvd_trainer.training.kinds`).

The step itself (readiness, early close, the kinds' agreement, each bucket through the comm
hook) is the core reducer's (:mod:`hvd_trainer.training.reducer`); this module turns tensors
into what it takes.
"""
import contextlib
import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from .. import compression as core_compression
from ..collectives.arguments import Average
from ..runtime.runtime import ProcessSet
from ..training.buckets import Bucket, Gradient
from ..training.kinds import DENSE, NONE, Kinds, table_shape
from ..training.reducer import Reducer
from . import backward_collectives, bridge
from . import sparse as torch_sparse
from .compression import KERNELS, Compression, FP16Compressor


def _core_compressor(compression: Any) -> Any:
    """The core compressor (which works on NumPy arrays) for ``compression``."""
    if compression is FP16Compressor:
        return core_compression.Compression.fp16
    return compression


class ReducedGradients:
    """The methods of DistributedOptimizer that reduce the gradients (it sets up the
    attributes they use, then calls :meth:`_set_up_reduction` on members of the set)."""

    def _postscale(self) -> float:
        """What reduced gradients are multiplied by: f/size for Average, else 1."""
        factor = self._average_factor
        return 1.0 if factor is None else factor / self._reducer.process_set.size()

    def _set_up_reduction(self, compression: Any, op: Any, gradient_predivide_factor: float,
                          num_groups: int, sparse_as_dense: bool,
                          process_set: ProcessSet) -> None:
        """The reducer, the buckets and the hooks (members of the set)."""
        self._views: Dict[int, torch.Tensor] = {}
        self._flats: List[torch.Tensor] = []
        # Gradients that backward made sparse on this rank and that are reduced densely, with
        # their sparse dimensions (see synchronize)
        self._densified: Dict[int, int] = {}
        kinds = [DENSE if sparse_as_dense else NONE] * len(self._params)
        gpu = [k for k, p in enumerate(self._params) if bridge.is_cuda(p)]
        for k in gpu:
            _check_gpu_parameter(self._params[k], self._names[k], compression)
            kinds[k] = DENSE
        # CUDA parameters: the stream their buckets are reduced on, an event per gradient
        # (its producer's stream, when marked ready) and per bucket (reduced).
        self._stream = torch.cuda.Stream(self._params[gpu[0]].device) if gpu else None
        self._produced = {k: torch.cuda.Event() for k in gpu}
        self._reduced: Dict[int, Any] = {}
        # The reducer sums with 1/f before; Average multiplies by f/size after (the size at
        # each step: a job that hvdrun --ulfm shrank averages over its survivors).
        self._average_factor = gradient_predivide_factor if op == Average else None
        self._reducer = Reducer(prefix="DistributedOptimizer.",
                                compression=_core_compressor(compression),
                                gradient_predivide_factor=gradient_predivide_factor,
                                num_groups=num_groups, sparse_as_dense=sparse_as_dense,
                                process_set=process_set, eager=True, kernels=KERNELS)
        self._reducer.attach(
            self._back_buckets, kinds=Kinds([_gradient(k, p) for k, p in enumerate(self._params)],
                                            kinds),
            rows=self._rows, fill=self._fill,
            inside=lambda: torch._C._current_graph_task_id() != -1)
        for k, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._on_gradient, k)))

    def _back_buckets(self, buckets: List[Bucket]) -> None:
        """Back each of the reducer's buckets with a flat tensor whose views become the
        gradients; values in the previous views move into the new ones."""
        previous = self._views
        self._views, self._flats = {}, []
        for bucket in buckets:
            first = self._params[bucket.keys[0]]
            flat = torch.zeros(bucket.bounds[-1], dtype=first.dtype, device=first.device)
            self._flats.append(flat)
            for k, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                view = self._views[k] = flat[start:end].view(self._params[k].shape)
                if k in previous:
                    view.copy_(previous[k])
            bucket.open = functools.partial(bridge.view, flat)
            if bridge.is_cuda(flat):
                self._reduced[bucket.number] = torch.cuda.Event()
                bucket.active = functools.partial(self._on_stream, bucket)
        self._loose = [k for k in range(len(self._params)) if k not in self._views]

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
        """Hand gradient ``k`` to the step: as (ids, rows) where agreed sparse, otherwise
        dense, in its bucket view or as a NumPy view."""
        p = self._params[k]
        grad = p.grad
        kind = self._reducer.kinds[k]
        if kind == NONE:
            is_sparse = grad.layout == torch.sparse_coo
            # kept for the rows, in case every rank's first gradient is sparse
            self._reducer.see(k, grad.sparse_dim() if is_sparse else DENSE,
                            grad if is_sparse else None)
        elif kind != DENSE:
            self._reducer.mark(k, self._rows(k, grad))
            return
        if grad.layout != torch.strided:
            if kind == DENSE:  # sparse_as_dense, or a CUDA parameter: it goes back sparse
                self._densified[k] = grad.sparse_dim()
            grad = p.grad = grad.to_dense()
        view = self._views.get(k)
        if view is not None:
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                p.grad = view
            if k in self._produced:  # on the stream current here, which wrote it
                self._produced[k].record(torch.cuda.current_stream(p.device))
            self._reducer.mark(k)
        else:
            if not grad.is_contiguous():
                grad = p.grad = grad.contiguous()
            self._reducer.mark(k, bridge.view(grad))

    def _rows(self, k: int, grad: Optional[torch.Tensor]
              ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Sparse gradient ``k`` as (ids, rows); a gradient in another form (dense, or other
        sparse dimensions) as all its rows; None for no gradient."""
        if grad is None:
            return None
        sparse_dim = self._reducer.kinds[k]
        if grad.layout == torch.sparse_coo and grad.sparse_dim() == sparse_dim:
            return torch_sparse.to_rows(grad)
        table = grad.detach().to_dense().reshape(
            table_shape(grad.shape, sparse_dim)).contiguous()
        return np.arange(table.shape[0], dtype=np.int64), bridge.view(table)

    def _fill(self, marked: List[bool]) -> None:
        """The step closes: hand over the gradients that the hooks did not (no gradient:
        zeros). The backward's collectives are over."""
        backward_collectives.forget()
        self._held = []
        if not all(marked):
            for k, p in enumerate(self._params):
                if not marked[k] and p.grad is not None:
                    self._mark(k)
        for k, event in self._produced.items():
            if not marked[k]:  # its bucket's zeros come after what the caller queued so far
                event.record(torch.cuda.current_stream(self._params[k].device))

    def synchronize(self) -> None:
        """Finish reducing every gradient; afterwards each ``.grad`` holds the average (or
        sum) over the process set. A collective: every member calls it once per step."""
        if self._reducer is None:
            return
        step, every_marked = self._reducer.close()
        try:
            results, relaid = self._reducer.finish(step, self._on_bucket)
        finally:
            self._left = [self._passes] * len(self._params)
        # A gradient the hooks marked in a bucket is already its view (see _mark).
        keys = (self._loose if every_marked and not relaid else range(len(self._params)))
        scale = self._postscale()
        for k in keys:
            p = self._params[k]
            kind = self._reducer.kinds[k]
            if kind == NONE:
                continue  # no rank has had a gradient: its kind, dense or sparse, is unknown
            if kind != DENSE:
                ids, rows = results[k]
                rows = bridge.adopt(rows)
                if scale != 1.0:
                    rows.mul_(scale)
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
            if scale != 1.0:
                p.grad.mul_(scale)
        for k, sparse_dim in self._densified.items():
            # Horovod's sparse_as_dense hands the reduced gradient back sparse, so optimizers
            # that take only sparse gradients (SparseAdam) still step; rows that sum to zero
            # are left out, as its to_sparse() leaves them.
            p = self._params[k]
            p.grad = p.grad.to_sparse(sparse_dim)
        self._synchronized = True

    def _on_bucket(self, bucket: Bucket) -> None:
        """A bucket is reduced: order the caller's stream after it, and scale it."""
        flat = self._flats[bucket.number]
        if bucket.number in self._reduced:
            torch.cuda.current_stream(flat.device).wait_event(self._reduced[bucket.number])
        scale = self._postscale()
        if scale != 1.0:
            flat.mul_(scale)


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
