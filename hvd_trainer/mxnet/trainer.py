"""DistributedTrainer: gluon.Trainer whose gradient reduction is a ring allreduce across ranks."""
import os
import pickle
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Type, Union

import mxnet as mx
import numpy as np

from .. import diagnostics, ops, runtime, sparse
from ..compression import (CommStats, Compression, Compressor, ErrorFeedbackSum,
                           GatherCompressor, attach_residuals, detach_residuals)
from ..compression import from_params as compression_from_params
from ..runtime import ProcessSet, global_process_set
from . import bridge
from . import sparse as sparse_nd
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
            raise ValueError(
                f"Parameter {param.name!r} has stype={param._stype!r}; DistributedTrainer "
                "allreduces dense weights only. Create the weight dense (the default stype) and "
                "give it sparse_grad=True instead (e.g. Embedding(..., sparse_grad=True)).")
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
      construction; a parameter with deferred initialisation is broadcast when the first
      forward pass initialises it, so the first gradients already use the root's weights.
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
      order; the residuals of error feedback are per rank and go into ``save_states``.
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
    - ``save_states`` is written by the process set's rank 0 through a temporary file and
      ``os.replace``; ``load_states`` is read by rank 0 and broadcast, so every rank gets the
      same state even without a shared file system. ``save_checkpoint`` and
      ``load_checkpoint`` do the same for everything an exact resume needs: weights,
      optimizer states, compression residuals and the caller's ``extra``.
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
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=None, *,
                 compression: Union[Type[Compressor], GatherCompressor] = Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: Optional[str] = None,
                 root_rank: int = 0, process_set: ProcessSet = global_process_set,
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
        self._size = process_set.size()
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
        if self._size > 1:
            broadcast_named([(f"{self._prefix}param.{i}", p) for i, p in enumerate(self._params)],
                            root_rank, process_set)

    def _allreduce_grads(self):
        if self._size == 1 and len(self._contexts) == 1:
            return
        indices = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
        buffers = {}
        for i in indices:
            local_sum = sparse_nd.local_rows if i in self._sparse_grads else self._local_sum
            with diagnostics.span(f"{self._prefix}grad.{i}", "WAIT_FOR_GRADIENT"):
                buffers[i] = local_sum(self._params[i])
            self._fresh[i] = buffers[i] is not None
        comm = runtime.communicator(self._process_set)
        # The step's one agreement exchange: it checks that every rank has the same gradients
        # and settings, ors the freshness flags, and so covers the collectives that follow.
        with diagnostics.span(f"{self._prefix}step", "NEGOTIATE"):
            self._fresh[indices] = diagnostics.agree(
                comm, lambda: self._step_description(indices), self._fresh[indices])
        with diagnostics.covered(comm):
            self._reduce_sparse([i for i in indices if self._fresh[i] and i in self._sparse_grads],
                                buffers)
            reduced = [i for i in indices if self._fresh[i] and i not in self._sparse_grads]
            for i in reduced:
                if buffers[i] is None:
                    buffers[i] = self._zeroed_first(self._params[i])
            if self._size > 1 and reduced:
                self._allreduce(reduced, buffers)
        for i in reduced:
            self._publish(self._params[i], buffers[i])

    def _step_description(self, indices: List[int]) -> Dict[str, Any]:
        """Everything that fixes a step's collectives, for the ranks' agreement on it.

        The same object while no gradient's presence, shape, dtype or storage changes, so the
        agreement reuses its digest.
        """
        key = (tuple(indices),
               tuple((p._shape, p.dtype, p._grad_stype) for p in self._params))
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
                             "stype": self._params[i]._grad_stype} for i in indices]}

    def _update(self, ignore_stale_grad=False):
        with diagnostics.span(f"{self._prefix}step", "UPDATE"):
            super()._update(ignore_stale_grad)

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
        data, grads = param.list_data(), param.list_grad()
        fresh = [g for d, g in zip(data, grads) if d._fresh_grad]
        if not fresh:
            return None
        buf = self._first_buffer(grads[0])
        if fresh[0] is not grads[0]:
            buf[...] = 0
        for g in fresh:
            if g is not grads[0]:
                buf += bridge.read_view(g)
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

    def _allreduce(self, reduced: List[int], buffers: Dict[int, np.ndarray]) -> None:
        """Sum the buffers across ranks in place, in ``num_groups`` grouped calls.

        Tensors a GatherCompressor accepts go by one allgather per group (with error feedback,
        see ``compression.ErrorFeedbackSum``), the others by allreduce; the traffic of the
        step lands in ``communication_stats``.
        """
        stats = self.communication_stats = CommStats()
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
        """Write the optimizer state once (rank 0, atomically); every rank returns after it."""
        residuals = self._gather_residuals()
        self._write_on_root(fname, lambda: self._states_bytes(residuals), "save_states")

    def load_states(self, fname: str) -> None:
        """Read the optimizer state on rank 0 and give every rank the same copy."""
        self._set_states(self._read_on_root(fname, "load_states"))

    def save_checkpoint(self, fname: str, extra: Any = None) -> None:
        """Save everything a resumed run needs, in one file; call it on every rank.

        Rank 0 of the process set writes the weights, the optimizer states (with the
        optimizer itself, its update counts and lr scheduler), every rank's compression
        residuals, and ``extra`` (any picklable value, e.g. the epoch and step), through a
        temporary file and ``os.replace``, so the file is always whole: the old one or the
        new one. Every rank returns once it is written; a write error raises OSError on all.
        """
        self._check_initialized("save_checkpoint")
        residuals = self._gather_residuals()

        def build() -> bytes:
            weights = [bridge.read_view(p.list_data()[0]).copy() for p in self._params]
            return pickle.dumps({"format": _CHECKPOINT_FORMAT, "weights": weights,
                                 "states": self._states_bytes(residuals), "extra": extra},
                                pickle.HIGHEST_PROTOCOL)

        self._write_on_root(fname, build, "save_checkpoint")

    def load_checkpoint(self, fname: str) -> Any:
        """Restore what :meth:`save_checkpoint` wrote, on every rank; return its ``extra``.

        Rank 0 reads the file and broadcasts it, so no shared file system is needed. After it
        a run continues exactly as the one that saved it: on CPU the weights of a resumed
        run equal those of an uninterrupted one, bit for bit.
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
        """Every rank's error-feedback residuals (a collective), or None without them."""
        if self._feedback is None:
            return None
        return ops.allgather_object(self._feedback.residuals, f"{self._prefix}residuals",
                                    self._process_set)

    def _states_bytes(self, residuals: Optional[List[Dict[Any, np.ndarray]]]) -> bytes:
        """The optimizer states (with the optimizer), ``residuals`` attached."""
        return attach_residuals(self._updaters[0].get_states(dump_optimizer=True), residuals)

    def _set_states(self, data: bytes) -> None:
        """Load what :meth:`_states_bytes` made into every updater and the residuals."""
        states, residuals = detach_residuals(data)
        if self._feedback is not None:
            self._feedback.load(residuals, self._process_set.rank(), self._size)
        for updater in self._updaters:
            updater.set_states(states)
            updater.optimizer = self._updaters[0].optimizer
        self._optimizer = self._updaters[0].optimizer
        self._optimizer.param_dict = {i: param for i, param in enumerate(self._params)}

    def _write_on_root(self, fname: str, build: Callable[[], bytes], what: str) -> None:
        """Rank 0 writes ``build()`` to a temporary file, syncs it and renames it to ``fname``;
        every rank returns after that, or raises OSError naming the file if it failed."""
        error = None
        if self._process_set.rank() == 0:
            tmp = f"{fname}.tmp.{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    f.write(build())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, fname)
            except OSError as e:
                error = f"rank 0 could not write {fname!r}: {e}"
        error = ops.broadcast_object(error, 0, f"{self._prefix}{what}", self._process_set)
        if error:
            raise OSError(error)

    def _read_on_root(self, fname: str, what: str) -> bytes:
        """Rank 0 reads ``fname`` and every rank gets its bytes; OSError on all if it failed."""
        data, error = None, None
        if self._process_set.rank() == 0:
            try:
                with open(fname, "rb") as f:
                    data = f.read()
            except OSError as e:
                error = f"rank 0 could not read {fname!r}: {e}"
        data, error = ops.broadcast_object((data, error), 0, f"{self._prefix}{what}",
                                           self._process_set)
        if error:
            raise OSError(error)
        return data
