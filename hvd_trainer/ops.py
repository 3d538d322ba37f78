"""Named collectives on NumPy arrays, with Horovod's ops, scaling and argument checks.

Out-of-place functions return new arrays; the ``*_`` variants write into their argument,
which must then be C-contiguous and writeable. Out-of-place functions accept any strided
array (it is copied once into the result). Every call first checks that all ranks agree on
what they are doing (see diagnostics.py), so a disagreement raises on every rank; a caller
that has agreed on a whole series of calls runs them inside ``diagnostics.covered``.

Integer tensors reduce exactly; ``Average`` and fractional scale factors then truncate toward
zero, as C's integer division does. Boolean ``Sum`` is a logical or.
"""
import enum
import functools
import itertools
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import diagnostics, fusion, runtime
from .runtime import ProcessSet, global_process_set


class ReduceOp(enum.IntEnum):
    """Reduction operators, named as in Horovod."""

    AVERAGE = 0
    SUM = 1
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN,
                                   ReduceOp.MAX, ReduceOp.PRODUCT)
_BACKEND_OP = {ReduceOp.AVERAGE: "sum", ReduceOp.SUM: "sum", ReduceOp.MIN: "min",
               ReduceOp.MAX: "max", ReduceOp.PRODUCT: "prod"}
_SUPPORTED_KINDS = {"b", "i", "u", "f", "c"}
_counter = itertools.count()
_pool = fusion.BufferPool()


# -- argument checks ------------------------------------------------------------------------
def _check_array(tensor: Any, arg: str, inplace: bool = False) -> np.ndarray:
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"{arg} must be a numpy.ndarray, got {type(tensor).__name__} (CuPy "
                        "arrays go to allreduce(_), grouped_allreduce(_), allgather, "
                        "broadcast(_) and reducescatter)")
    if tensor.dtype.kind not in _SUPPORTED_KINDS or tensor.dtype.names is not None:
        raise TypeError(f"{arg} has dtype {tensor.dtype}, which collectives do not support; "
                        "use a boolean, integer, floating or complex dtype")
    if inplace and not (tensor.flags.c_contiguous and tensor.flags.writeable):
        raise ValueError(f"{arg} must be C-contiguous and writeable for an in-place collective; "
                         "pass np.ascontiguousarray(...) or use the out-of-place function")
    return tensor


def _check_op(op: Any) -> ReduceOp:
    try:
        return ReduceOp(op)
    except ValueError:
        valid = ", ".join(o.name.title() for o in ReduceOp)
        raise ValueError(f"op={op!r} is not a reduction operator; use one of {valid}") from None


def _check_root(root_rank: Any, comm) -> int:
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < comm.size:
        raise ValueError(f"root_rank={root_rank!r} is out of range; it must be an integer "
                         f"in 0..{comm.size - 1} for this process set")
    return int(root_rank)


def _gpu_twin(collective: Callable) -> Callable:
    """Send calls whose tensor (or first tensor) is a CuPy array to the collective of the same
    name in ``hvd_trainer.cuda``, which keeps the data on the GPU."""
    @functools.wraps(collective)
    def dispatch(tensor, *args, **kwargs):
        first = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
        if type(first).__module__.partition(".")[0] == "cupy":
            from . import cuda
            return getattr(cuda, collective.__name__)(tensor, *args, **kwargs)
        return collective(tensor, *args, **kwargs)
    return dispatch


def _name(kind: str, name: Optional[str]) -> str:
    return name if name is not None else f"{kind}.noname.{next(_counter)}"


def _describe(t: np.ndarray, name: str, dim0: bool = True) -> dict:
    shape = t.shape if dim0 else t.shape[1:]
    return {"name": name, "dtype": t.dtype.str, "shape": tuple(shape)}


def _scales(op: ReduceOp, comm, prescale: float, postscale: float) -> Tuple[float, float]:
    if op == ReduceOp.AVERAGE:
        # float() first: NumPy 2 would divide an np.float32 factor in float32.
        postscale = float(postscale) / comm.size
    return float(prescale), float(postscale)


# -- allreduce ------------------------------------------------------------------------------
def _grouped_allreduce_into(tensors: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
                            op: Any, name: Optional[str], prescale_factor: float,
                            postscale_factor: float, process_set: ProcessSet, kind: str) -> None:
    op = _check_op(op)
    comm = runtime.communicator(process_set)
    base = _name(kind, name)
    names = [base] if len(tensors) == 1 else [f"{base}.{i}" for i in range(len(tensors))]
    with diagnostics.span(base, "NEGOTIATE"):
        diagnostics.agree(comm, lambda: {
            "kind": kind, "name": base, "op": op.name, "prescale_factor": float(prescale_factor),
            "postscale_factor": float(postscale_factor),
            "tensors": [_describe(t, n) for t, n in zip(tensors, names)]})
    pre, post = _scales(op, comm, prescale_factor, postscale_factor)
    backend_op = _BACKEND_OP[op]

    def communicate(flat: np.ndarray) -> None:
        with diagnostics.span(base, "COMMUNICATE"):
            comm.allreduce(flat, backend_op)

    with diagnostics.span(base, "FUSE"):
        fusion.fused(tensors, outputs, _pool, runtime.fusion_threshold(), communicate, pre, post)


