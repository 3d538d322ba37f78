"""DistributedTrainer: gluon.Trainer whose gradients are summed across ranks by the core's reducer.

The reducer (:mod:`hvd_trainer.reducer`) owns the gradient machinery: buckets, the step's
agreement and freshness flags, compression, row-sparse gradients, the communication thread,
the residuals of exact resume. This module keeps what is Gluon's: the parameter list,
contexts, ``rescale_grad``, updaters and per-bucket optimizer updates, the NDArray bridge,
and the files of states and checkpoints.

**Gradient buckets.** The reducer lays out the dense host gradients of the first context in
buckets; the trainer backs each with one flat NDArray and makes every gradient a view into it
(``autograd.mark_variables``), so backward writes straight into the bucket and the bucket is
allreduced in place: a step copies no gradient bytes on one context. It lays out anew when the
reduced parameters change or a gradient is no longer the view it installed (e.g. after
``grad_req`` changed).

**Overlap.** ``backward()`` only queues work on MXNet's engine, so every gradient's freshness
is known at step time: the trainer marks the fresh ones ready all at once and the reducer
makes the step's one agreement. With ``HVD_OVERLAP=1`` the reducer then reduces the buckets in
order on the communication thread, each once the engine's writes into it have finished
(MXNet tracks dependencies per storage, which is why there are several buckets), while
backward still computes earlier layers; the trainer takes each finished bucket and queues the
optimizer update of its parameters, so bucket k is updated while bucket k+1 is on the wire.
Inside ``step()`` updates go per bucket; after ``allreduce_grads()`` alone they wait for
``update()``. With ``HVD_OVERLAP=0`` (the default) the calling thread reduces the buckets in
turn and updates after all of them. Communication is CPU work too (shared-memory copies,
sums): overlap pays only where ranks have cores to spare while backward runs; on a machine
whose cores all compute it slows the step (figures in benchmarks/README.md).

Compressed gradients, row-sparse gradients and gradients on a GPU take the reducer's
per-tensor path: summed into the first context's buffer, reduced, copied back.
"""
import functools
import pickle
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

import mxnet as mx
import numpy as np

from .. import checkpoint as checkpoint_format
from .. import files, ops, runtime, timeline
from ..checkpoint import attach_residuals, detach_residuals
from ..compression import Compression, Compressor, GatherCompressor
from ..compression import from_params as compression_from_params
from ..reducer import Bucket, Gradient, Reducer, Step, check_settings
from ..runtime import ProcessSet, global_process_set
from ..sparse import Exchange
from ..traffic import CommStats
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


def _is_compression(value: Any) -> bool:
    """Whether ``value`` is a compression (``Compression.none``/``fp16``, a Compressor class
    of one's own, or a ``GatherCompressor``) rather than a kvstore."""
    return isinstance(value, GatherCompressor) or (isinstance(value, type)
                                                  and issubclass(value, Compressor))


