"""Compressors against straightforward NumPy references written here, and their options.

The references follow the definitions element by element (np.where, per-byte sums), not
the vectorised bit tricks of hvd_trainer.compression, so a packing or residual slip shows.
"""
import math

import numpy as np
import pytest

from hvd_trainer import compression
from hvd_trainer.compression import (Compression, OneBit, ScaledTwoBit, TopK, TwoBit,
                                     from_params)

SIZES = [1, 15, 16, 17, 1000, 2 ** 17 + 33]  # not divisible by 16; one spans two chunks


def ref_2bit(grad, residual, t):
    """MXNet's quantize_2bit by its definition: (payload bytes, new residual, sent values)."""
    t = np.float32(t)
    r = (residual + grad).astype(np.float32)
    codes = np.where(r >= t, 3, np.where(r <= -t, 2, 0))
    sent = np.where(codes == 3, t, np.where(codes == 2, -t, np.float32(0))).astype(np.float32)
    padded = np.zeros(16 * math.ceil(r.size / 16), np.int64)
    padded[:r.size] = codes
    payload = (padded.reshape(-1, 4) * [64, 16, 4, 1]).sum(axis=1).astype(np.uint8)
    return payload, (r - sent).astype(np.float32), sent


def ref_1bit(grad, residual, t):
    """MXNet 1.x's quantize_1bit: residual > t sends +1 (residual -= 1), else −1 (+= 1)."""
    r = (residual + grad).astype(np.float32)
    up = r > np.float32(t)
    sent = np.where(up, np.float32(1), np.float32(-1))
    padded = np.zeros(32 * math.ceil(r.size / 32), np.int64)
    padded[:r.size] = up
    payload = (padded.reshape(-1, 8) * [128, 64, 32, 16, 8, 4, 2, 1]).sum(axis=1)
    return payload.astype(np.uint8), (r - sent).astype(np.float32), sent


def ref_topk(grad, residual, ratio):
    """The ceil(ratio·n) largest |residual + grad| entries, by a full sort."""
    r = (residual + grad).astype(np.float32)
    k = max(1, math.ceil(ratio * r.size))
    keep = np.argsort(-np.abs(r), kind="stable")[:k]
    sent = np.zeros_like(r)
    sent[keep] = r[keep]
    return r - sent, sent


def gradient(size, seed, scale=1.0):
    rng = np.random.RandomState(seed)
    return (rng.randn(size) * scale).astype(np.float32)


def decoded(codec, payload, size):
    out = np.zeros(size, np.float32)
    codec.decode_add(payload, out)
    return out


@pytest.mark.parametrize("size", SIZES)
def test_2bit_matches_mxnet_definition(size):
    codec, t = TwoBit(0.7), 0.7
    residual, want_residual = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for step in range(3):
        g = gradient(size, step)
        want_payload, want_residual, sent = ref_2bit(g, want_residual, t)
        payload = codec.encode(g, residual)
        assert payload.dtype == np.uint8 and payload.size == codec.wire_bytes(size)
        assert np.array_equal(payload, want_payload)
        assert np.array_equal(residual, want_residual)
        assert np.array_equal(decoded(codec, payload, size), sent)


def test_2bit_edges_exact_threshold_zeros_and_nan():
    t = np.float32(0.25)
    g = np.array([t, -t, np.nextafter(t, np.float32(0)), -np.nextafter(t, np.float32(0)), 0, -0.0, np.nan, 3 * t,
                  -3 * t, np.inf, 0, 0, 0, 0, 0, 0, 0, 0.5], np.float32)
    want_payload, want_residual, sent = ref_2bit(g, np.zeros_like(g), t)
    residual = np.zeros_like(g)
    payload = TwoBit(t).encode(g, residual)
    assert np.array_equal(payload, want_payload)
    assert np.array_equal(residual, want_residual, equal_nan=True)
    assert list(sent[:4]) == [t, -t, 0, 0]  # exactly ±t is sent, just below is not
    assert sent[6] == 0 and np.isnan(residual[6])  # NaN: sends 0, stays in the residual
    zeros = np.zeros(40, np.float32)
    assert not TwoBit(t).encode(zeros, np.zeros(40, np.float32)).any()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_1bit_matches_mxnet_definition(size, threshold):
    codec = OneBit(threshold)
    residual, want_residual = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for step in range(3):
        g = gradient(size, 10 + step)
        want_payload, want_residual, sent = ref_1bit(g, want_residual, threshold)
        payload = codec.encode(g, residual)
        assert payload.size == codec.wire_bytes(size) == 4 * math.ceil(size / 32)
        assert np.array_equal(payload, want_payload)
        assert np.array_equal(residual, want_residual)
        assert np.array_equal(decoded(codec, payload, size), sent)