@_gpu_twin
def allreduce(tensor: np.ndarray, op: Any = Average, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``tensor`` across the process set's ranks; return the result as a new array."""
    _check_array(tensor, "tensor")
    out = np.empty(tensor.shape, tensor.dtype)
    _grouped_allreduce_into([tensor], [out], op, name, prescale_factor, postscale_factor,
                            process_set, "allreduce")
    return out


@_gpu_twin
def allreduce_(tensor: np.ndarray, op: Any = Average, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place :func:`allreduce`; returns ``tensor``."""
    _check_array(tensor, "tensor", inplace=True)
    _grouped_allreduce_into([tensor], [tensor], op, name, prescale_factor, postscale_factor,
                            process_set, "allreduce")
    return tensor


@_gpu_twin
def grouped_allreduce(tensors: Sequence[np.ndarray], op: Any = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Allreduce a list of tensors as one fused operation; return new arrays."""
    tensors = [_check_array(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    outs = [np.empty(t.shape, t.dtype) for t in tensors]
    _grouped_allreduce_into(tensors, outs, op, name, prescale_factor, postscale_factor,
                            process_set, "grouped_allreduce")
    return outs


@_gpu_twin
def grouped_allreduce_(tensors: Sequence[np.ndarray], op: Any = Average, name: Optional[str] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    tensors = [_check_array(t, f"tensors[{i}]", inplace=True) for i, t in enumerate(tensors)]
    _grouped_allreduce_into(tensors, tensors, op, name, prescale_factor, postscale_factor,
                            process_set, "grouped_allreduce")
    return list(tensors)


# -- allgather ------------------------------------------------------------------------------
@_gpu_twin
def allgather(tensor: np.ndarray, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0, which may differ per rank."""
    _check_array(tensor, "tensor")
    if tensor.ndim == 0:
        raise ValueError("tensor must have at least one dimension for allgather; "
                         "reshape a scalar to shape (1,)")
    comm = runtime.communicator(process_set)
    tensor = np.ascontiguousarray(tensor)
    name = _name("allgather", name)
    with diagnostics.span(name, "NEGOTIATE"):
        rows = diagnostics.agree_gather(
            comm, lambda: {"kind": "allgather", "name": name,
                           "tensors": [_describe(tensor, name, dim0=False)]},
            extra=tensor.shape[0])
    row = int(np.prod(tensor.shape[1:], dtype=np.int64))
    out = np.empty((sum(rows),) + tensor.shape[1:], tensor.dtype)
    with diagnostics.span(name, "COMMUNICATE"):
        comm.allgatherv(tensor.reshape(-1), out.reshape(-1), [r * row for r in rows])
    return out


def grouped_allgather(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Allgather each tensor of a list; return the gathered arrays in order."""
    base = _name("grouped_allgather", name)
    return [allgather(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]


# -- broadcast ------------------------------------------------------------------------------
@_gpu_twin
def broadcast_(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Overwrite ``tensor`` on every rank with the root rank's values; returns ``tensor``."""
    _check_array(tensor, "tensor", inplace=True)
    comm = runtime.communicator(process_set)
    root = _check_root(root_rank, comm)
    name = _name("broadcast", name)
    with diagnostics.span(name, "NEGOTIATE"):
        diagnostics.agree(comm, lambda: {"kind": "broadcast", "name": name, "root_rank": root,
                                         "tensors": [_describe(tensor, name)]})
    with diagnostics.span(name, "COMMUNICATE"):
        comm.broadcast(tensor.reshape(-1), root)
    return tensor


@_gpu_twin
def broadcast(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return a new array holding the root rank's ``tensor`` on every rank."""
    _check_array(tensor, "tensor")
    return broadcast_(np.array(tensor, order="C", copy=True), root_rank, name, process_set)


# -- alltoall -------------------------------------------------------------------------------
def alltoall(tensor: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set
             ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank i; gather what arrives.

    Without ``splits`` dim 0 is divided equally. As in Horovod, the received row counts are
    returned too (``(output, received_splits)``) only when ``splits`` is given.
    """
    _check_array(tensor, "tensor")
    if tensor.ndim == 0:
        raise ValueError("tensor must have at least one dimension for alltoall")
    comm = runtime.communicator(process_set)
    tensor = np.ascontiguousarray(tensor)
    rows = tensor.shape[0]
    if splits is None:
        if rows % comm.size:
            raise ValueError(f"tensor's first dimension ({rows}) is not divisible by the number "
                             f"of ranks ({comm.size}); pass splits=")
        send_rows = np.full(comm.size, rows // comm.size, np.int64)
    else:
        send_rows = np.asarray(splits, np.int64).reshape(-1)
        if send_rows.size != comm.size or (send_rows < 0).any() or send_rows.sum() != rows:
            raise ValueError(f"splits={send_rows.tolist()} must hold {comm.size} non-negative "
                             f"counts summing to the first dimension of tensor ({rows})")
    name = _name("alltoall", name)
    with diagnostics.span(name, "NEGOTIATE"):
        diagnostics.agree(comm, lambda: {"kind": "alltoall", "name": name,
                                         "tensors": [_describe(tensor, name, dim0=False)]})
        recv_rows = np.empty(comm.size, np.int64)
        comm.alltoallv(send_rows, [1] * comm.size, recv_rows, [1] * comm.size)
    row = int(np.prod(tensor.shape[1:], dtype=np.int64))
    out = np.empty((int(recv_rows.sum()),) + tensor.shape[1:], tensor.dtype)
    with diagnostics.span(name, "COMMUNICATE"):
        comm.alltoallv(tensor.reshape(-1), (send_rows * row).tolist(),
                       out.reshape(-1), (recv_rows * row).tolist())
    return out if splits is None else (out, recv_rows)


# -- reducescatter --------------------------------------------------------------------------
def _rows_per_rank(rows: int, size: int) -> List[int]:
    """Horovod's split of dim 0: as even as possible, the first ranks taking one extra row."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


@_gpu_twin
def reducescatter(tensor: np.ndarray, op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's share of dim 0's rows."""
    return grouped_reducescatter([tensor], op, name, process_set,
                                 prescale_factor, postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[np.ndarray], op: Any = Average,
                          name: Optional[str] = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[np.ndarray]:
    """:func:`reducescatter` on each tensor of a list, agreed on in one exchange."""
    op = _check_op(op)
    comm = runtime.communicator(process_set)
    tensors = [_check_array(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise ValueError(f"tensors[{i}] must have at least one dimension for reducescatter")
    base = _name("reducescatter", name)
    names = [base] if len(tensors) == 1 else [f"{base}.{i}" for i in range(len(tensors))]
    with diagnostics.span(base, "NEGOTIATE"):
        diagnostics.agree(comm, lambda: {
            "kind": "reducescatter", "name": base, "op": op.name,
            "prescale_factor": float(prescale_factor), "postscale_factor": float(postscale_factor),
            "tensors": [_describe(t, n) for t, n in zip(tensors, names)]})
    pre, post = _scales(op, comm, prescale_factor, postscale_factor)
    results = []
    for t in tensors:
        row = int(np.prod(t.shape[1:], dtype=np.int64))
        shares = _rows_per_rank(t.shape[0], comm.size)
        work = np.empty(t.size, t.dtype)
        fusion.pack([t], work, pre)
        with diagnostics.span(base, "COMMUNICATE"):
            mine = comm.reduce_scatter(work, [s * row for s in shares], _BACKEND_OP[op])
        out = np.empty((shares[comm.rank],) + t.shape[1:], t.dtype)
        fusion.unpack(mine, [out], post)
        results.append(out)
    return results


# -- objects --------------------------------------------------------------------------------
def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return the root rank's picklable ``obj`` on every rank."""
    comm = runtime.communicator(process_set)
    root = _check_root(root_rank, comm)
    name = _name("broadcast_object", name)
    with diagnostics.span(name, "NEGOTIATE"):
        diagnostics.agree(comm, lambda: {"kind": "broadcast_object", "name": name,
                                         "root_rank": root})
    with diagnostics.span(name, "COMMUNICATE"):
        return comm.broadcast_object(obj, root)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    comm = runtime.communicator(process_set)
    name = _name("allgather_object", name)
    with diagnostics.span(name, "NEGOTIATE"):
        diagnostics.agree(comm, lambda: {"kind": "allgather_object", "name": name})
    with diagnostics.span(name, "COMMUNICATE"):
        return comm.allgather_object(obj)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the process set arrives.

    It is an agreement exchange, so the stall inspector watches it; the (empty) flags keep it
    an exchange even inside ``diagnostics.covered``.
    """
    diagnostics.agree(runtime.communicator(process_set), lambda: {"kind": "barrier", "name": None},
                      flags=np.zeros(0, bool))
