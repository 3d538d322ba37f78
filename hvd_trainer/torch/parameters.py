"""Making every rank start from the root's model and optimizer: ``broadcast_parameters`` and
``broadcast_optimizer_state``, as in horovod.torch.

Both are collectives of the process set; on a rank outside it they do nothing, like the
MXNet adapter's ``broadcast_parameters``.
"""
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..runtime.runtime import ProcessSet, global_process_set, rank
from . import ops


def broadcast_parameters(params: Union[Dict[str, torch.Tensor], Iterable[Any]], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every tensor of ``params`` in place with ``root_rank``'s values.

    ``params`` is a ``state_dict()`` (a dict, broadcast in sorted key order), or
    ``named_parameters()`` / ``parameters()`` (in the given order). Each tensor is
    broadcast under its name.
    """
    if not process_set.included():
        return
    if isinstance(params, dict):
        entries = sorted(params.items())
    else:
        entries = [p if isinstance(p, tuple) else (None, p) for p in params]
    started = [ops.broadcast_async_(p, root_rank, name, process_set) for name, p in entries]
    for handle in started:
        ops.synchronize(handle)


class _Slot:
    """Where a tensor of the root's optimizer state goes: its shape and dtype."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _replace(value: Any, kind: type, make: Callable[[Any], Any]) -> Any:
    """``value`` (nested dicts, lists and tuples) with every ``kind`` leaf ``x`` replaced by
    ``make(x)``, visited in a fixed order: that of the dicts' keys and the sequences."""
    if isinstance(value, kind):
        return make(value)
    if isinstance(value, dict):
        return {k: _replace(v, kind, make) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, kind, make) for v in value)
    return value


def _zero_gradients(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> None:
    """Give each parameter of ``optimizer`` that requires a gradient a zero one, as Horovod
    leaves them: sparse (row-sparse) for SparseAdam, and for SGD on the sparse embeddings of
    ``model``; dense otherwise."""
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
                  for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            zeros = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                zeros = zeros.to_sparse(1)
            p.grad = zeros


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state: per-parameter state (momentum
    buffers, Adam's moments and step) and every option of every parameter group (``lr``,
    ``betas``, ``weight_decay``, ...), exactly.

    Ranks whose optimizer has not created its state yet (no step taken) receive the root's,
    and if the root has none, the others' is cleared. No step is taken to create state, so
    the weights are left alone; but a rank whose optimizer had no state leaves each of its
    parameters that requires a gradient with a zero ``.grad``, where Horovod's state-making
    step leaves one (sparse for SparseAdam, and for SGD on ``model``'s sparse embeddings;
    ``model`` serves only that). The ranks' optimizers must have the same parameter groups,
    with the same number of parameters each, or every rank raises ``ValueError``.
    """
    if not process_set.included():
        return
    state = optimizer.state_dict()
    if not state["state"]:
        _zero_gradients(optimizer, model)
    tensors: List[torch.Tensor] = []

    def hollow(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor)
        return _Slot(tensor)

    # The state's structure travels as a small object, the tensors by tensor broadcasts.
    outline = _replace(state, torch.Tensor, hollow)
    groups = [len(g["params"]) for g in state["param_groups"]]
    root_outline, root_groups = ops.broadcast_object((outline, groups), root_rank,
                                                     "optimizer_state", process_set)
    problem: Optional[str] = None
    if groups != root_groups:
        problem = (f"the optimizer's parameter groups hold {groups} parameters, the root's "
                   f"(rank {root_rank}) {root_groups}; build the same optimizer on every rank")
    problems: List[Tuple[int, Optional[str]]] = ops.allgather_object(
        (rank(), problem), "optimizer_state.check", process_set)
    for who, text in problems:
        if text is not None:
            raise ValueError(f"broadcast_optimizer_state on rank {who}: {text}")
    if rank() != root_rank:
        tensors = []

        def receive(slot: _Slot) -> torch.Tensor:
            tensors.append(torch.empty(slot.shape, dtype=slot.dtype))
            return tensors[-1]

        root_state = _replace(root_outline, _Slot, receive)
    else:
        tensors = [t.detach().contiguous() for t in tensors]
    started = [ops.broadcast_async_(t, root_rank, f"optimizer_state.{i}", process_set)
               for i, t in enumerate(tensors)]
    for handle in started:
        ops.synchronize(handle)
    if rank() != root_rank:
        optimizer.load_state_dict(root_state)
