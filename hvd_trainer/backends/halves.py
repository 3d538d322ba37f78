"""Conversions and sums of the 16-bit floats (float16, and ml_dtypes' bfloat16) on host arrays.

The ring sums 16-bit buffers with :meth:`Kernels.add` and fp16 compression converts with
:meth:`Kernels.narrow` and :meth:`Kernels.widen`. Every sum of two 16-bit values is computed in
float32 and rounded once to the 16-bit type, round to nearest even: float32 holds more than
twice their significand bits plus two, so that result is the correctly rounded 16-bit sum,
whatever kernel computes it (NumPy's, a framework's vectorised one, Horovod's float16 sum).

This class runs NumPy's loops, which convert one element at a time (ml_dtypes' for
bfloat16). A framework adapter hands down a subclass that runs its framework's vectorised
kernels on views of the same memory (see ``hvd_trainer.torch.compression``); this module never
imports a framework.
"""
import numpy as np


def is_half(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (ml_dtypes', recognised by its name)."""
    return dtype == np.float16 or dtype.name == "bfloat16"


class Kernels:
    """NumPy's kernels for 16-bit floats; subclasses override all three with faster ones.

    Arrays are flat and C-contiguous; ``dst`` and ``out`` may not overlap the inputs unless
    they are the same array.
    """

    def narrow(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Write ``src`` (float32) into the 16-bit ``dst``, rounded to nearest even."""
        np.copyto(dst, src, casting="unsafe")

    def widen(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Write the 16-bit ``src`` into the float32 ``dst`` (exact)."""
        np.copyto(dst, src, casting="unsafe")

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """``out = a + b`` for 16-bit arrays of one dtype, summed in float32 and rounded once."""
        # NumPy widens a buffer of a few thousand elements at a time, so the float32
        # intermediates stay in cache.
        np.add(a, b, out=out, dtype=np.float32)


NUMPY = Kernels()
