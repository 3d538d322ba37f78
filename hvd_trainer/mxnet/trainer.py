"""DistributedTrainer: gluon.Trainer whose gradient reduction is a ring allreduce across ranks.

**Gradient buckets.** At the first step (and again whenever a gradient is no longer ours,
e.g. after ``grad_req`` changed), the dense host gradients of the first context are laid out
in a few flat NDArrays, the *buckets*: parameters in reverse order (backward produces the
last layers' gradients first), one dtype per bucket, at most ``HVD_BUCKET_THRESHOLD`` bytes
each (``num_groups`` > 0 sets the number of buckets instead). Each gradient becomes a view
into its bucket (``autograd.mark_variables``), so backward writes straight into the bucket
and the bucket is allreduced in place: a step copies no gradient bytes on one context.

**Overlap.** ``backward()`` only queues work on MXNet's engine. The step exchanges the
freshness flags (no waiting for gradients), then hands the buckets in order to one
communication thread, the only thread doing MPI until the step's buckets are done. For each
bucket it waits for the engine's writes into that bucket alone (MXNet tracks dependencies per
storage, which is why there are several buckets) and allreduces it, while backward still
computes earlier layers; the main thread meanwhile takes each finished bucket and queues the
optimizer update of its parameters, so bucket k is updated while bucket k+1 is on the wire.
Inside ``step()`` updates go per bucket; after ``allreduce_grads()`` alone they wait for
``update()``. With ``HVD_OVERLAP=0`` (the default) the calling thread reduces the buckets
in turn and updates after all of them. Communication is CPU work too (shared-memory copies,
sums): overlap pays only where ranks have cores to spare while backward runs; on a machine
whose cores all compute it slows the step (figures in benchmarks/README.md).

Compressed gradients, row-sparse gradients and gradients on a GPU take the per-tensor path:
summed into the first context's buffer, allreduced in fused groups, copied back.
"""
import os
import pickle
import socket
import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Type, Union

import mxnet as mx
import numpy as np

from .. import diagnostics, fusion, handles, ops, runtime, sparse
from ..compression import (CommStats, Compression, Compressor, ErrorFeedbackSum,
                           GatherCompressor, attach_residuals, detach_residuals)
from ..compression import from_params as compression_from_params
from ..runtime import ProcessSet, global_process_set
from . import bridge
from . import sparse as sparse_nd
from . import sparse_weights
from .errors import raises_mxnet_errors
from .optimizer import DistributedOptimizer
from .parameters import broadcast_named


def _param_list(params: Any) -> List[mx.gluon.Parameter]:
    """Gluon's parameter order (sorted keys for a dict, given order for a list), checked."""
    if isinstance(params, (dict, mx.gluon.ParameterDict)):
        keyed = [(key, params[key]) for key in sorted(params.keys())]
    elif isinstance(params, (list, tuple)):
        keyed = list(enumerate(params))
    else:
        raise ValueError(f"params is a {type(params).__name__}; pass net.collect_params(), "
                         "a dict of name -> Parameter or a list of Parameters")
    for key, param in keyed:
        if not isinstance(param, mx.gluon.Parameter):
            raise ValueError(f"params[{key!r}] is a {type(param).__name__}, not a gluon "
                             "Parameter; pass net.collect_params() or Parameters only")
        if param._stype != "default":
            sparse_weights.check(param)
    return [param for _, param in keyed]


def _compressor(compression: Union[Type[Compressor], GatherCompressor],
                compression_params: Optional[Dict[str, Any]]
                ) -> Union[Type[Compressor], GatherCompressor]:
    """Map MXNet's ``compression_params`` onto a compressor; ``compression`` when it is None."""
    if compression_params is None:
        return compression
    if compression is not Compression.none:
        raise ValueError("pass either compression= or compression_params=, not both")
    return compression_from_params(compression_params)


_CHECKPOINT_FORMAT = "hvd_trainer checkpoint 1"


def _compression_key(compression: Union[Type[Compressor], GatherCompressor]) -> str:
    """The compressor and its settings as text that is the same on every rank."""
    if isinstance(compression, type):
        return compression.__name__
    settings = sorted((key, str(value)) for key, value in vars(compression).items())
    return f"{type(compression).__name__}{settings}"


class _Bucket:
    """One flat gradient NDArray and where each parameter's gradient lies in it."""

    def __init__(self, number: int, members: List[int], bounds: List[int],
                 flat: mx.nd.NDArray, views: List[mx.nd.NDArray]):
        self.number = number
        self.members = members        # parameter indices, in bucket order
        self.bounds = bounds          # element offsets: member k is flat[bounds[k]:bounds[k+1]]
        self.flat = flat
        self.views = views            # the gradient NDArrays installed in the parameters
        self.host: Optional[np.ndarray] = None  # NumPy view of flat, taken once it is written


