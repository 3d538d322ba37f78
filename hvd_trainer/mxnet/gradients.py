"""The gradient side of DistributedTrainer: the step's NDArrays bridged to the core's step protocol.

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

**Several contexts** per process: fresh gradients are summed locally into the first context's
buffer, reduced once (through the reducer's comm hook, compressed or not), and copied back to
every context. Row-sparse gradients (and 0-d ones) take the reducer's per-tensor path: summed
into the first context's buffer, reduced, copied back.

**Stale gradients.** The step's one agreement checks that every rank has the same gradients
and settings and carries the freshness flags: a gradient fresh on some rank is reduced
everywhere, stale ranks contributing zeros, and then counts as fresh on every rank and
context, so all ranks apply the same update (the fresh ranks' sum over the global batch).
One fresh nowhere is left untouched, so Gluon's ``ignore_stale_grad`` decides alike.

**Row-sparse gradients** (``sparse_grad=True``) are allgathered as ids and rows, duplicates
summed, and stay row_sparse (:mod:`hvd_trainer.collectives.sparse`), or go by dense allreduce when
that moves fewer bytes (always with ``sparse_as_dense=True``); compression applies to dense
gradients only. row_sparse *weights* are held whole on every rank and updated once per step
with the gathered rows (:mod:`.sparse_weights`).
"""
import functools
from typing import Any, Dict, List, Optional

import mxnet as mx
import numpy as np

from ..runtime import timeline
from ..training.buckets import Bucket, Gradient
from ..training.step import Step
from . import bridge, sparse_weights
from . import sparse as sparse_nd
from .errors import raises_mxnet_errors


class ReducedGradients:
    """The methods of DistributedTrainer that reduce a step's gradients and update with them
    (it sets up the attributes they use)."""

    def step(self, batch_size, ignore_stale_grad=False):
        # Lets _allreduce_grads update bucket by bucket; _update then does the rest.
        self._follow_size()
        self._step_ignore = ignore_stale_grad
        try:
            super().step(batch_size, ignore_stale_grad)
        finally:
            self._step_ignore = None

    def allreduce_grads(self):
        self._follow_size()
        super().allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        self._follow_size()
        super().update(batch_size, ignore_stale_grad)

    def _follow_size(self) -> None:
        """Average over the process set's ranks now: a job that hvdrun --ulfm shrank
        averages over its survivors. Gluon reads ``_scale`` before it reduces, so each
        public entry (step, allreduce_grads, update) follows first."""
        size = self._process_set.size() if self._member else 1
        if size != self._size:
            predivide = self._reducer.predivide
            self._scale *= (((predivide if size > 1 else 1.0) / size)
                            / ((predivide if self._size > 1 else 1.0) / self._size))
            self._size = size

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
        self._reducer.mark_all(ready)
        step, _ = self._reducer.close()
        update = (step.overlapped and self._step_ignore is not None
                  and getattr(self, "_amp_loss_scaler", None) is None)
        results, _ = self._reducer.finish(step, functools.partial(self._use_bucket, step, update))
        for i, value in results.items():
            if i in self._sparse_grads:
                sparse_nd.publish_rows(self._params[i], *value)
            else:
                self._publish(self._params[i], value, in_place=value is given.get(i))

    def _use_bucket(self, step: Step, update: bool, bucket: Bucket) -> None:
        """Take a reduced bucket: copy it to the other contexts and, with ``update`` (the
        reductions overlap inside ``step()``), queue its parameters' updates.

        Per-bucket updates happen inside ``step()`` only, without an AMP loss scaler (it
        inspects all gradients first), and not when ``step()`` is about to raise for a stale
        gradient (Gluon raises before updating anything).
        """
        self._finish_bucket(bucket, step)
        if update and (self._step_ignore or step.every_fresh):
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
        self._reducer.back_if_relaid()  # new gradients, or the autotuner's

    def _back(self, buckets: List[Bucket]) -> None:
        """Back each bucket with a flat NDArray and install its views as the gradients.

        The current gradient values are copied in, so a step may lay out after backward.
        """
        self._views = {}
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
        if len(self._contexts) == 1 and step.complete(bucket.number):
            return  # one context, every member already fresh
        reduced = step.array(bucket.number)
        for i, start, end in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
            if self._reducer.fresh(step, i):
                param = self._params[i]
                self._publish(param, reduced[start:end].reshape(param.shape), in_place=True)

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