def test_1bit_edges():
    g = np.array([0.5, 0.5000001, -0.5, 0, np.nan, 2.0], np.float32)
    want_payload, want_residual, sent = ref_1bit(g, np.zeros_like(g), 0.5)
    residual = np.zeros_like(g)
    payload = OneBit(0.5).encode(g, residual)
    assert np.array_equal(payload, want_payload)
    assert np.array_equal(residual, want_residual, equal_nan=True)
    assert list(sent[:2]) == [-1, 1] and sent[4] == -1  # strictly above; NaN sends −1


@pytest.mark.parametrize("size", SIZES + [2 ** 18])
@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_topk_matches_full_sort(size, ratio):
    codec = TopK(ratio)
    residual, want_residual = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for step in range(3):
        g = gradient(size, 20 + step)
        want_residual, sent = ref_topk(g, want_residual, ratio)
        payload = codec.encode(g, residual)
        assert payload.size == codec.wire_bytes(size) == 8 * max(1, math.ceil(ratio * size))
        assert np.array_equal(residual, want_residual)
        assert np.array_equal(decoded(codec, payload, size), sent)


def test_topk_zeros_ties_and_nan():
    residual = np.zeros(10, np.float32)
    payload = TopK(0.2).encode(np.zeros(10, np.float32), residual)
    assert not decoded(TopK(0.2), payload, 10).any() and not residual.any()
    g = np.array([1, -1, 1, 0.5, 0, 0, 0, 0, 0, 0], np.float32)
    residual = np.zeros(10, np.float32)
    sent = decoded(TopK(0.2), TopK(0.2).encode(g, residual), 10)
    assert np.count_nonzero(sent) == 2 and set(np.abs(sent[sent != 0])) == {1.0}
    assert np.array_equal(sent + residual, g)
    g = gradient(2 ** 18, 5)
    g[12345] = np.nan
    residual = np.zeros_like(g)
    sent = decoded(TopK(0.001), TopK(0.001).encode(g, residual), g.size)
    assert np.isnan(sent[12345]) and residual[12345] == 0  # NaN is sent, as uncompressed


@pytest.mark.parametrize("size", [17, 2 ** 17 + 5])
def test_scaled_2bit_uses_mean_abs_gradient(size):
    codec = ScaledTwoBit(1.5)
    g = gradient(size, 3, scale=1e-4)
    residual = np.zeros(size, np.float32)
    payload = codec.encode(g, residual)
    assert payload.size == codec.wire_bytes(size) == 4 + 4 * math.ceil(size / 16)
    t = payload[:4].view("<f4")[0]
    assert np.isclose(t, 1.5 * np.abs(g.astype(np.float64)).mean(), rtol=1e-5, atol=0)
    want_payload, want_residual, sent = ref_2bit(g, np.zeros(size, np.float32), t)
    assert np.array_equal(payload[4:], want_payload)
    assert np.array_equal(residual, want_residual)
    assert np.array_equal(decoded(codec, payload, size), sent)
    assert np.count_nonzero(sent) > size // 10  # unlike a fixed 2-bit threshold of 0.5


@pytest.mark.parametrize("codec", [TwoBit(0.05), OneBit(0.0), TopK(0.05), ScaledTwoBit(1.0)],
                         ids=["2bit", "1bit", "topk", "scaled_2bit"])
def test_error_feedback_keeps_every_input(codec):
    """Over many steps, everything decoded plus the final residual is the sum of the inputs."""
    size = 3001
    residual = np.zeros(size, np.float32)
    inputs, sent = np.zeros(size, np.float64), np.zeros(size, np.float64)
    for step in range(200):
        g = gradient(size, 100 + step, scale=0.1)
        inputs += g
        sent += decoded(codec, codec.encode(g, residual), size)
    np.testing.assert_allclose(sent + residual, inputs, rtol=0, atol=1e-3)
    assert np.abs(residual).max() < np.abs(inputs).max()


def test_decode_add_accumulates():
    codec, g = TwoBit(0.5), gradient(100, 7)
    payload = codec.encode(g, np.zeros(100, np.float32))
    out = np.ones(100, np.float32)
    codec.decode_add(payload, out)
    assert np.array_equal(out, 1 + decoded(codec, payload, 100))


