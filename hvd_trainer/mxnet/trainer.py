"""DistributedTrainer: gluon.Trainer whose gradients are summed across ranks by the core's reducer.

The reducer (:mod:`hvd_trainer.training.reducer`) owns the gradient machinery: buckets, the
step's agreement and freshness flags, the comm hook (compression), row-sparse gradients, the
communication thread, the residuals of exact resume, the collective side of checkpoints (:mod:`hvd_trainer.training.checkpoint`). This
module keeps what is Gluon's: the parameter list, ``rescale_grad``, Horovod's and Gluon's
arguments, the files of states and checkpoints; :mod:`.gradients` bridges the step's
gradients (buckets as NDArrays, contexts, per-bucket updates).
"""
import pickle
import warnings
from typing import Any, Dict, List, Optional

import mxnet as mx
import numpy as np

from ..training import checkpoint
from ..runtime import files, runtime
from ..compression import AnyCompressor, Compression
from ..compression import from_params as compression_from_params
from ..training.hooks import Hook
from ..training.reducer import Reducer
from ..training.buckets import check_settings
from ..runtime.runtime import ProcessSet, global_process_set
from ..collectives.sparse import Exchange
from ..collectives.traffic import CommStats
from . import bridge, sparse_weights
from .errors import raises_mxnet_errors
from .halves import KERNELS
from .gradients import ReducedGradients
from .optimizer import DistributedOptimizer
from .parameters import broadcast_named, parameter_list
from .trainer_arguments import read_positional

def _compressor(compression: AnyCompressor, compression_params: Optional[Dict[str, Any]]
                ) -> AnyCompressor:
    """Map MXNet's ``compression_params`` onto a compressor; ``compression`` when it is None."""
    if compression_params is None:
        return compression
    if compression is not Compression.none:
        raise ValueError("pass either compression= or compression_params=, not both")
    return compression_from_params(compression_params)


