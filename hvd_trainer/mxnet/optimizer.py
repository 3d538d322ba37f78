"""DistributedOptimizer: Horovod's optimizer wrapper for the MXNet Module API.

``mx.mod.Module.fit(..., kvstore=None, optimizer=DistributedOptimizer(opt))`` sums every
gradient across ranks just before the wrapped optimizer applies it. The ``1/size`` of the
average is folded into the wrapped optimizer's ``rescale_grad`` (as Horovod does), so N ranks
with batch B each update exactly like one process with batch N*B.
"""
from typing import Any

import mxnet as mx

from ..runtime import runtime
from ..training.reducer import Reducer
from ..training.buckets import check_settings
from ..runtime.runtime import ProcessSet, global_process_set
from . import bridge
from .errors import raises_mxnet_errors

_OWN = ("_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set",
        "_rescale_grad", "_reducer")


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer`` so that ``update`` allreduces gradients first
    (through a :class:`hvd_trainer.training.reducer.Reducer`, without buckets: Module hands over a
    few gradients at a time).

    ``gradient_predivide_factor`` f scales gradients by 1/f before the sum and f/size after
    (through ``rescale_grad``). ``num_groups`` > 0 reduces each update's gradients in that
    many grouped calls; 0 reduces them in one fused call. Every other attribute and method,
    read or written, is the wrapped optimizer's, except ``rescale_grad``: it reads and writes
    in per-rank terms (e.g. 1/B) while the wrapped optimizer holds it times ``f/size``. So
    Module's check of ``rescale_grad`` passes, and a ``gluon.Trainer`` setting it each step
    keeps the average.

    ``update`` is a collective over ``process_set``: every member calls it with the same
    indices. On a rank outside the set it is the wrapped optimizer's plain local update
    (no collectives, no averaging), as in Horovod.
    """

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set):
        # The base __init__ is not called: all state lives in the wrapped optimizer.
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError("optimizer must be an mx.optimizer.Optimizer, got "
                            f"{type(optimizer).__name__}; create it with mx.optimizer.create()")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("optimizer is already a DistributedOptimizer; wrap it only once")
        check_settings(gradient_predivide_factor, num_groups)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_gradient_predivide_factor", float(gradient_predivide_factor))
        object.__setattr__(self, "_num_groups", int(num_groups))
        object.__setattr__(self, "_process_set", process_set)
        object.__setattr__(self, "_reducer", None)  # made at the first update, after init
        self.rescale_grad = optimizer.rescale_grad

    @property
    def rescale_grad(self) -> float:
        """The gradient scale in per-rank terms; the wrapped optimizer applies it times f/size."""
        return self._rescale_grad

    @rescale_grad.setter
    def rescale_grad(self, value: float) -> None:
        object.__setattr__(self, "_rescale_grad", value)
        if self._process_set.included():
            value = value * self._gradient_predivide_factor / self._process_set.size()
        self._optimizer.rescale_grad = value

    def __getattr__(self, item: str) -> Any:
        if item in _OWN:  # not set yet (unpickling): do not recurse into the wrapped optimizer
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key: str, value: Any) -> None:
        # Module.init_optimizer sets idx2name here; it must reach the optimizer that uses it.
        if key in _OWN or key == "rescale_grad":
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def __getstate__(self) -> dict:
        ps = self._process_set
        return {"optimizer": self._optimizer,
                "gradient_predivide_factor": self._gradient_predivide_factor,
                "num_groups": self._num_groups, "rescale_grad": self._rescale_grad,
                "process_set_ranks": None if ps is global_process_set else ps.ranks}

    def __setstate__(self, state: dict) -> None:
        ranks = state["process_set_ranks"]
        if ranks is None:
            process_set = global_process_set
        else:
            found = [ps for ps in runtime.state().process_sets.values() if ps.ranks == ranks]
            if not found:
                raise ValueError(f"the pickled DistributedOptimizer reduces over process set "
                                 f"ranks {ranks}; register it with add_process_set() first")
            process_set = found[0]
        object.__setattr__(self, "_optimizer", state["optimizer"])
        object.__setattr__(self, "_gradient_predivide_factor",
                           state["gradient_predivide_factor"])
        object.__setattr__(self, "_num_groups", state["num_groups"])
        object.__setattr__(self, "_process_set", process_set)
        object.__setattr__(self, "_reducer", None)
        object.__setattr__(self, "_rescale_grad", state["rescale_grad"])

    @property
    def learning_rate(self) -> float:
        """The wrapped optimizer's current learning rate."""
        return self._optimizer.learning_rate

    @raises_mxnet_errors
    def _allreduce(self, index: Any, grad: Any) -> None:
        """Sum the gradients of one update call across ranks, in place (nothing to do on one
        rank or outside the process set)."""
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        indices = list(index) if isinstance(index, (list, tuple)) else [index]
        grads = list(grad) if isinstance(grad, (list, tuple)) else [grad]
        for i, g in zip(indices, grads):
            bridge.check_dense(g, f"the gradient of parameter index {i}")
        if self._reducer is None:
            object.__setattr__(self, "_reducer", Reducer(
                prefix="DistributedOptimizer.", num_groups=self._num_groups,
                gradient_predivide_factor=self._gradient_predivide_factor,
                process_set=self._process_set))
        buffers = [bridge.write_view(g) if bridge.is_host(g) else g.asnumpy() for g in grads]
        self._reducer.sum_now(list(zip(indices, buffers)))
        for g, b in zip(grads, buffers):
            if not bridge.is_host(g):
                bridge.assign(g, b)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Allreduce ``grad`` (one NDArray or a list, matching ``index``), then update."""
        self._allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Allreduce ``grad``, then run the wrapped optimizer's multi-precision update."""
        self._allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._optimizer, name)(*args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"The wrapped optimizer's ``{name}``."
    return method


# Methods that mx.optimizer.Optimizer defines would otherwise run on the (stateless) wrapper.
for _name in ("create_state", "create_state_multi_precision", "set_learning_rate",
              "set_lr_scale", "set_lr_mult", "set_wd_mult", "_set_current_context",
              "_update_count", "_get_lrs", "_get_lr", "_get_wds", "_get_wd"):
    setattr(DistributedOptimizer, _name, _forward(_name))
