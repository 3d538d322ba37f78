"""16-bit float sums in the ring and fp16 compression in the reducer, on NumPy's kernels and on
torch's (the torch adapter's), against NumPy computed by hand.

The reference follows the ring's order: chunk c of the buffer (NumPy's array_split of it into
one chunk per rank) starts at rank c + 1 and collects ranks c + 2, ..., c in turn, each sum
computed in float32 and rounded to the 16-bit type. Every rank derives every rank's inputs from
the seed. Inputs span the 16-bit types' subnormals, overflow, infinities, NaN and -0; lengths
leave chunks of unequal size, and empty ones on 3 ranks.
Prints "rank R CASE: ok" per case; cases are named on the command line (all by default).
"""
import sys

import ml_dtypes
import numpy as np

import hvd_trainer
from hvd_trainer.collectives import arguments, ops
from hvd_trainer.backends.halves import NUMPY
from hvd_trainer.compression import Compression
from hvd_trainer.collectives.memory import KernelMemory
from hvd_trainer.training.buckets import Gradient
from hvd_trainer.training.reducer import Reducer
from hvd_trainer.torch.compression import KERNELS as TORCH

hvd_trainer.init()
np.seterr(all="ignore")  # inf - inf and overflow, on purpose (the ring warns as NumPy does)
R, N = hvd_trainer.rank(), hvd_trainer.size()
BF16 = np.dtype(ml_dtypes.bfloat16)
LENGTHS = [1, 2, 5, 1001, 65537, 3 * 65536 + 1]
KERNELS = {"numpy": NUMPY, "torch": TORCH}
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}


def inputs(rank, n, dtype, salt=0):
    """Rank ``rank``'s float32 values of length ``n``: wide exponents and the special values."""
    rng = np.random.RandomState(1000 * rank + 7 * n + salt)
    top = 12 if dtype == np.float16 else 100
    x = (rng.standard_normal(n) * 2.0 ** rng.uniform(-30, top, n)).astype(np.float32)
    specials = [np.inf, -np.inf, np.nan, 65504.0, -0.0, 2.0 ** -24, 3e38, 1e-40]
    x[:min(n, len(specials))] = specials[:n]
    return np.roll(x, rank)  # each rank's specials at other positions


def ring_sum(parts, dtype):
    """The ring's sum of each rank's 16-bit ``parts``, by hand (see the module docstring)."""
    bounds = np.cumsum([0] + [c.size for c in np.array_split(parts[0], N)])
    out = np.empty(parts[0].size, dtype)
    for c in range(N):
        a, b = bounds[c], bounds[c + 1]
        acc = parts[(c + 1) % N][a:b]
        for k in range(2, N + 1):
            acc = (acc.astype(np.float32) + parts[(c + k) % N][a:b].astype(np.float32)).astype(dtype)
        out[a:b] = acc
    return out


def same(got, want, what):
    # Equal bits except NaN payloads: a NaN must be a NaN of either sign.
    g = got.astype(np.float32)
    w = want.astype(np.float32)
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"rank {R} {what}: NaN positions differ"
    keep = ~np.isnan(w)
    assert np.array_equal(got.view(np.uint16)[keep], want.view(np.uint16)[keep]), \
        f"rank {R} {what}: first difference at {np.flatnonzero(got.view(np.uint16)[keep] != want.view(np.uint16)[keep])[:5]}"


def ring_case(kernels, name):
    dtype = DTYPES[name]

    def run():
        memory = KernelMemory(KERNELS[kernels])
        for n in LENGTHS:
            parts = [inputs(r, n, dtype).astype(dtype) for r in range(N)]
            got = ops.reduce_group(memory, [parts[R].copy()], arguments.Sum, None,
                                   kind="allreduce", inplace=True)[0]
            same(got, ring_sum(parts, dtype), f"{kernels} {name} sum of {n}")
    return run


