"""The bytes of a checkpoint: a header, a format version and a digest before the pickle; and
optimizer states with the reducer's state (compression residuals) attached, as one value.

A checkpoint's digest is checked before anything in it is unpickled, so a file that is not a
checkpoint, or a truncated or altered one, is refused without running code from it. (The
digest is no signature: anyone who may write the file may write a valid one, so checkpoints
are as trusted as the folder they are kept in; docs/security.md.) Plain optimizer states
(what ``gluon.Trainer`` writes) pass through unchanged, so a file without residuals stays
readable by the framework itself.

The collective side of a checkpoint is here too: one rank of the process set writes or reads
the file, every member learns the outcome (so an error raises on all of them) and each gets
its own compression residuals; the weights and optimizer states come from and go to the
adapter through callables.
"""
import hashlib
import os
import pickle
import stat
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..runtime import files, runtime
from ..collectives import objects
from . import hook_state
from .reducer import Reducer

_MAGIC = b"hvd_trainer residuals 1\n"
_HEADER = b"hvd_trainer checkpoint\n"
FORMAT_VERSION = 2  # 1 was a bare pickle
_FORMAT = "hvd_trainer checkpoint 1"  # the payload's own mark, inside the file format
# The header and room for the version's line: read and checked before the rest of a file.
_HEAD_BYTES = len(_HEADER) + 21
# Errors that keep their class when a checkpoint's outcome reaches the other ranks; anything
# else arrives as a RuntimeError naming the original class.
_CARRIED_TYPES = {cls.__name__: cls for cls in (OSError, ValueError, TypeError, MemoryError)}


def pack(checkpoint: Any) -> bytes:
    """The file's bytes for ``checkpoint``: header, format version, SHA-256 of the pickle,
    the pickle."""
    try:
        body = pickle.dumps(checkpoint, pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a lambda, a local class, an open file...
        raise ValueError(f"the checkpoint cannot be pickled ({type(e).__name__}: {e}); pass "
                         "an extra= that pickle can save (module-level classes and "
                         "functions, no lambdas or open files)") from e
    return _HEADER + b"%d\n" % FORMAT_VERSION + hashlib.sha256(body).digest() + body


def is_checkpoint(data: bytes) -> bool:
    """Whether ``data`` starts like a checkpoint that :func:`pack` wrote (before any check)."""
    return data.startswith(_HEADER)


def read_file(fname: str) -> bytes:
    """The bytes of the regular file ``fname``, read up to the size it had when opened (a
    device such as /dev/zero, or a pipe, has no end to read to: ValueError)."""
    with open(fname, "rb") as f:
        return _read_rest(f, fname, b"")


def _read_rest(f: Any, fname: str, head: bytes) -> bytes:
    """``head`` (read from ``f`` already) and the rest of the regular file ``f``."""
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{fname!r} is not a regular file; give the path of a file that "
                         "save_checkpoint() or save_states() wrote")
    return head + f.read(max(info.st_size - len(head), 0))


def read_checkpoint(fname: str) -> bytes:
    """The bytes of the checkpoint ``fname``: its header is read and checked first
    (:func:`check_header`), then the rest, up to the file's size."""
    with open(fname, "rb") as f:
        head = f.read(_HEAD_BYTES)
        check_header(head, fname)
        return _read_rest(f, fname, head)


def check_header(data: bytes, fname: str) -> None:
    """ValueError naming ``fname`` unless ``data`` starts with a whole header of this
    format's version."""
    if not is_checkpoint(data):
        if data and _HEADER.startswith(data):
            raise ValueError(f"{fname!r} is a truncated checkpoint: it ends inside its header "
                             f"({len(data)} bytes); load an intact copy")
        raise ValueError(f"{fname!r} is not a DistributedTrainer checkpoint (it has no "
                         "checkpoint header); write one with trainer.save_checkpoint()")
    version, newline, _ = data[len(_HEADER):_HEAD_BYTES].partition(b"\n")
    if not newline and len(data) < _HEAD_BYTES:
        raise ValueError(f"{fname!r} is a truncated checkpoint: it ends inside its header "
                         f"({len(data)} bytes); load an intact copy")
    if not newline or version != b"%d" % FORMAT_VERSION:
        raise ValueError(f"{fname!r} is a checkpoint of format {version[:20]!r}, this "
                         f"hvd_trainer reads format {FORMAT_VERSION}; write it again with "
                         "this version's trainer.save_checkpoint()")


