"""MXNet's float16 casts for the core's fp16 compression and float16 ring sums.

NumPy 1.23 (the newest MXNet 1.9.1 imports with) converts float16 one element at a time, and
slowest on subnormals, which small gradients become; MXNet's ``Cast`` is vectorised.
:data:`KERNELS` runs it on NDArrays that share the arrays' memory (``from_numpy`` without a
copy) and adds two float16 arrays by widening both with it, adding in float32 with NumPy and
narrowing once: the correctly rounded sum, as every kernel gives (see backends/halves.py).
``benchmarks/fp16.py`` measures them against NumPy's.
"""
import mxnet as mx
import numpy as np

from ..backends import halves

# Below this many elements NumPy's loops win: sharing an array with MXNet costs microseconds.
_SHARED_MIN = 1 << 14


def _shared(array: np.ndarray) -> mx.nd.NDArray:
    """An NDArray on ``array``'s memory. ``from_numpy`` marks the array it is given
    read-only, so it gets a view of its own, and the caller's array stays writable."""
    return mx.nd.from_numpy(array.view(), zero_copy=True)


def _cast(src: np.ndarray, dst: np.ndarray) -> None:
    out = _shared(dst)
    mx.nd.Cast(_shared(src), dtype=dst.dtype.name, out=out)
    out.wait_to_read()


class Kernels(halves.Kernels):
    """MXNet's casts for float16 arrays of at least _SHARED_MIN elements; NumPy's for the
    rest (bfloat16 included: MXNet 1.9's CPU casts lack it)."""

    def narrow(self, src: np.ndarray, dst: np.ndarray) -> None:
        if dst.dtype != np.float16 or dst.size < _SHARED_MIN:
            return super().narrow(src, dst)
        _cast(src, dst)

    def widen(self, src: np.ndarray, dst: np.ndarray) -> None:
        if src.dtype != np.float16 or src.size < _SHARED_MIN:
            return super().widen(src, dst)
        _cast(src, dst)

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        if a.dtype != np.float16 or a.size < _SHARED_MIN:
            return super().add(a, b, out)
        wide_a, wide_b = np.empty(a.size, np.float32), np.empty(b.size, np.float32)
        _cast(a, wide_a)
        _cast(b, wide_b)
        np.add(wide_a, wide_b, out=wide_a)
        _cast(wide_a, out)


KERNELS = Kernels()
