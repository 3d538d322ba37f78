"""The torch and MXNet adapters' 16-bit kernels against NumPy's casts and float32 sums
(ml_dtypes' for bfloat16), bit for bit except NaN payloads, on odd lengths (below and above
the MXNet kernels' NumPy threshold) and every kind of value."""
import ml_dtypes
import numpy as np
import pytest

from hvd_trainer.mxnet import halves as mxnet_halves
from hvd_trainer.torch import compression as torch_compression

DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
LENGTHS = [1, 7, 4097, 100003]


@pytest.fixture(params=["torch", "mxnet"])
def kernels(request):
    return {"torch": torch_compression.KERNELS, "mxnet": mxnet_halves.KERNELS}[request.param]


def values(n, seed, dtype):
    rng = np.random.RandomState(seed)
    top = 17 if dtype == np.float16 else 128
    x = (rng.standard_normal(n) * 2.0 ** rng.uniform(-40, top, n)).astype(np.float32)
    specials = np.array([np.inf, -np.inf, np.nan, -0.0, 65504, 65520, 65519.996,
                         2.0 ** -25, 2.0 ** -24 * 1.5, 3.4e38, 1e-45], np.float32)
    x[:min(n, specials.size)] = specials[:n]
    # Exact ties between two 16-bit neighbours in [0.5, 1), whose spacing is 2^-bits: round
    # to even must pick the even one.
    bits = 11 if dtype == np.float16 else 8
    ties = (rng.randint(1 << (bits - 1), 1 << bits, n) + 0.5).astype(np.float32) * 2.0 ** -bits
    x[specials.size::3] = ties[specials.size::3]
    return x


def assert_same(got, want):
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    bits = got.view(f"u{got.itemsize}")[~nan], want.view(f"u{want.itemsize}")[~nan]
    assert np.array_equal(*bits), np.flatnonzero(bits[0] != bits[1])[:5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_narrow_rounds_to_nearest_even(kernels, dtype, n):
    x = values(n, n, dtype)
    out = np.empty(n, dtype)
    kernels.narrow(x, out)
    assert_same(out, x.astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_widen_is_exact(kernels, dtype, n):
    h = values(n, n + 1, dtype).astype(dtype)
    out = np.empty(n, np.float32)
    kernels.widen(h, out)
    assert_same(out, h.astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_add_rounds_the_float32_sum_once(kernels, dtype, n):
    a = values(n, n + 2, dtype).astype(dtype)
    b = values(n, n + 3, dtype).astype(dtype)
    out = np.empty(n, dtype)
    with np.errstate(all="ignore"):  # inf - inf and overflow, on purpose
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
        kernels.add(a, b, out)
        assert_same(out, want)
        kernels.add(a, b, a)  # in place, as the ring sums into its own buffer
    assert_same(a, want)


def test_read_only_arrays_are_read_alike(kernels):
    """torch cannot share a read-only array (NumPy's kernels take it); MXNet can."""
    n = 100003
    x = values(n, 5, np.float16)
    h = x.astype(np.float16)
    x.flags.writeable = h.flags.writeable = False
    narrowed, widened, summed = np.empty(n, np.float16), np.empty(n, np.float32), \
        np.empty(n, np.float16)
    kernels.narrow(x, narrowed)
    kernels.widen(h, widened)
    with np.errstate(all="ignore"):
        kernels.add(h, h, summed)
        want = (h.astype(np.float32) * 2).astype(np.float16)
    assert_same(narrowed, h)
    assert_same(widened, h.astype(np.float32))
    assert_same(summed, want)