def unpack(data: bytes, fname: str) -> Any:
    """What :func:`pack` packed, once the header, the version and the digest are right;
    ValueError naming ``fname`` and what is wrong otherwise, before anything is unpickled."""
    check_header(data, fname)
    rest = data[len(_HEADER):].partition(b"\n")[2]
    size = hashlib.sha256().digest_size
    digest, body = rest[:size], rest[size:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError(f"{fname!r} is damaged: its digest does not match its contents "
                         "(truncated or altered); load an intact copy")
    try:
        return pickle.loads(body)
    except Exception as e:  # noqa: BLE001 - e.g. a class the saving script defined
        raise ValueError(f"{fname!r} holds a value that cannot be unpickled here "
                         f"({type(e).__name__}: {e}); load it where the classes and functions "
                         "in its extra= value can be imported (one defined in the saving "
                         "script's __main__ must be defined in the loading script too)") from e


def attach_residuals(states: bytes, residuals: Any) -> bytes:
    """Optimizer states with the residuals (any picklable value: every rank's, with the
    settings they belong to) appended; ``states`` alone when None."""
    if residuals is None:
        return states
    return _MAGIC + pickle.dumps((states, residuals), pickle.HIGHEST_PROTOCOL)


def detach_residuals(data: bytes) -> Tuple[bytes, Any]:
    """Split what :func:`attach_residuals` wrote; plain optimizer states have no residuals."""
    if not data.startswith(_MAGIC):
        return data, None
    return pickle.loads(data[len(_MAGIC):])


def save(fname: str, reducer: Reducer, weights: Callable[[], List[np.ndarray]],
         states: Callable[[], bytes], extra: Any) -> None:
    """Write a checkpoint of ``weights()``, the optimizer ``states()`` with every member's
    residuals (gathered to the set's first rank alone) and ``extra`` to ``fname``, on the
    first rank of the reducer's process set (or locally, on a rank outside it). A collective
    over the set; a write error raises OSError on every member."""
    member = reducer.process_set.included()
    residuals = hook_state.gather(reducer, f"{reducer.prefix}residuals") if member else None

    def build() -> bytes:
        return pack({"format": _FORMAT, "weights": weights(),
                     "states": attach_residuals(states(), residuals), "extra": extra})

    _write_on_root(fname, build, reducer.process_set, f"{reducer.prefix}save_checkpoint")


def load(fname: str, reducer: Reducer, shapes: Sequence[Tuple[int, ...]],
         names: Sequence[str], restore: Callable[[List[np.ndarray], bytes], None]) -> Any:
    """Read the checkpoint :func:`save` wrote on the set's first rank, check its weights
    against the parameters' ``shapes`` (``names`` name them in errors), ``restore(weights,
    states)`` on every member, give each member its residuals, and return ``extra``.
    A collective over the set (local on a rank outside it)."""
    process_set = reducer.process_set
    checkpoint, residuals = _read_on_root(fname, process_set, f"{reducer.prefix}load_checkpoint")
    weights = checkpoint["weights"]
    if len(weights) != len(shapes):
        raise ValueError(f"{fname!r} holds {len(weights)} parameters, this trainer has "
                         f"{len(shapes)}; load it into the model that saved it")
    for i, (shape, name, values) in enumerate(zip(shapes, names, weights)):
        if tuple(shape) != values.shape:
            raise ValueError(f"parameter {i} ({name!r}) has shape {tuple(shape)}, the "
                             f"checkpoint's has {values.shape}; load it into the model "
                             "that saved it")
    restore(weights, checkpoint["states"])
    if process_set.included():
        hook_state.scatter(reducer, residuals, f"{reducer.prefix}residuals")
    return checkpoint["extra"]


def _writes(process_set: Any) -> bool:
    """Whether this process touches the file of a checkpoint: the set's first rank, or a
    rank outside the set (for which checkpoints are local)."""
    return not process_set.included() or process_set.rank() == 0


class _Failure(NamedTuple):
    """An error of the rank that touched a checkpoint's file, as the other members get it."""

    kind: str  # the error's class name
    message: str

    @classmethod
    def of(cls, error: Exception, fname: str, doing: str) -> "_Failure":
        """``error`` as it travels: OSError names the rank and what it could not do."""
        if isinstance(error, OSError):
            return cls("OSError", f"rank {runtime.rank()} could not {doing} {fname!r}: {error}")
        return cls(type(error).__name__, str(error))

    def error(self) -> Exception:
        """The error every member raises: of the original class where it is one of
        ``_CARRIED_TYPES``, else a RuntimeError naming it."""
        cls = _CARRIED_TYPES.get(self.kind)
        if cls is None:
            return RuntimeError(f"{self.kind}: {self.message}")
        return cls(self.message)


def _raise(failure: Optional[_Failure], original: Optional[Exception]) -> None:
    """Raise ``failure`` (if any) on this member, chained to ``original`` where this rank
    had it."""
    if failure is not None:
        raise failure.error() from original


def _write_on_root(fname: str, build: Callable[[], bytes], process_set: Any, name: str) -> None:
    """The set's first rank writes ``build()`` atomically to ``fname``; every member returns
    after that, or raises the error if it failed (any error: OSError naming the file and
    the rank, ValueError for what cannot be pickled...).

    The outcome travels by allgather, which does not depend on how a root is numbered.
    """
    failure, original = None, None
    if _writes(process_set):
        try:
            files.write_atomically(fname, build())
        except Exception as e:  # noqa: BLE001 - every member raises it
            failure, original = _Failure.of(e, fname, "write"), e
    if process_set.included():
        outcomes = objects.allgather_object(failure, name, process_set)
        failure = next((f for f in outcomes if f is not None), None)
    _raise(failure, original)


def _read_on_root(fname: str, process_set: Any, name: str) -> Tuple[Dict[str, Any], Any]:
    """The set's first rank reads ``fname``, checks it (header first, digest before
    unpickling) and every member gets the checkpoint less the residuals, which stay on the
    reading rank (returned there, None elsewhere). Any error raises on all members: OSError
    for a file that cannot be read, ValueError for one that is no intact checkpoint or holds
    what cannot be unpickled here."""
    checkpoint, failure, original, residuals = None, None, None, None
    writes = _writes(process_set)
    if writes:
        try:
            checkpoint, residuals = _without_residuals(read_checkpoint(fname), fname)
        except Exception as e:  # noqa: BLE001 - every member raises it
            failure, original = _Failure.of(e, fname, "read"), e
    if process_set.included():
        checkpoint, failure = objects.allgather_object((checkpoint, failure) if writes else None,
                                                       name, process_set)[0]
    _raise(failure, original)
    return checkpoint, residuals


def _without_residuals(data: bytes, fname: str) -> Tuple[Dict[str, Any], Any]:
    """The checkpoint in a file's bytes, verified, with the residuals taken out of its states,
    and the residuals; ValueError when it is no intact checkpoint."""
    checkpoint = unpack(data, fname)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != _FORMAT:
        raise ValueError(f"{fname!r} is not a DistributedTrainer checkpoint; write one with "
                         "trainer.save_checkpoint()")
    checkpoint["states"], residuals = detach_residuals(checkpoint["states"])
    return checkpoint, residuals


def check_states(loaded: Any, fname: str, shapes: Sequence[Tuple[int, ...]],
                 names: Sequence[str], optimizer: Any) -> None:
    """Refuse optimizer states in Gluon's form (``(states, optimizer)`` or ``states``, a dict
    by parameter index) that another model or optimizer wrote, naming what differs: indices
    past the parameters (of ``shapes``, named ``names``), a state whose shape is not its
    parameter's, another optimizer class than ``optimizer``'s."""
    states, saved = loaded if isinstance(loaded, tuple) and len(loaded) == 2 else (loaded, None)
    fix = "load states that this model and optimizer saved"
    if not isinstance(states, dict) or not all(isinstance(i, int) for i in states):
        raise ValueError(f"{fname!r} does not hold Gluon optimizer states (a dict by "
                         f"parameter index); {fix}")
    outside = sorted(i for i in states if not 0 <= i < len(shapes))
    if outside:
        raise ValueError(f"{fname!r} holds states of {len(states)} parameters, up to index "
                         f"{max(states)}; this trainer has {len(shapes)} parameters; {fix}")
    if saved is not None and type(saved) is not type(optimizer):
        raise ValueError(f"{fname!r} holds states of optimizer {type(saved).__name__}, "
                         f"this trainer's is {type(optimizer).__name__}; {fix}")
    for i, state in sorted(states.items()):
        for shape in _state_shapes(state):
            if tuple(shape) != tuple(shapes[i]):
                raise ValueError(f"{fname!r}: the state of parameter {i} ({names[i]!r}) "
                                 f"has shape {tuple(shape)}, the parameter "
                                 f"{tuple(shapes[i])}; {fix}")


def _state_shapes(state: Any) -> List[Tuple[int, ...]]:
    """The shapes of the arrays in one parameter's optimizer state (None, an array, or
    nested tuples and lists of them)."""
    if isinstance(state, (tuple, list)):
        return [shape for part in state for shape in _state_shapes(part)]
    return [tuple(state.shape)] if hasattr(state, "shape") else []