class DistributedTrainer(ReducedGradients, mx.gluon.Trainer):
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
      compression (``Compression.none``, ``Compression.fp16``, a Compressor subclass, a
      ``GatherCompressor`` or ``Compression.powersgd(...)``); anything else is a TypeError. After a compression, a number as
      5th argument is Horovod's ``gradient_predivide_factor`` and a str as 6th its
      ``prefix``; ``num_groups`` and ``process_set`` are keywords here.
    - ``compression_params`` of type 2bit, 1bit, topk or scaled_2bit (or a
      ``compression.GatherCompressor`` as ``compression``) send float32 gradients of at least
      ``min_size`` elements packed, by allgather, and every rank decodes and sums them in rank
      order; the residuals of error feedback are per rank and go into ``save_checkpoint``.
      ``compression=Compression.powersgd(rank=...)`` (or ``compression_params`` of type
      ``powersgd``) sums low-rank factors by allreduce (:mod:`hvd_trainer.collectives.powersgd`);
      its residuals, factors and counts go into ``save_checkpoint`` too.
      ``communication_stats`` holds the last step's traffic and codec time.
    - Tensor names are ``prefix`` + the parameter's index in Gluon's order (sorted keys of a
      dict), so two trainers in one process need different prefixes.
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
    - How a step reduces the gradients (buckets and overlap, several contexts, stale
      gradients, row-sparse gradients and weights) is told in :mod:`.gradients`.
    - Collectives: construction (the weight broadcast), ``step``, ``allreduce_grads``,
      ``save_checkpoint`` and ``load_checkpoint`` are called by every rank of the process
      set; ``update``, ``save_states``, ``load_states`` and ``set_learning_rate`` are local.
    - A ``DistributedOptimizer`` passed as ``optimizer`` is unwrapped with a warning (as in
      Horovod), keeping its per-rank ``rescale_grad``, so gradients are not reduced twice.
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=None, *,
                 compression: AnyCompressor = Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: Optional[str] = None,
                 root_rank: Optional[int] = None, process_set: ProcessSet = global_process_set,
                 num_groups: int = 0, sparse_as_dense: bool = False):
        given = read_positional(kvstore, compression_params, update_on_kvstore,
                                compression=compression,
                                gradient_predivide_factor=gradient_predivide_factor, prefix=prefix)
        kvstore, compression_params, update_on_kvstore = (
            given.kvstore, given.compression_params, given.update_on_kvstore)
        compression, gradient_predivide_factor, prefix = (
            given.compression, given.gradient_predivide_factor, given.prefix)
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
        param_list = parameter_list(params)
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
                                process_set=process_set, kernels=KERNELS)
        # One rank reduces nothing, so there is no predivision to undo.
        self._scale *= (self._reducer.predivide if self._size > 1 else 1.0) / self._size
        self._sparse_grads = {i for i, p in enumerate(self._params) if p._grad_stype != "default"}
        self._gradients_key: Optional[tuple] = None  # what the reducer's gradients were made of
        self._views: Dict[int, mx.nd.NDArray] = {}  # the bucket views installed as gradients
        self._reducer.attach(self._back)
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

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket)`` instead of the built-in
        sum (PyTorch DDP's ``register_comm_hook``): see :mod:`hvd_trainer.training.hooks`.
        The hook gets NumPy views of the buckets and returns a future of their sum over the
        ranks; ``rescale_grad`` still averages. Call it once, before the first step, on every
        rank of the process set, on a trainer without compression."""
        if self._member:
            self._reducer.register_comm_hook(state, hook)

    @property
    def communication_stats(self) -> CommStats:
        """The last step's traffic and codec time."""
        return self._reducer.stats

    @property
    def sparse_exchanges(self) -> Dict[str, Exchange]:
        """How each row-sparse gradient travelled at the last step, by parameter name."""
        return {self._params[i].name: e for i, e in self._reducer.sparse_exchanges.items()}

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
        data = checkpoint.read_file(fname)
        if checkpoint.is_checkpoint(data):
            raise ValueError(f"{fname!r} is a checkpoint written by save_checkpoint(), not "
                             "optimizer states; load it with trainer.load_checkpoint()")
        checkpoint.check_states(pickle.loads(data), fname, [p.shape for p in self._params],
                                [p.name for p in self._params], self._optimizer)
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        self._set_states(data)

    def save_checkpoint(self, fname: str, extra: Any = None) -> None:
        """Save everything a resumed run needs, in one file. A collective: every rank of the
        trainer's process set calls it.

        The set's first rank writes the weights, the optimizer states (with the optimizer
        itself, its update counts and lr scheduler), every rank's compression residuals
        (gathered to it alone), and ``extra`` (any picklable value, e.g. the epoch and step),
        through a temporary file and ``os.replace``, so the file is always whole: the old one
        or the new one. Every rank
        returns once it is written; an error raises on all (OSError for a write error,
        ValueError for an ``extra`` that cannot be pickled). On a rank outside the process
        set it is local: that rank writes its own file.
        """
        self._check_initialized("save_checkpoint")

        def weights() -> List[np.ndarray]:
            return [self._sparse_weights.value(i) if i in self._sparse_weights
                    else bridge.read_view(p.list_data()[0]).copy()
                    for i, p in enumerate(self._params)]

        raises_mxnet_errors(checkpoint.save)(
            fname, self._reducer, weights,
            lambda: self._updaters[0].get_states(dump_optimizer=True), extra)

    def load_checkpoint(self, fname: str) -> Any:
        """Restore what :meth:`save_checkpoint` wrote and return its ``extra``. A collective:
        every rank of the trainer's process set calls it.

        The set's first rank reads the file and sends it to the others, each rank receiving
        only its own compression residuals, so no shared file system is needed. After it a run
        continues exactly as the one that saved it: on CPU the weights of a resumed run equal
        those of an uninterrupted one, bit for bit. An error raises on every rank (OSError
        for a file that cannot be read, ValueError for one that is no intact checkpoint or
        holds what cannot be unpickled here). On a rank outside the process set it is
        local: that rank reads its own file.
        """
        self._check_initialized("load_checkpoint")
        return raises_mxnet_errors(checkpoint.load)(
            fname, self._reducer, [p.shape for p in self._params],
            [p.name for p in self._params], self._restore)

    def _restore(self, weights: List[np.ndarray], states: bytes) -> None:
        """Assign a checkpoint's weights and optimizer states."""
        for i, (param, values) in enumerate(zip(self._params, weights)):
            if i in self._sparse_weights:
                self._sparse_weights.assign(i, values)
                continue
            for array in param.list_data():
                bridge.assign(array, values.astype(array.dtype, copy=False))
        self._set_states(states)

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