_CHECKPOINT_FORMAT = "hvd_trainer checkpoint 1"  # the payload's own mark, inside the file format

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
    - Both positional orders work. The 4th argument is gluon.Trainer's ``kvstore`` when it
      is a str, a KVStore or None, and horovod.mxnet's ``compression`` when it is a
      compression (``Compression.none``, ``Compression.fp16``, a Compressor subclass or a
      ``GatherCompressor``); anything else is a TypeError. After a compression, a number as
      5th argument is Horovod's ``gradient_predivide_factor`` and a str as 6th its
      ``prefix``; ``num_groups`` and ``process_set`` are keywords here.
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
      collectives then skip their own (see :mod:`hvd_trainer.agreement`).
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
      rank touched (see :mod:`hvd_trainer.mxnet.sparse_weights`). One with a dense gradient
      (``grad_stype='default'``) is held and served the same way; its gradient is allreduced
      like any dense one and the whole weight updated with it, as a KVStore would.
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
        if _is_compression(kvstore):  # horovod.mxnet's positional order
            if compression is not Compression.none:
                raise TypeError("DistributedTrainer got compression twice: as its 4th argument "
                                "(horovod.mxnet's order) and as compression=")
            compression, kvstore = kvstore, "device"
            if isinstance(compression_params, (int, float)) and not isinstance(compression_params,
                                                                               bool):
                if gradient_predivide_factor != 1.0:
                    raise TypeError("DistributedTrainer got gradient_predivide_factor twice: as "
                                    "its 5th argument (horovod.mxnet's order) and as a keyword")
                gradient_predivide_factor, compression_params = float(compression_params), None
            if isinstance(update_on_kvstore, str):
                if prefix is not None:
                    raise TypeError("DistributedTrainer got prefix twice: as its 6th argument "
                                    "(horovod.mxnet's order) and as prefix=")
                prefix, update_on_kvstore = update_on_kvstore, None
        elif not (kvstore is None or isinstance(kvstore, (str, mx.kvstore.KVStoreBase))):
            raise TypeError(f"DistributedTrainer's 4th argument is {kvstore!r}: give gluon."
                            "Trainer's kvstore (a str or KVStore) or horovod.mxnet's compression "
                            "(Compression.none, Compression.fp16 or a GatherCompressor)")
        if update_on_kvstore:
            raise ValueError("update_on_kvstore=True is not supported: DistributedTrainer "
                             "allreduces gradients and updates on every rank; pass "
                             "update_on_kvstore=None or False")
        if kvstore not in ("device", None):
            warnings.warn(f"DistributedTrainer ignores kvstore={kvstore!r}: gradients are "
                          "summed by allreduce instead", stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"prefix={prefix!r} must be a string or None")
        check_settings(gradient_predivide_factor, num_groups)
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer reduces gradients itself; it uses the optimizer "
                          "inside the DistributedOptimizer it was given", stacklevel=2)
            per_rank_scale = optimizer.rescale_grad
            optimizer = optimizer._optimizer
            optimizer.rescale_grad = per_rank_scale
        param_list = _param_list(params)
        self._compression = _compressor(compression, compression_params)
        runtime.init()
        self._process_set = process_set
        # Outside its process set the trainer is a plain gluon.Trainer, as in Horovod.
        self._member = process_set.included()
        self._size = process_set.size() if self._member else 1
        super().__init__(param_list, optimizer, optimizer_params=optimizer_params,
                         kvstore=None, update_on_kvstore=False)
        self._prefix = prefix or ""
        self._reducer = Reducer(prefix=self._prefix, compression=self._compression,
                                gradient_predivide_factor=gradient_predivide_factor,
                                num_groups=num_groups, sparse_as_dense=sparse_as_dense,
                                process_set=process_set)
        # One rank reduces nothing, so there is no predivision to undo.
        self._scale *= (self._reducer.predivide if self._size > 1 else 1.0) / self._size
        self._sparse_grads = {i for i, p in enumerate(self._params) if p._grad_stype != "default"}
        self._gradients_key: Optional[tuple] = None  # what the reducer's gradients were made of
        self._views: Dict[int, mx.nd.NDArray] = {}  # the bucket views installed as gradients
        self._backed: Optional[List[Bucket]] = None  # the reducer's buckets that _back backed
        self._fresh_contexts: Dict[int, List[int]] = {}  # this step's fresh contexts, bucketed
        self._step_ignore: Optional[bool] = None  # step()'s ignore_stale_grad while it runs
        self._updated: set = set()           # parameters already updated in this step
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

    @property
    def communication_stats(self) -> CommStats:
        """The last step's traffic and codec time."""
        return self._reducer.stats

    @property
    def sparse_exchanges(self) -> Dict[str, Exchange]:
        """How each row-sparse gradient travelled at the last step, by parameter name."""
        return {self._params[i].name: e for i, e in self._reducer.sparse_exchanges.items()}

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
        reducer = self._reducer
        indices = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
        self._prepare(indices)
        in_bucket = self._views
        given: Dict[int, Any] = {}
        ready: List[tuple] = []
        self._fresh_contexts = {}
        for i in indices:
            param = self._params[i]
            if i in in_bucket:  # its gradient is waited for later, bucket by bucket
                fresh = [k for k, d in enumerate(sparse_weights.weight_arrays(param))
                         if d._fresh_grad]
                self._fresh_contexts[i] = fresh
                if fresh:
                    ready.append((i, None))
                continue
            local_sum = sparse_nd.local_rows if i in self._sparse_grads else self._local_sum
            with timeline.span(reducer.name(i), "WAIT_FOR_GRADIENT"):
                given[i] = local_sum(param)
            if given[i] is not None:
                ready.append((i, given[i]))
        reducer.mark_all_ready(ready)
        step = reducer.launch()
        try:
            self._use_buckets(step)
            results = reducer.finish(step)
        finally:
            step.program.exception()  # on an error, let the reductions end before leaving
        for i, value in results.items():
            if i in self._sparse_grads:
                sparse_nd.publish_rows(self._params[i], *value)
            else:
                self._publish(self._params[i], value, in_place=value is given.get(i))

    def _use_buckets(self, step: Step) -> None:
        """Take each reduced bucket: copy it to the other contexts and, when the reductions
        overlap inside ``step()``, queue its parameters' updates.

        Per-bucket updates happen inside ``step()`` only, without an AMP loss scaler (it
        inspects all gradients first), and not when ``step()`` is about to raise for a stale
        gradient (Gluon raises before updating anything).
        """
        update = (step.overlapped and self._step_ignore is not None
                  and getattr(self, "_amp_loss_scaler", None) is None)
        for bucket, handle in step.launched():
            handle.wait()
            self._finish_bucket(bucket, step)
            if update and (self._step_ignore or step.fresh.all()):
                members = [i for i in bucket.keys if self._reducer.fresh(step, i)]
                with timeline.span(f"{self._prefix}bucket.{bucket.number}", "UPDATE"):
                    self._apply_updates(members, self._step_ignore)
                self._updated.update(members)

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
                    self._publish(param, buf, in_place=True)

    def _prepare(self, indices: List[int]) -> None:
        """Give the reducer this step's gradients; lay out again when a gradient is no longer
        the view we installed; back the buckets whenever the reducer laid them out anew
        (for new gradients, or a new bucket threshold from the autotuner)."""
        key = (tuple(indices),
               tuple((p._shape, p.dtype, p._grad_stype, p.list_ctx()[0].device_type)
                     for p in self._params))
        laid_out = False
        if key != self._gradients_key:
            self._gradients_key = key
            gradients = [Gradient(i, tuple(self._params[i].shape),
                                  np.dtype(self._params[i].dtype).str, i in self._sparse_grads,
                                  "host" if bridge.is_host(self._params[i].list_grad()[0])
                                  else "gpu") for i in indices]
            laid_out = self._reducer.set_gradients(gradients)
        # A frozen parameter (grad_req 'null') has no gradient arrays at all.
        if not laid_out and not all(self._params[i]._grad is not None
                                    and self._params[i]._grad[0] is view
                                    for i, view in self._views.items()):
            self._reducer.lay_out()
        if self._reducer.buckets is not self._backed:  # new gradients, or the autotuner's
            self._back(self._reducer.buckets)

    def _back(self, buckets: List[Bucket]) -> None:
        """Back each bucket with a flat NDArray and install its views as the gradients.

        The current gradient values are copied in, so a step may lay out after backward.
        """
        self._views = {}
        self._backed = buckets
        for bucket in buckets:
            first = self._params[bucket.keys[0]].list_grad()[0]
            flat = mx.nd.zeros(bucket.bounds[-1], ctx=first.context, dtype=bucket.dtype)
            for i, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                param = self._params[i]
                grad = param.list_grad()[0]
                view = flat[start:end].reshape(grad.shape)
                if isinstance(grad, mx.np.ndarray):  # numpy-mode Gluon: keep the grad's type
                    view = view.as_np_ndarray()  # the same memory
                grad.copyto(view)
                param._grad[0] = view
                # Marking resets the freshness flags that backward set; keep them.
                weights = sparse_weights.weight_arrays(param)  # a row_sparse one's too
                fresh = [d._fresh_grad for d in weights]
                mx.autograd.mark_variables(weights, param._grad, param.grad_req)
                for d, flag in zip(weights, fresh):
                    d._fresh_grad = flag
                self._views[i] = view
            bucket.open = functools.partial(self._open_bucket, bucket, flat)

    def _open_bucket(self, bucket: Bucket, flat: mx.nd.NDArray) -> np.ndarray:
        """The bucket's NumPy view once backward's writes into it are done; with several
        contexts, each fresh member holds this process's sum over them."""
        host = bridge.write_view(flat)
        if len(self._contexts) > 1:
            for i, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                if self._fresh_contexts[i]:
                    self._sum_contexts(self._params[i], host[start:end], self._fresh_contexts[i])
        return host

    @staticmethod
    def _sum_contexts(param: mx.gluon.Parameter, first: np.ndarray, fresh: List[int]) -> None:
        """Make ``first`` (the first context's gradient, flat) this process's fresh sum."""
        if 0 not in fresh:
            first[...] = 0  # stale here: contribute zeros, plus any other fresh context
        grads = param.list_grad()
        for k in fresh:
            if k > 0:
                first += bridge.read_view(grads[k]).reshape(-1)

    def _finish_bucket(self, bucket: Bucket, step: Step) -> None:
        """Copy the reduced members to the other contexts and mark them fresh."""
        if len(self._contexts) == 1 and step.whole[bucket.number]:
            return  # one context, every member already fresh
        for i, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
            if self._reducer.fresh(step, i):
                param = self._params[i]
                self._publish(param, bucket.host[start:end].reshape(param.shape), in_place=True)

    def _update(self, ignore_stale_grad=False):
        with timeline.span(f"{self._prefix}step", "UPDATE"):
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


    def _local_sum(self, param: mx.gluon.Parameter) -> Optional[np.ndarray]:
        """Sum this process's fresh gradients into the first context's buffer: the gradient
        itself on the host, a host copy for a GPU gradient. None when no context is fresh."""
        fresh = [k for k, d in enumerate(sparse_weights.weight_arrays(param)) if d._fresh_grad]
        if not fresh:
            return None
        grad = param.list_grad()[0]
        buf = bridge.write_view(grad) if bridge.is_host(grad) else grad.asnumpy()
        self._sum_contexts(param, buf.reshape(-1), fresh)
        return buf

    @staticmethod
    def _publish(param: mx.gluon.Parameter, buf: np.ndarray, in_place: bool) -> None:
        """Write the reduced gradient to every context and mark it fresh there; ``in_place``:
        ``buf`` is the first context's host gradient itself."""
        for k, g in enumerate(param.list_grad()):
            if k > 0 or not in_place or not bridge.is_host(g):
                bridge.assign(g, buf)
        for d in sparse_weights.weight_arrays(param):
            d._fresh_grad = True

    def save_states(self, fname: str) -> None:
        """Write this process's optimizer states to ``fname``, as ``gluon.Trainer`` does.

        Not a collective: call it on one rank (``if hvd.rank() == 0:``, Horovod's habit) or on
        every rank with a path of its own (Gluon's ``CheckpointHandler``). The file is written
        under a temporary name and renamed into place, so ``fname`` is always whole, and a
        plain ``gluon.Trainer`` can read it. It holds no compression residuals; for an exact
        resume across ranks use the collective :meth:`save_checkpoint`.
        """
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        files.write_atomically(fname, self._updaters[0].get_states(dump_optimizer=True))

    def load_states(self, fname: str) -> None:
        """Read optimizer states from ``fname`` into this process's trainer, as Gluon does.

        Not a collective: each caller reads its own path. Every rank loading the same states
        keeps the ranks' updates identical; compression residuals are left as they are.
        A states file is a pickle, as Gluon's own: load only files from a trusted source. A
        checkpoint (:meth:`save_checkpoint`), or states of another model or optimizer, are
        refused with a ValueError naming what differs, and nothing is loaded.
        """
        with open(fname, "rb") as f:
            data = f.read()
        if checkpoint_format.is_checkpoint(data):
            raise ValueError(f"{fname!r} is a checkpoint written by save_checkpoint(), not "
                             "optimizer states; load it with trainer.load_checkpoint()")
        self._check_states(pickle.loads(data), fname)
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        self._set_states(data)

    def _check_states(self, loaded: Any, fname: str) -> None:
        """Refuse Gluon states (``(states, optimizer)`` or ``states``) that another model or
        optimizer wrote, naming what differs: indices past this trainer's parameters, a
        state whose shape is not its parameter's, another optimizer class."""
        states, optimizer = loaded if isinstance(loaded, tuple) and len(loaded) == 2 else (loaded, None)
        fix = "load states that this model and optimizer saved"
        if not isinstance(states, dict) or not all(isinstance(i, int) for i in states):
            raise ValueError(f"{fname!r} does not hold Gluon optimizer states (a dict by "
                             f"parameter index); {fix}")
        outside = sorted(i for i in states if not 0 <= i < len(self._params))
        if outside:
            raise ValueError(f"{fname!r} holds states of {len(states)} parameters, up to index "
                             f"{max(states)}; this trainer has {len(self._params)} parameters; {fix}")
        if optimizer is not None and type(optimizer) is not type(self._optimizer):
            raise ValueError(f"{fname!r} holds states of optimizer {type(optimizer).__name__}, "
                             f"this trainer's is {type(self._optimizer).__name__}; {fix}")
        for i, state in sorted(states.items()):
            param = self._params[i]
            for shape in _state_shapes(state):
                if tuple(shape) != tuple(param.shape):
                    raise ValueError(f"{fname!r}: the state of parameter {i} ({param.name!r}) "
                                     f"has shape {tuple(shape)}, the parameter {tuple(param.shape)}; {fix}")

    def save_checkpoint(self, fname: str, extra: Any = None) -> None:
        """Save everything a resumed run needs, in one file. A collective: every rank of the
        trainer's process set calls it.

        The set's first rank writes the weights, the optimizer states (with the optimizer
        itself, its update counts and lr scheduler), every rank's compression residuals
        (gathered to it alone), and ``extra`` (any picklable value, e.g. the epoch and step),
        through a temporary file and ``os.replace``, so the file is always whole: the old one
        or the new one. Every rank
        returns once it is written; a write error raises OSError on all. On a rank outside
        the process set it is local: that rank writes its own file.
        """
        self._check_initialized("save_checkpoint")
        reducer_state = (raises_mxnet_errors(self._reducer.gather_state)(
            f"{self._prefix}residuals") if self._member else None)

        def build() -> bytes:
            weights = [self._sparse_weights.value(i) if i in self._sparse_weights
                       else bridge.read_view(p.list_data()[0]).copy()
                       for i, p in enumerate(self._params)]
            states = attach_residuals(self._updaters[0].get_states(dump_optimizer=True),
                                      reducer_state)
            return checkpoint_format.pack({"format": _CHECKPOINT_FORMAT, "weights": weights,
                                           "states": states, "extra": extra})

        self._write_on_root(fname, build, "save_checkpoint")

    def load_checkpoint(self, fname: str) -> Any:
        """Restore what :meth:`save_checkpoint` wrote and return its ``extra``. A collective:
        every rank of the trainer's process set calls it.

        The set's first rank reads the file and sends it to the others, each rank receiving
        only its own compression residuals, so no shared file system is needed. After it a run
        continues exactly as the one that saved it: on CPU the weights of a resumed run equal
        those of an uninterrupted one, bit for bit. On a rank outside the process set it is
        local: that rank reads its own file.
        """
        self._check_initialized("load_checkpoint")
        checkpoint, reducer_state = self._read_on_root(fname, "load_checkpoint")
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
        if self._member:
            raises_mxnet_errors(self._reducer.scatter_state)(reducer_state,
                                                             f"{self._prefix}residuals")
        return checkpoint["extra"]

    def _check_initialized(self, what: str) -> None:
        waiting = [p.name for p in self._params if p._data is None]
        if waiting:
            raise ValueError(f"{what}: parameters {waiting} are not initialized yet (deferred "
                             "shapes); run one forward pass first")

    def _set_states(self, states: bytes) -> None:
        """Load optimizer states (with the optimizer) into every updater."""
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
                files.write_atomically(fname, build())
            except OSError as e:
                error = f"rank {runtime.rank()} could not write {fname!r}: {e}"
        if self._member:
            outcomes = raises_mxnet_errors(ops.allgather_object)(
                error, f"{self._prefix}{what}", self._process_set)
            error = next((e for e in outcomes if e), None)
        if error:
            raise OSError(error)

    def _read_on_root(self, fname: str, what: str) -> Tuple[Dict[str, Any], Any]:
        """The set's first rank reads ``fname``, checks it (digest before unpickling) and every
        member gets the checkpoint less the residuals, which stay on the reading rank (returned
        there, None elsewhere). A file that cannot be read raises OSError on all members, one
        that is no intact checkpoint ValueError."""
        checkpoint, error, reducer_state = None, None, None
        if self._writes():
            try:
                with open(fname, "rb") as f:
                    checkpoint, reducer_state = _without_residuals(f.read(), fname)
            except OSError as e:
                error = ("OSError", f"rank {runtime.rank()} could not read {fname!r}: {e}")
            except ValueError as e:
                error = ("ValueError", str(e))
        if self._member:
            checkpoint, error = raises_mxnet_errors(ops.allgather_object)(
                (checkpoint, error) if self._writes() else None, f"{self._prefix}{what}",
                self._process_set)[0]
        if error:
            raise (OSError if error[0] == "OSError" else ValueError)(error[1])
        return checkpoint, reducer_state


def _without_residuals(data: bytes, fname: str) -> Tuple[Dict[str, Any], Any]:
    """The checkpoint in a file's bytes, verified, with the residuals taken out of its states,
    and the residuals; ValueError when it is no intact checkpoint."""
    checkpoint = checkpoint_format.unpack(data, fname)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"{fname!r} is not a DistributedTrainer checkpoint; write one with "
                         "trainer.save_checkpoint()")
    checkpoint["states"], reducer_state = detach_residuals(checkpoint["states"])
    return checkpoint, reducer_state


def _state_shapes(state: Any) -> List[Tuple[int, ...]]:
    """The shapes of the arrays in one parameter's optimizer state (None, an array, or
    nested tuples and lists of them)."""
    if isinstance(state, (tuple, list)):
        return [shape for part in state for shape in _state_shapes(part)]
    return [tuple(state.shape)] if hasattr(state, "shape") else []
