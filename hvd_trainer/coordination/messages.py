"""What every rank raises when an agreement fails, and the texts that say why.

**Argument errors are collective.** A collective runs its argument checks inside
:meth:`~.agreement.Call.checks`; a check that fails on one rank does not raise there at once
but travels in the agreement (as a description that cannot match), so every rank raises it,
naming the rank, with its own type (:func:`carried`). Descriptions that differ raise
:class:`MismatchError` on every rank, naming what differs and on which ranks
(:func:`describe_mismatch`); a call a joined rank cannot serve raises why
(:func:`refusal_while_joined`).
"""
from typing import Any, Dict, Optional, Sequence, Tuple

from ..runtime import runtime
from ..backends import Communicator


# What a joined rank serves (with zeros, or nothing to send): the other kinds raise.
_SERVED_WHILE_JOINED = ("allreduce", "grouped_allreduce", "adasum", "barrier", "trainer step")
# Argument errors that travel to every rank keep their type; anything else is a RuntimeError.
_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


def carried(cls: type) -> type:
    """Class decorator: an argument error of ``cls`` (a ValueError or TypeError subclass)
    that one rank finds is raised as ``cls`` on every rank, not as its base class."""
    _ERROR_TYPES[cls.__name__] = cls
    return cls


class MismatchError(RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank alike."""


_dual_classes: Dict[Tuple[type, type], type] = {}


def also_raised_as(error: Exception, base: type, prefix: str, module: str) -> Exception:
    """``error`` as an instance of a class deriving from both ``base`` (a framework's error,
    e.g. MXNetError) and the error's own class, with the same message and fields, so that
    ``except base`` and ``except ValueError`` (say) both catch it; ``error`` itself if it
    already is a ``base``. The class is named ``prefix`` + its own name, in ``module``."""
    cls = type(error)
    if issubclass(cls, base):
        return error
    dual = _dual_classes.get((base, cls))
    if dual is None:
        dual = _dual_classes[(base, cls)] = type(f"{prefix}{cls.__name__}", (base, cls), {
            "__module__": module,
            "__doc__": f"A {cls.__name__} that is also a {base.__name__}."})
    translated = dual.__new__(dual)
    translated.args = error.args
    translated.__dict__.update(error.__dict__)
    return translated


def _argument_error(comm: Communicator,
                    every: Sequence[Optional[Dict[str, Any]]]) -> Optional[Exception]:
    """The first rank's argument error in ``every`` (None: a joined rank), if any."""
    for r, d in enumerate(every):
        if d is not None and "error" in d:  # the first rank's argument error wins everywhere
            kind, message = d["error"]
            what = f"{d.get('kind', 'collective')} {d.get('name')!r}"
            return _ERROR_TYPES.get(kind, RuntimeError)(
                f"{what} on rank {runtime.world_rank(comm, r)}: {message}")
    return None


def failure_for(comm: Communicator, every: Sequence[Optional[Dict[str, Any]]]) -> Exception:
    """What every rank raises for a call whose descriptions ``every`` differ."""
    return _argument_error(comm, every) or MismatchError(describe_mismatch(every))


def raise_argument_error(comm: Communicator, every: Sequence[Optional[Dict[str, Any]]]) -> None:
    """Raise the first rank's argument error in ``every``, if any."""
    error = _argument_error(comm, every)
    if error is not None:
        raise error


def refusal_while_joined(description: Dict[str, Any]) -> Optional[str]:
    """Why a joined rank cannot serve the call ``description`` describes (None if it can)."""
    kind = description.get("kind")
    if kind not in _SERVED_WHILE_JOINED:
        hint = ("; a DistributedOptimizer or trainer with sparse gradients or packed "
                "compression reduces by allgather: pass sparse_as_dense=True, and "
                "compression=Compression.none or fp16" if kind == "allgather" else "")
        return (f"a joined rank serves only allreduce, grouped_allreduce (Adasum included), "
                f"barrier and the gradient steps of DistributedOptimizer and "
                f"DistributedTrainer, as in Horovod, whose join refuses allgather, broadcast, "
                f"alltoall and reducescatter; make this call before join() on every rank"
                f"{hint}")
    if any(t.get("memory", "host") != "host" for t in description.get("tensors", ())):
        return "a joined rank serves host (NumPy, CPU tensor) arrays only, not GPU arrays"
    return None


def first_of(values: Sequence[Any]) -> Any:
    """The first of ``values`` (a round's lists and verdicts are read from their heads)."""
    return values[0]


def _any_differs(values: Sequence[Any]) -> bool:
    return any(v != values[0] for v in values)


def _by_rank(ranks: Sequence[int], values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))


def _missing_tensors(ranks: Sequence[int], every: Sequence[Dict[str, Any]]) -> Optional[str]:
    """'tensor 'x' is missing on rank 1' for tensors named on some ranks and not on others."""
    names = [[t.get("name") for t in d.get("tensors", ())] for d in every]
    notes = []
    for name in dict.fromkeys(n for per_rank in names for n in per_rank):
        absent = [r for r, per_rank in zip(ranks, names) if name not in per_rank]
        if absent:
            where = ", ".join(str(r) for r in absent)
            notes.append(f"tensor {name!r} is missing on rank{'s' if len(absent) > 1 else ''} "
                         f"{where}")
    return "; ".join(notes) if notes else None


def describe_mismatch(given: Sequence[Optional[Dict[str, Any]]]) -> str:
    """One message naming the first field (and tensor) on which the ranks' descriptions differ
    (``given`` by rank; None for a joined rank, which made no call)."""
    ranks = [r for r, d in enumerate(given) if d is not None]
    every = [d for d in given if d is not None]
    first = every[0]
    what = f"{first.get('kind', 'collective')} {first.get('name')!r}"
    for field in dict.fromkeys(key for d in every for key in d):
        if field in ("tensors", "flags"):
            continue
        values = [d.get(field) for d in every]
        if _any_differs(values):
            return f"{what}: ranks disagree on {field} ({_by_rank(ranks, values)})"
    counts = [len(d.get("tensors", ())) for d in every]
    if _any_differs(counts):
        missing = _missing_tensors(ranks, every)
        detail = f"; {missing}" if missing else ""
        return (f"{what}: ranks disagree on the number of tensors ({_by_rank(ranks, counts)})"
                f"{detail}")
    for i, tensor in enumerate(first.get("tensors", ())):
        for field in tensor:
            values = [d["tensors"][i][field] for d in every]
            if _any_differs(values):
                return (f"{what}: ranks disagree on {field} of tensor {i} "
                        f"{tensor.get('name')!r} ({_by_rank(ranks, values)})")
    values = [d.get("flags") for d in every]
    if _any_differs(values):
        return f"{what}: ranks disagree on the number of flags ({_by_rank(ranks, values)})"
    return f"{what}: ranks disagree ({_by_rank(ranks, every)})"