def torch_api_case(name):
    """hvd_trainer.torch's allreduce and grouped_allreduce_ with op=Sum on CPU tensors."""
    import torch
    import hvd_trainer.torch as hvd
    dtype = DTYPES[name]
    kind = {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]

    def run():
        for n in LENGTHS:
            parts = [inputs(r, n, dtype, 1).astype(dtype) for r in range(N)]
            mine = torch.from_numpy(parts[R].view(np.int16)).view(kind)
            got = hvd.allreduce(mine, op=hvd.Sum)
            same(got.view(torch.int16).numpy().view(dtype), ring_sum(parts, dtype),
                 f"torch allreduce {name} sum of {n}")
        parts = [[inputs(r, n, dtype, 2).astype(dtype) for n in (3, 1001)] for r in range(N)]
        mine = [torch.from_numpy(p.view(np.int16).copy()).view(kind) for p in parts[R]]
        hvd.grouped_allreduce_(mine, op=hvd.Sum)
        fused = ring_sum([np.concatenate(p) for p in parts], dtype)  # one fusion buffer
        same(np.concatenate([t.view(torch.int16).numpy().view(dtype) for t in mine]), fused,
             f"torch grouped_allreduce_ {name}")
    return run


def reducer_case(kernels):
    """fp16 compression: float32 gradients (odd sizes, a 0-d one) through the float16 wire
    buffer of their bucket (the 0-d one, which has no bucket, through one of its own), beside
    a float16 and an int32 gradient that travel as they are."""
    shapes = [(3, 5), (), (65537,), (1,), (2, 3, 7)]

    def run():
        reducer = Reducer(compression=Compression.fp16, kernels=KERNELS[kernels])
        grads = [Gradient(k, s, "<f4") for k, s in enumerate(shapes)]
        grads += [Gradient(10, (11,), "<f2"), Gradient(11, (4,), "<i4")]
        reducer.set_gradients(grads)
        shape_of = {g.key: g.shape for g in grads}
        views = {}
        for bucket in reducer.buckets:
            flat = np.zeros(bucket.bounds[-1], bucket.dtype)
            bucket.open = lambda flat=flat: flat
            for key, a, b in zip(bucket.keys, bucket.bounds, bucket.bounds[1:]):
                views[key] = flat[a:b].reshape(shape_of[key])
        wide = [g for g in grads if g.dtype == "<f4"]
        # What travels together: the bucketed float32 gradients, last first, in one wire
        # buffer (the default threshold holds them all); the 0-d one alone.
        wires = [[g for g in reversed(wide) if g.shape], [g for g in wide if not g.shape]]
        for step in range(2):
            def value(rank, g):
                x = inputs(rank, max(1, int(np.prod(g.shape))), np.float16, 100 * step + g.key)
                if g.dtype == "<i4":
                    return (np.arange(4) * (rank + 1) + step).astype(np.int32)
                return x.astype(g.dtype).reshape(g.shape)
            ready = []
            for g in grads:
                if g.key in views:
                    views[g.key][...] = value(R, g)
                ready.append((g.key, None if g.key in views else value(R, g)))
            reducer.mark_all(ready)
            results, _ = reducer.finish(reducer.close()[0])
            got = {**views, **results}
            for together in wires:
                wire = [np.concatenate([value(r, g).astype(np.float16).reshape(-1)
                                        for g in together]) for r in range(N)]
                summed = ring_sum(wire, np.float16).astype(np.float32)
                offset = 0
                for g in together:
                    size = int(np.prod(g.shape))
                    want = summed[offset:offset + size].reshape(g.shape)
                    offset += size
                    assert got[g.key].dtype == np.float32 and got[g.key].shape == g.shape
                    same(got[g.key].astype(np.float16), want.astype(np.float16),
                         f"{kernels} reducer step {step} gradient {g.key}")
                    assert np.array_equal(np.isnan(got[g.key]), np.isnan(want))
            same(got[10], ring_sum([value(r, grads[-2]) for r in range(N)], np.float16),
                 f"{kernels} reducer float16 gradient")
            assert np.array_equal(got[11], sum(value(r, grads[-1]) for r in range(N)))
        stats = reducer.stats  # the float32 gradients travel in half the bytes
        assert stats.bytes_sent < 0.6 * stats.dense_bytes, (stats.bytes_sent, stats.dense_bytes)
    return run


CASES = {f"{k} {d} ring": ring_case(k, d) for k in KERNELS for d in DTYPES}
CASES.update({f"torch api {d} sum": torch_api_case(d) for d in DTYPES})
CASES.update({f"{k} reducer fp16": reducer_case(k) for k in KERNELS})

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        try:
            CASES[name]()
            print(f"rank {R} {name}: ok", flush=True)
        except AssertionError as e:
            print(f"rank {R} {name}: FAILED {e}", flush=True)