def _split(items: Sequence[Any], groups: int) -> List[Sequence[Any]]:
    """Split into ``groups`` contiguous, nearly equal, non-empty runs (one run for 0)."""
    if groups <= 0 or groups >= len(items):
        return [items] if groups <= 0 else [[x] for x in items]
    base, extra = divmod(len(items), groups)
    runs, start = [], 0
    for g in range(groups):
        end = start + base + (1 if g < extra else 0)
        runs.append(items[start:end])
        start = end
    return runs


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` for data-parallel training: gradients are summed across ranks.

    Takes ``gluon.Trainer``'s arguments unchanged, plus Horovod's keywords. Decisions:

    - It calls :func:`hvd_trainer.init` and broadcasts the ``root_rank``'s weights at
      construction (by default the process set's first rank: rank 0 of the job); a parameter
      with deferred initialisation is broadcast when the first forward pass initialises it,
      so the first gradients already use the root's weights.
    - Gradients are summed; ``gradient_predivide_factor / size`` is folded into
      ``rescale_grad`` and ``1 / gradient_predivide_factor`` scales gradients before the sum (as
      Horovod), so N ranks calling ``step(B)`` match one process calling ``step(N * B)``.
      With one rank nothing is reduced and the factor has no effect.
    - Updates always happen locally (``update_on_kvstore=True`` is refused). ``kvstore`` is
      ignored with one warning; ``compression_params={'type': 'fp16'}`` means
      ``compression=Compression.fp16``.
    - ``compression_params`` of type 2bit, 1bit, topk or scaled_2bit (or a
      ``compression.GatherCompressor`` as ``compression``) send float32 gradients of at least
      ``min_size`` elements packed, by allgather, and every rank decodes and sums them in rank
      order; the residuals of error feedback are per rank and go into ``save_checkpoint``.
      ``communication_stats`` holds the last step's traffic and codec time.
    - Tensor names are ``prefix`` + the parameter's index in Gluon's order (sorted keys of a
      dict), so two trainers in one process need different prefixes.
    - Several contexts per process: fresh gradients are summed locally into the first
      context's buffer, allreduced once, and copied back to every context.
    - Stale gradients: ranks exchange which gradients are fresh. One fresh on some rank is
      reduced everywhere, stale ranks contributing zeros, and then counts as fresh on every
      rank and context, so all ranks apply the same update: its gradient is the fresh ranks'
      sum over the global batch. One fresh nowhere is left untouched, so Gluon's
      ``ignore_stale_grad`` decides on every rank alike.
    - ``save_states`` and ``load_states`` are local, as in Gluon and Horovod: whoever calls
      them writes or reads its own path (atomically), so calling them on rank 0 alone or on
      every rank both work. ``save_checkpoint`` and ``load_checkpoint`` are collectives over
      the process set and hold everything an exact resume needs: weights, optimizer states,
      every rank's compression residuals and the caller's ``extra``.
    - ``process_set``: the trainer reduces over that set's ranks and broadcasts from
      ``root_rank``, a global rank (as in Horovod). On a rank outside the set it is a plain
      ``gluon.Trainer`` (no collectives; gradients summed over this process's contexts only).
    - Errors of misused collectives (ranks that disagree, a rank outside a set) are
      ``MXNetError`` as well as the core's ``ValueError``/``MismatchError`` (see errors.py).
    - Collectives: construction (the weight broadcast), ``step``, ``allreduce_grads``,
      ``save_checkpoint`` and ``load_checkpoint`` are called by every rank of the process
      set; ``update``, ``save_states``, ``load_states`` and ``set_learning_rate`` are local.
    - Each step makes one agreement exchange that checks every rank has the same gradients
      (names, shapes, dtypes) and settings and carries the freshness flags; the step's
      collectives then skip their own (see :mod:`hvd_trainer.diagnostics`).
    - A ``DistributedOptimizer`` passed as ``optimizer`` is unwrapped with a warning (as in
      Horovod), keeping its per-rank ``rescale_grad``, so gradients are not reduced twice.
    - Row-sparse gradients (``sparse_grad=True``) are allgathered as ids and rows, duplicates
      summed, and stay row_sparse (see :mod:`hvd_trainer.sparse`); they go by dense allreduce
      when the ranks together send more rows than the tensor has, or always with
      ``sparse_as_dense=True``. ``sparse_exchanges`` says how each travelled at the last step.
      Compression applies to dense gradients only. GPU gradients are staged through host memory.
    - row_sparse weights (``contrib.nn.SparseEmbedding``, ``Parameter(stype='row_sparse',
      grad_stype='row_sparse')``): every rank holds the whole weight, serves
      ``row_sparse_data`` and ``list_row_sparse_data`` from it, and applies the optimizer to
      it once per step with the gathered gradient rows, so lazy updates touch only rows some
      rank touched (see :mod:`hvd_trainer.mxnet.sparse_weights`).
    - Uncompressed dense host gradients live in flat buckets and are reduced there, with the
      optimizer update of each bucket queued while the next is reduced (see the module
      docstring; ``HVD_BUCKET_THRESHOLD`` bytes per bucket, default 16 MiB; ``HVD_OVERLAP=1``
      turns the overlap on).
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=None, *,
                 compression: Union[Type[Compressor], GatherCompressor] = Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: Optional[str] = None,
                 root_rank: Optional[int] = None, process_set: ProcessSet = global_process_set,
                 num_groups: int = 0, sparse_as_dense: bool = False):
        if update_on_kvstore:
            raise ValueError("update_on_kvstore=True is not supported: DistributedTrainer "
                             "allreduces gradients and updates on every rank; pass "
                             "update_on_kvstore=None or False")
        if kvstore not in ("device", None):
            warnings.warn(f"DistributedTrainer ignores kvstore={kvstore!r}: gradients are "
                          "summed by allreduce instead", stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"prefix={prefix!r} must be a string or None")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must "
                             "be positive")
        if int(num_groups) != num_groups or num_groups < 0:
            raise ValueError(f"num_groups={num_groups!r} must be a non-negative integer")
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer reduces gradients itself; it uses the optimizer "
                          "inside the DistributedOptimizer it was given", stacklevel=2)
            per_rank_scale = optimizer.rescale_grad
            optimizer = optimizer._optimizer
            optimizer.rescale_grad = per_rank_scale
        param_list = _param_list(params)
        self._compression = _compressor(compression, compression_params)
        self._feedback = (ErrorFeedbackSum(self._compression)
                          if isinstance(self._compression, GatherCompressor) else None)
        self.communication_stats = CommStats()
        runtime.init()
        self._process_set = process_set
        # Outside its process set the trainer is a plain gluon.Trainer, as in Horovod.
        self._member = process_set.included()
        self._size = process_set.size() if self._member else 1
        super().__init__(param_list, optimizer, optimizer_params=optimizer_params,
                         kvstore=None, update_on_kvstore=False)
        self._prefix = prefix or ""
        self._predivide = float(gradient_predivide_factor)
        # One rank reduces nothing, so there is no predivision to undo.
        self._scale *= (self._predivide if self._size > 1 else 1.0) / self._size
        self._num_groups = int(num_groups)
        self._fresh = np.zeros(len(self._params), np.int8)
        self._step_key, self._step = None, None  # see _step_description
        self._sparse_grads = {i for i, p in enumerate(self._params) if p._grad_stype != "default"}
        self._sparse_as_dense = bool(sparse_as_dense)
        self.sparse_exchanges: Dict[str, sparse.Exchange] = {}
        # Rank 0's settings, so that every rank lays out the same buckets.
        self._overlap = runtime.setting("OVERLAP") != 0
        self._bucket_threshold = runtime.setting("BUCKET_THRESHOLD")
        self._buckets: List[_Bucket] = []
        self._layout_key: Optional[tuple] = None  # the reduced indices the buckets were laid out for
        self._step_ignore: Optional[bool] = None  # step()'s ignore_stale_grad while it runs
        self._updated: Set[int] = set()      # parameters already updated in this step
        if root_rank is None:
            root_rank = process_set.ranks[0]  # the set's first rank, as a global rank
        # row_sparse weights: the trainer holds them whole (sparse_weights.py).
        self._sparse_weights = sparse_weights.SparseWeights(self._params, self._prefix,
                                                            root_rank, process_set, self._size)
        if self._size > 1:
            raises_mxnet_errors(broadcast_named)(
                [(f"{self._prefix}param.{i}", p) for i, p in enumerate(self._params)
                 if i not in self._sparse_weights], root_rank, process_set)

    def _init_kvstore(self):
        # There is no KVStore: gradients go by allreduce, row_sparse weights live in
        # self._sparse_weights (gluon.Trainer's version insists on a KVStore for them).
        self._kvstore, self._update_on_kvstore, self._distributed = None, None, False
        self._kv_initialized = True

    def _row_sparse_pull(self, parameter, out, row_id, full_idx=False):
        # Parameter.row_sparse_data / list_row_sparse_data / _reduce ask the trainer for rows.
        self._sparse_weights.pull(parameter, out, row_id, full_idx)

    def step(self, batch_size, ignore_stale_grad=False):
        # Lets _allreduce_grads update bucket by bucket; _update then does the rest.
        self._step_ignore = ignore_stale_grad
        try:
            super().step(batch_size, ignore_stale_grad)
        finally:
            self._step_ignore = None

    @raises_mxnet_errors
    def _allreduce_grads(self):
        if self._size == 1 and len(self._contexts) == 1:
            return
        if not self._member:
            self._sum_contexts_locally()
            return
        self._updated = set()
        indices = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
        buckets = self._bucket_layout(indices)
        in_bucket = {i for b in buckets for i in b.members}
        buffers, fresh_contexts = {}, {}
        for i in indices:
            if i in in_bucket:  # its gradient is waited for later, bucket by bucket
                fresh_contexts[i] = [k for k, d in enumerate(self._params[i].list_data())
                                     if d._fresh_grad]
                self._fresh[i] = bool(fresh_contexts[i])
                continue
            local_sum = sparse_nd.local_rows if i in self._sparse_grads else self._local_sum
            with diagnostics.span(f"{self._prefix}grad.{i}", "WAIT_FOR_GRADIENT"):
                buffers[i] = local_sum(self._params[i])
            self._fresh[i] = buffers[i] is not None
        comm = runtime.communicator(self._process_set)
        stats = self.communication_stats = CommStats()
        # The block holds the communicator's turn, so no other thread's collective comes
        # between the step's agreement and the collectives it covers.
        with diagnostics.covered(comm) as cover:
            # The step's one agreement exchange: it checks that every rank has the same
            # gradients and settings, ors the freshness flags, and so covers what follows.
            with diagnostics.span(f"{self._prefix}step", "NEGOTIATE"):
                self._fresh[indices] = diagnostics.agree(
                    comm, lambda: self._step_description(indices), self._fresh[indices])
            self._reduce_buckets(buckets, fresh_contexts, stats, bool(self._fresh[indices].all()),
                                 cover)
            self._reduce_sparse([i for i in indices if self._fresh[i] and i in self._sparse_grads],
                                buffers)
            reduced = [i for i in indices if self._fresh[i] and i not in self._sparse_grads
                       and i not in in_bucket]
            for i in reduced:
                if buffers[i] is None:
                    buffers[i] = self._zeroed_first(self._params[i])
            if self._size > 1 and reduced:
                self._allreduce(reduced, buffers, stats)
        for i in reduced:
            self._publish(self._params[i], buffers[i])

    def _sum_contexts_locally(self) -> None:
        """Outside the process set: sum each gradient over this process's contexts only."""
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            if i in self._sparse_grads:
                rows = sparse_nd.local_rows(param)
                if rows is not None:
                    sparse_nd.publish_rows(param, *rows)
            else:
                buf = self._local_sum(param)
                if buf is not None:
                    self._publish(param, buf)

    def _bucket_layout(self, indices: List[int]) -> List[_Bucket]:
        """The buckets for this step's gradients, laid out anew when the reduced parameters
        changed or a gradient is no longer the view we installed."""
        if self._compression is not Compression.none:
            return []  # compressors work per tensor (see the module docstring)
        key = tuple(indices)
        if key == self._layout_key and all(self._params[i]._grad[0] is view for b in self._buckets
                                           for i, view in zip(b.members, b.views)):
            return self._buckets
        eligible = [i for i in indices if i not in self._sparse_grads and self._params[i].shape
                    and np.prod(self._params[i].shape) > 0
                    and bridge.is_host(self._params[i].list_grad()[0])]
        self._buckets, self._layout_key = self._lay_out(eligible), key
        return self._buckets

    def _lay_out(self, eligible: List[int]) -> List[_Bucket]:
        """Move the gradients of ``eligible`` into new buckets; install views as gradients.

        The current gradient values are copied in, so a step may lay out after backward.
        """
        grads = [self._params[i].list_grad()[0] for i in eligible]
        plan = fusion.plan_gradient_buckets(
            [g.size * np.dtype(g.dtype).itemsize for g in grads], [np.dtype(g.dtype) for g in grads],
            self._bucket_threshold, self._num_groups)
        buckets = []
        for number, positions in enumerate(plan):
            bounds = [0]
            for k in positions:
                bounds.append(bounds[-1] + grads[k].size)
            first = grads[positions[0]]
            flat = mx.nd.zeros(bounds[-1], ctx=first.context, dtype=first.dtype)
            views = []
            for k, start, end in zip(positions, bounds, bounds[1:]):
                param, view = self._params[eligible[k]], flat[start:end].reshape(grads[k].shape)
                if isinstance(grads[k], mx.np.ndarray):  # numpy-mode Gluon: keep the grad's type
                    view = view.as_np_ndarray()  # the same memory
                grads[k].copyto(view)
                param._grad[0] = view
                # Marking resets the freshness flags that backward set; keep them.
                fresh = [d._fresh_grad for d in param.list_data()]
                mx.autograd.mark_variables(param.list_data(), param._grad, param.grad_req)
                for d, flag in zip(param.list_data(), fresh):
                    d._fresh_grad = flag
                views.append(view)
            buckets.append(_Bucket(number, [eligible[k] for k in positions], bounds, flat, views))
        return buckets

    def _reduce_buckets(self, buckets: List[_Bucket], fresh_contexts: Dict[int, List[int]],
                        stats: CommStats, all_fresh: bool, cover: diagnostics.Cover) -> None:
        """Reduce every bucket; with overlap, on the communication thread, updating as they come.

        Per-bucket updates happen inside ``step()`` only, without an AMP loss scaler (it
        inspects all gradients first), and not when ``step()`` is about to raise for a stale
        gradient (Gluon raises before updating anything).
        """
        # A plain bucket (one context, every member fresh here) is reduced whole, as it is.
        plain = [len(self._contexts) == 1 and all(fresh_contexts[i] for i in b.members)
                 for b in buckets]
        if not self._overlap or self._size == 1 or not runtime.mpi_threads_supported():
            for bucket, whole in zip(buckets, plain):
                self._reduce_bucket(bucket, fresh_contexts, whole)
                self._finish_bucket(bucket, stats, whole)
            return
        update = (self._step_ignore is not None and (self._step_ignore or all_fresh)
                  and getattr(self, "_amp_loss_scaler", None) is None)
        thread = handles.communication_thread()
        reduce = cover.share(self._reduce_bucket)  # the thread runs inside the step's turn
        pending: List[Future] = [thread.submit(reduce, b, fresh_contexts, whole)
                                 for b, whole in zip(buckets, plain)]
        try:
            for bucket, whole, future in zip(buckets, plain, pending):
                future.result()
                self._finish_bucket(bucket, stats, whole)
                if update:
                    members = [i for i in bucket.members if self._fresh[i]]
                    with diagnostics.span(f"{self._prefix}bucket.{bucket.number}", "UPDATE"):
                        self._apply_updates(members, self._step_ignore)
                    self._updated.update(members)
        finally:
            for future in pending:  # on an error, let the thread finish before leaving
                if not future.cancel():
                    future.exception()

    def _reduce_bucket(self, bucket: _Bucket, fresh_contexts: Dict[int, List[int]],
                       whole: bool) -> None:
        """Wait for backward's writes into ``bucket``, sum the contexts, allreduce in place.

        Unless the bucket is ``whole``, only the members fresh on some rank are reduced (in
        contiguous runs, normally one); the others stay as they are, as Gluon leaves a stale
        gradient.
        """
        name = f"{self._prefix}bucket.{bucket.number}"
        with diagnostics.span(name, "WAIT_FOR_GRADIENT"):
            host = bucket.host = bridge.write_view(bucket.flat)
        runs: List[List[int]] = [[0, host.size]] if whole else []
        for i, start, end in zip(bucket.members, bucket.bounds, bucket.bounds[1:]):
            if whole or not self._fresh[i]:
                continue
            self._sum_contexts(self._params[i], host[start:end], fresh_contexts[i])
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        if self._size > 1 and runs:
            ops.grouped_allreduce_([host[a:b] for a, b in runs], ops.Sum, name,
                                   prescale_factor=1.0 / self._predivide,
                                   process_set=self._process_set)

    @staticmethod
    def _sum_contexts(param: mx.gluon.Parameter, first: np.ndarray, fresh: List[int]) -> None:
        """Make ``first`` (the first context's gradient, flat) this process's fresh sum."""
        if 0 not in fresh:
            first[...] = 0  # stale here: contribute zeros, plus any other fresh context
        grads = param.list_grad()
        for k in fresh:
            if k > 0:
                first += bridge.read_view(grads[k]).reshape(-1)

    def _finish_bucket(self, bucket: _Bucket, stats: CommStats, whole: bool) -> None:
        """Copy the reduced members to the other contexts, mark them fresh, count the bytes."""
        nbytes = 0
        for i, start, end in zip(bucket.members, bucket.bounds, bucket.bounds[1:]):
            if whole:  # one context, already fresh
                nbytes = bucket.host.nbytes
                break
            if not self._fresh[i]:
                continue
            param = self._params[i]
            self._publish(param, bucket.host[start:end].reshape(param.shape))
            nbytes += (end - start) * bucket.host.itemsize
        if self._size > 1:
            stats.add_allreduce(nbytes, nbytes, self._size)

    def _step_description(self, indices: List[int]) -> Dict[str, Any]:
        """Everything that fixes a step's collectives, for the ranks' agreement on it.

        The same object while no gradient's presence, shape, dtype, storage or device changes,
        so the agreement reuses its digest.
        """
        key = (tuple(indices),
               tuple((p._shape, p.dtype, p._grad_stype, p.list_ctx()[0].device_type)
                     for p in self._params))
        if key != self._step_key:
            self._step_key, self._step = key, self._describe_step(indices)
        return self._step

    def _describe_step(self, indices: List[int]) -> Dict[str, Any]:
        """The step description itself (see :meth:`_step_description`)."""
        return {"kind": "trainer step", "name": f"{self._prefix}step",
                "compression": _compression_key(self._compression),
                "num_groups": self._num_groups, "gradient_predivide_factor": self._predivide,
                "sparse_as_dense": self._sparse_as_dense,
                "tensors": [{"name": f"{self._prefix}grad.{i}", "shape": self._params[i].shape,
                             "dtype": np.dtype(self._params[i].dtype).str,
                             "stype": self._params[i]._grad_stype,
                             # host and GPU gradients travel different ways
                             "memory": "host" if bridge.is_host(self._params[i].list_grad()[0])
                             else "gpu"} for i in indices]}

    def _update(self, ignore_stale_grad=False):
        with diagnostics.span(f"{self._prefix}step", "UPDATE"):
            if self._updated:  # step() updated some buckets already
                rest = [i for i in range(len(self._params)) if i not in self._updated]
                self._updated = set()
                self._apply_updates(rest, ignore_stale_grad)
            elif self._sparse_weights:  # gluon.Trainer._update cannot update row_sparse weights
                scaler = getattr(self, "_amp_loss_scaler", None)
                if scaler is None or not scaler.has_overflow(self._params):
                    self._apply_updates(list(range(len(self._params))), ignore_stale_grad)
            else:
                super()._update(ignore_stale_grad)

    def _apply_updates(self, indices: List[int], ignore_stale_grad: bool) -> None:
        """``gluon.Trainer._update`` (local updates, no loss scaler) for ``indices`` only."""
        updates = [[] for _ in self._updaters]
        for i in indices:
            param = self._params[i]
            if param.grad_req == "null":
                continue
            if not ignore_stale_grad:
                for data in sparse_weights.weight_arrays(param):
                    if not data._fresh_grad:
                        raise UserWarning(
                            f"Gradient of Parameter `{param.name}` on context {data.context} has "
                            "not been updated by backward since last `step`. This could mean a "
                            "bug in your model that made it only use a subset of the Parameters "
                            "(Blocks) for this iteration. If you are intentionally only using a "
                            "subset, call step with ignore_stale_grad=True to suppress this "
                            "warning and skip updating of Parameters with stale gradient")
            if i in self._sparse_weights:  # one update of the whole weight
                self._sparse_weights.update(self._updaters[0], i, ignore_stale_grad)
                continue
            for upd, arr, grad in zip(updates, param.list_data(), param.list_grad()):
                if not ignore_stale_grad or arr._fresh_grad:
                    upd.append((i, grad, arr))
                    arr._fresh_grad = False
        for updater, upd in zip(self._updaters, updates):
            if upd:
                i, g, w = zip(*upd)
                updater(i, g, w)

    def _reduce_sparse(self, indices: List[int], local: Dict[int, Any]) -> None:
        """Reduce row-sparse gradients (a stale rank sends no rows) and write them back."""
        prescale = 1.0 / self._predivide if self._size > 1 else 1.0
        for i in indices:
            param = self._params[i]
            ids, rows = local[i] if local[i] is not None else sparse_nd.no_rows(param)
            ids, rows, exchange = sparse.allreduce_rows(
                ids, rows, param.shape[0], f"{self._prefix}grad.{i}",
                prescale_factor=prescale, force_dense=self._sparse_as_dense,
                process_set=self._process_set)
            self.sparse_exchanges[param.name] = exchange
            sparse_nd.publish_rows(param, ids, rows)

    def _local_sum(self, param: mx.gluon.Parameter) -> Optional[np.ndarray]:
        """Sum this process's fresh gradients into the first context's (host) buffer.

        Returns None when no context has a fresh gradient.
        """
        fresh = [k for k, d in enumerate(param.list_data()) if d._fresh_grad]
        if not fresh:
            return None
        buf = self._first_buffer(param.list_grad()[0])
        self._sum_contexts(param, buf.reshape(-1), fresh)
        return buf

    def _zeroed_first(self, param: mx.gluon.Parameter) -> np.ndarray:
        """A stale rank's contribution: zeros in the first context's gradient buffer."""
        buf = self._first_buffer(param.list_grad()[0])
        buf[...] = 0
        return buf

    @staticmethod
    def _first_buffer(grad: mx.nd.NDArray) -> np.ndarray:
        """The gradient itself on the host; a host copy for a GPU gradient."""
        return bridge.write_view(grad) if bridge.is_host(grad) else grad.asnumpy()

    def _allreduce(self, reduced: List[int], buffers: Dict[int, np.ndarray],
                   stats: CommStats) -> None:
        """Sum the buffers across ranks in place, in ``num_groups`` grouped calls.

        Tensors a GatherCompressor accepts go by one allgather per group (with error feedback,
        see ``compression.ErrorFeedbackSum``), the others by allreduce; the traffic lands in
        ``stats``.
        """
        feedback = self._feedback
        compressor = self._compression if feedback is None else Compression.none
        for group in _split(reduced, self._num_groups):
            name = f"{self._prefix}grad.{group[0]}:{group[-1]}"
            packed = [i for i in group if feedback and feedback.compressor.accepts(buffers[i])]
            if packed:
                feedback.sum_([(i, buffers[i]) for i in packed], f"{name}.packed",
                              1.0 / self._predivide, self._process_set, stats)
            dense = [i for i in group if i not in packed]
            if not dense:
                continue
            tic = time.perf_counter()
            with diagnostics.span(name, "COMPRESS"):
                payloads, ctxs = zip(*(compressor.compress(buffers[i]) for i in dense))
            stats.encode_seconds += time.perf_counter() - tic
            ops.grouped_allreduce_(list(payloads), ops.Sum, name,
                                   prescale_factor=1.0 / self._predivide,
                                   process_set=self._process_set)
            stats.add_allreduce(sum(p.nbytes for p in payloads),
                                sum(buffers[i].nbytes for i in dense), self._size)
            tic = time.perf_counter()
            with diagnostics.span(name, "DECODE"):
                for i, payload, ctx in zip(dense, payloads, ctxs):
                    if payload is not buffers[i]:
                        buffers[i][...] = compressor.decompress(payload, ctx)
            stats.decode_seconds += time.perf_counter() - tic

    @staticmethod
    def _publish(param: mx.gluon.Parameter, buf: np.ndarray) -> None:
        """Write the reduced gradient to every context and mark it fresh there."""
        grads = param.list_grad()
        for k, g in enumerate(grads):
            if k > 0 or not bridge.is_host(g):
                bridge.assign(g, buf)
        for d in param.list_data():
            d._fresh_grad = True

    def save_states(self, fname: str) -> None:
        """Write this process's optimizer states to ``fname``, as ``gluon.Trainer`` does.

        Not a collective: call it on one rank (``if hvd.rank() == 0:``, Horovod's habit) or on
        every rank with a path of its own (Gluon's ``CheckpointHandler``). The file is written
        under a temporary name and renamed into place, so ``fname`` is always whole, and a
        plain ``gluon.Trainer`` can read it. It holds no compression residuals; for an exact
        resume across ranks use the collective :meth:`save_checkpoint`.
        """
        _replace_atomically(fname, super().save_states)

    def load_states(self, fname: str) -> None:
        """Read optimizer states from ``fname`` into this process's trainer, as Gluon does.

        Not a collective: each caller reads its own path. Every rank loading the same states
        keeps the ranks' updates identical; compression residuals are left as they are.
        """
        super().load_states(fname)

    def save_checkpoint(self, fname: str, extra: Any = None) -> None:
        """Save everything a resumed run needs, in one file. A collective: every rank of the
        trainer's process set calls it.

        The set's first rank writes the weights, the optimizer states (with the optimizer
        itself, its update counts and lr scheduler), every rank's compression residuals, and
        ``extra`` (any picklable value, e.g. the epoch and step), through a temporary file and
        ``os.replace``, so the file is always whole: the old one or the new one. Every rank
        returns once it is written; a write error raises OSError on all. On a rank outside
        the process set it is local: that rank writes its own file.
        """
        self._check_initialized("save_checkpoint")
        residuals = self._gather_residuals()

        def build() -> bytes:
            weights = [self._sparse_weights.value(i) if i in self._sparse_weights
                       else bridge.read_view(p.list_data()[0]).copy()
                       for i, p in enumerate(self._params)]
            return pickle.dumps({"format": _CHECKPOINT_FORMAT, "weights": weights,
                                 "states": self._states_bytes(residuals), "extra": extra},
                                pickle.HIGHEST_PROTOCOL)

        self._write_on_root(fname, build, "save_checkpoint")

    def load_checkpoint(self, fname: str) -> Any:
        """Restore what :meth:`save_checkpoint` wrote and return its ``extra``. A collective:
        every rank of the trainer's process set calls it.

        The set's first rank reads the file and sends it to the others, so no shared file
        system is needed. After it a run continues exactly as the one that saved it: on CPU
        the weights of a resumed run equal those of an uninterrupted one, bit for bit. On a
        rank outside the process set it is local: that rank reads its own file.
        """
        self._check_initialized("load_checkpoint")
        checkpoint = pickle.loads(self._read_on_root(fname, "load_checkpoint"))
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(f"{fname!r} is not a DistributedTrainer checkpoint; write one "
                             "with trainer.save_checkpoint()")
        weights = checkpoint["weights"]
        if len(weights) != len(self._params):
            raise ValueError(f"{fname!r} holds {len(weights)} parameters, this trainer has "
                             f"{len(self._params)}; load it into the model that saved it")
        for i, (param, values) in enumerate(zip(self._params, weights)):
            if tuple(param.shape) != values.shape:
                raise ValueError(f"parameter {i} ({param.name!r}) has shape {param.shape}, the "
                                 f"checkpoint's has {values.shape}; load it into the model "
                                 "that saved it")
            if i in self._sparse_weights:
                self._sparse_weights.assign(i, values)
                continue
            for array in param.list_data():
                bridge.assign(array, values.astype(array.dtype, copy=False))
        self._set_states(checkpoint["states"])
        return checkpoint["extra"]

    def _check_initialized(self, what: str) -> None:
        waiting = [p.name for p in self._params if p._data is None]
        if waiting:
            raise ValueError(f"{what}: parameters {waiting} are not initialized yet (deferred "
                             "shapes); run one forward pass first")

    def _gather_residuals(self) -> Optional[List[Dict[Any, np.ndarray]]]:
        """Every member's error-feedback residuals (a collective over the process set); this
        process's alone outside the set; None without error feedback."""
        if self._feedback is None:
            return None
        if not self._member:
            return [self._feedback.residuals]
        return raises_mxnet_errors(ops.allgather_object)(
            self._feedback.residuals, f"{self._prefix}residuals", self._process_set)

    def _states_bytes(self, residuals: Optional[List[Dict[Any, np.ndarray]]]) -> bytes:
        """The optimizer states (with the optimizer), ``residuals`` attached."""
        return attach_residuals(self._updaters[0].get_states(dump_optimizer=True), residuals)

    def _set_states(self, data: bytes) -> None:
        """Load what :meth:`_states_bytes` made into every updater and the residuals."""
        states, residuals = detach_residuals(data)
        if self._feedback is not None:
            self._feedback.load(residuals, self._process_set.rank() if self._member else 0,
                                self._size)
        for updater in self._updaters:
            updater.set_states(states)
            updater.optimizer = self._updaters[0].optimizer
        self._optimizer = self._updaters[0].optimizer
        self._optimizer.param_dict = {i: param for i, param in enumerate(self._params)}

    def _writes(self) -> bool:
        """Whether this process touches the file of a checkpoint: the set's first rank, or a
        rank outside the set (for which checkpoints are local)."""
        return not self._member or self._process_set.rank() == 0

    def _write_on_root(self, fname: str, build: Callable[[], bytes], what: str) -> None:
        """The set's first rank writes ``build()`` atomically to ``fname``; every member returns
        after that, or raises OSError naming the file and the rank if it failed.

        The outcome travels by allgather, which does not depend on how a root is numbered.
        """
        error = None
        if self._writes():
            try:
                _replace_atomically(fname, lambda tmp: _write_bytes(tmp, build()))
            except OSError as e:
                error = f"rank {runtime.rank()} could not write {fname!r}: {e}"
        if self._member:
            outcomes = raises_mxnet_errors(ops.allgather_object)(
                error, f"{self._prefix}{what}", self._process_set)
            error = next((e for e in outcomes if e), None)
        if error:
            raise OSError(error)

    def _read_on_root(self, fname: str, what: str) -> bytes:
        """The set's first rank reads ``fname`` and every member gets its bytes; OSError on
        all members if it failed."""
        data, error = None, None
        if self._writes():
            try:
                with open(fname, "rb") as f:
                    data = f.read()
            except OSError as e:
                error = f"rank {runtime.rank()} could not read {fname!r}: {e}"
        if self._member:
            data, error = raises_mxnet_errors(ops.allgather_object)(
                (data, error) if self._writes() else None, f"{self._prefix}{what}",
                self._process_set)[0]
        if error:
            raise OSError(error)
        return data


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _replace_atomically(fname: str, write: Callable[[str], None]) -> None:
    """Let ``write`` fill a temporary file next to ``fname``, sync it and rename it to ``fname``,
    so that ``fname`` is always a whole file, the old one or the new one. Concurrent writers
    (ranks saving to one shared path) each use their own temporary file."""
    tmp = f"{fname}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, fname)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
