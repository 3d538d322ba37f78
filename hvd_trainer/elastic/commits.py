"""The commit format: a state's snapshot as one pickle plus a region that holds its arrays.

A commit copies arrays (NumPy's, and the tensor types adapters register with
:func:`register_array_type`) into one aligned region instead of pickling them, and pickles
the rest of the snapshot with references into that region; loading rebuilds each array from
its bytes. The payload (:class:`Commit`) is what the store signs and writes.
"""
import io
import pickle
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np


_ALIGN = 64  # each array of a commit's region starts at a multiple of this many bytes
class _ArrayType(NamedTuple):
    name: str
    describe: Callable[[Any], Optional[Tuple[int, Any]]]
    copy: Callable[[Any, Any, np.ndarray], None]
    rebuild: Callable[[np.ndarray, Any], Any]


_ARRAY_TYPES: Dict[type, _ArrayType] = {}
_ARRAY_NAMES: Dict[str, _ArrayType] = {}


def register_array_type(cls: type, name: str,
                        describe: Callable[[Any], Optional[Tuple[int, Any]]],
                        copy: Callable[[Any, Any, np.ndarray], None],
                        rebuild: Callable[[np.ndarray, Any], Any]) -> None:
    """Let commits copy objects of exactly type ``cls`` (a framework's tensor) into their
    memory instead of pickling them. ``describe(obj)`` gives its size in bytes and what
    ``rebuild`` needs (picklable), or None to pickle ``obj`` as usual; ``copy(obj, meta, out)``
    copies its bytes into ``out``, a uint8 NumPy array of that size; ``rebuild(data, meta)``
    makes a new object from such bytes (``data`` is its own). ``name`` stands for the type
    in the commit."""
    kind = _ArrayType(name, describe, copy, rebuild)
    _ARRAY_TYPES[cls] = _ARRAY_NAMES[name] = kind


def _describe_array(array: np.ndarray) -> Optional[Tuple[int, Any]]:
    # Objects, and the Fortran order that pickle keeps, are pickled as usual.
    if array.dtype.hasobject or array.nbytes == 0 or (
            array.flags.f_contiguous and not array.flags.c_contiguous):
        return None
    return array.nbytes, (array.dtype, array.shape)


def _copy_array(array: np.ndarray, meta: Any, out: np.ndarray) -> None:
    np.copyto(out.view(meta[0]).reshape(meta[1]), array)


register_array_type(np.ndarray, "numpy", _describe_array, _copy_array,
                    lambda data, meta: data.view(meta[0]).reshape(meta[1]))


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def aligned_empty(size: int) -> np.ndarray:
    """``size`` bytes of new memory that start at a multiple of _ALIGN."""
    raw = np.empty(size + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + size]


class Pickler(pickle.Pickler):
    """Pickles a snapshot with the arrays of registered types left out: each becomes a
    reference (type name, offset, bytes, meta) to its place in the commit's region, and
    :attr:`arrays` lists what to copy there. An array met twice is one reference."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arrays: List[Tuple[_ArrayType, Any, Tuple[str, int, int, Any]]] = []
        self.size = 0  # bytes of the region
        self._refs: Dict[int, Tuple[str, int, int, Any]] = {}

    def persistent_id(self, obj: Any) -> Optional[Tuple[str, int, int, Any]]:
        kind = _ARRAY_TYPES.get(type(obj))
        if kind is None:
            return None
        ref = self._refs.get(id(obj))
        if ref is None:
            described = kind.describe(obj)
            if described is None:
                return None
            nbytes, meta = described
            ref = self._refs[id(obj)] = (kind.name, self.size, nbytes, meta)
            self.arrays.append((kind, obj, ref))
            self.size += _aligned(nbytes)
        return ref


class _Unpickler(pickle.Unpickler):
    """Loads what :class:`Pickler` pickled, each array rebuilt (once) from its own copy of
    its bytes in the region."""

    def __init__(self, pickled: Any, region: Any):
        super().__init__(io.BytesIO(pickled))
        self.region = region
        self._made: Dict[int, Any] = {}

    def persistent_load(self, ref: Tuple[str, int, int, Any]) -> Any:
        name, offset, nbytes, meta = ref
        if offset not in self._made:
            kind = _ARRAY_NAMES.get(name)
            if kind is None:
                raise ValueError(f"the commit holds arrays of type {name!r}; import its adapter "
                                 f"(hvd_trainer.{name}) before restoring")
            data = np.frombuffer(self.region, np.uint8, nbytes, offset).copy()
            self._made[offset] = kind.rebuild(data, meta)
        return self._made[offset]


class Commit:
    """One commit: the pickle of a snapshot and the region that holds its arrays.

    Its payload (what is signed and written) is the pickle, zeros up to a multiple of
    _ALIGN, the region, and the pickle's length in 8 bytes; a payload without arrays is a
    plain pickle followed by that length."""

    def __init__(self, pickled: Any, region: Any = b""):
        self.pickled, self.region = pickled, region

    def parts(self) -> List[Any]:
        """The payload, in pieces (nothing is joined)."""
        length = memoryview(self.pickled).nbytes
        return [self.pickled, bytes(_aligned(length) - length), self.region,
                length.to_bytes(8, "big")]

    @classmethod
    def from_payload(cls, payload: Any) -> "Commit":
        """The commit of a payload (verified before: it is the job's own); ValueError when
        its layout does not hold together."""
        view = memoryview(payload).cast("B")
        length = int.from_bytes(view[-8:], "big") if view.nbytes >= 8 else -1
        if length < 0 or _aligned(length) > view.nbytes - 8:
            raise ValueError("the commit's layout is damaged")
        return cls(view[:length], view[_aligned(length):view.nbytes - 8])

    def load(self) -> Any:
        return _Unpickler(self.pickled, self.region).load()