@pytest.mark.parametrize("codec", [TwoBit(0.5), TwoBit(0.3), ScaledTwoBit(1.0), OneBit(0.5),
                                   TopK(0.01)],
                         ids=["2bit-0.5", "2bit-0.3", "scaled-2bit", "1bit-0.5", "topk-0.01"])
@pytest.mark.parametrize("size", SIZES)
def test_decode_two_is_two_decode_adds_into_zeros(codec, size):
    """decode_two (2-bit: one lookup in a table of byte pairs) against decode_add, by
    definition: the same bits, signed zeros and a NaN residual's zero code included, and so
    does decode_sum of three ranks' payloads against decode_add of each in rank order."""
    from hvd_trainer.collectives.feedback import decode_sum
    payloads = []
    for seed in range(3):
        g = gradient(size, 50 + seed, scale=0.8)
        g[size // 2] = np.nan
        payloads.append(codec.encode(g, np.zeros(size, np.float32)))
    want = np.zeros(size, np.float32)
    codec.decode_add(payloads[0], want)
    codec.decode_add(payloads[1], want)
    got = np.full(size, 5, np.float32)
    codec.decode_two(payloads[0], payloads[1], got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    codec.decode_add(payloads[2], want)
    summed = np.full(size, 5, np.float32)
    every = np.stack(payloads)
    decode_sum(codec, every, [0, every.shape[1]], [summed], 1.0)
    assert np.array_equal(summed.view(np.uint32), want.view(np.uint32))


def test_wire_bytes_targets():
    n = 33_554_432
    assert TwoBit().wire_bytes(n) * 16 <= 4 * n
    assert TopK(0.01).wire_bytes(n) * 40 <= 4 * n


def test_small_and_integer_tensors_are_not_compressed():
    codec = TwoBit()
    assert codec.accepts(np.zeros(codec.min_size, np.float32))
    assert not codec.accepts(np.zeros(codec.min_size - 1, np.float32))
    assert not codec.accepts(np.zeros(4096, np.int32))
    assert not codec.accepts(np.zeros(4096, np.float16))


def test_from_params_types():
    assert from_params({"type": "fp16"}) is Compression.fp16
    two = from_params({"type": "2bit", "threshold": 0.1})
    assert isinstance(two, TwoBit) and two.threshold == np.float32(0.1)
    assert from_params({"type": "2bit"}).threshold == np.float32(0.5)  # MXNet's default
    assert isinstance(from_params({"type": "1bit", "threshold": 0}), OneBit)
    top = from_params({"type": "topk", "ratio": 0.01, "min_size": 10})
    assert isinstance(top, TopK) and top.ratio == 0.01 and top.min_size == 10
    assert isinstance(from_params({"type": "scaled_2bit"}), ScaledTwoBit)


@pytest.mark.parametrize("params, message", [
    ({"type": "3bit"}, "unknown; valid types: 'fp16', '2bit', '1bit', 'topk', 'scaled_2bit'"),
    ({"threshold": 0.5}, "must be a dict with a 'type' key"),
    ("2bit", "must be a dict with a 'type' key"),
    ({"type": "2bit", "threshold": 0}, "threshold=0.0 must be positive"),
    ({"type": "2bit", "threshold": -1}, "threshold=-1.0 must be positive"),
    ({"type": "scaled_2bit", "threshold": 0}, "must be positive"),
    ({"type": "2bit", "threshold": float("nan")}, "must be a finite number"),
    ({"type": "2bit", "threshold": "0.5"}, "must be a finite number"),
    ({"type": "topk"}, "needs 'ratio'"),
    ({"type": "topk", "ratio": 0}, r"must be in \(0, 1\]"),
    ({"type": "topk", "ratio": 1.5}, r"must be in \(0, 1\]"),
    ({"type": "2bit", "threshold": 0.5, "treshold": 1}, r"unknown keys \['treshold'\]"),
    ({"type": "fp16", "ratio": 0.1}, r"unknown keys \['ratio'\]"),
    ({"type": "topk", "ratio": 0.1, "min_size": -1}, "min_size=-1 must be a non-negative"),
])
def test_from_params_rejects_bad_input(params, message):
    with pytest.raises(ValueError, match=message):
        from_params(params)


def test_a_user_compressor_needs_the_three_methods():
    class Half(compression.GatherCompressor):
        def encode(self, grad, residual):
            residual += grad
            return np.zeros(0, np.uint8)

    with pytest.raises(TypeError, match="abstract"):
        Half()
