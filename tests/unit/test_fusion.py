"""Bucket planning and packing, against hand-worked plans and NumPy."""
import numpy as np

from hvd_trainer.collectives import fusion


def test_plan_fills_buckets_in_order_up_to_threshold():
    f4, i4 = np.dtype(np.float32), np.dtype(np.int32)
    # 40 + 40 fit under 100; the third opens a new bucket; the 150-byte one exceeds the
    # threshold and stands alone; int32 tensors never share a bucket with float32 ones.
    plan = fusion.plan_buckets([40, 40, 40, 150, 8, 8], [f4, f4, f4, f4, i4, f4], 100)
    assert plan == [[0, 1], [2], [3], [4], [5]]


def test_plan_exact_threshold_fits():
    f4 = np.dtype(np.float32)
    assert fusion.plan_buckets([50, 50, 1], [f4] * 3, 100) == [[0, 1], [2]]


def test_pack_unpack_round_trip_with_scale():
    rng = np.random.default_rng(0)
    tensors = [rng.random(s).astype(np.float32) for s in [(3, 4), (0,), (), (7,)]]
    flat = np.empty(sum(t.size for t in tensors), np.float32)
    fusion.pack(tensors, flat, scale=2.0)
    np.testing.assert_array_equal(flat, np.concatenate([t.ravel() * 2 for t in tensors]))
    outs = [np.empty_like(t) for t in tensors]
    fusion.unpack(flat, outs, scale=0.25)
    for t, o in zip(tensors, outs):
        np.testing.assert_allclose(o, t * 0.5, rtol=1e-7)


def test_float16_scaling_keeps_factor_precision():
    x = np.full(4, 3.0, np.float16)
    out = np.empty_like(x)
    fusion.unpack(x, [out], scale=1 / 3)
    # Rounding 1/3 to float16 first would give 0.9995; float32 scaling gives exactly 1.
    np.testing.assert_array_equal(out, np.ones(4, np.float16))


def test_buffer_pool_reuses_memory_in_steady_state():
    pool = fusion.BufferPool()
    first = pool.get(np.dtype(np.float32), 0, 100)
    again = pool.get(np.dtype(np.float32), 0, 80)
    assert np.shares_memory(first, again)
    assert not np.shares_memory(first, pool.get(np.dtype(np.float32), 1, 10))


def test_fused_reduces_every_bucket_once_and_scales():
    tensors = [np.arange(5, dtype=np.float64), np.ones((2, 2)), np.full(3, 2, np.int64)]
    outs = [np.empty_like(t) for t in tensors]
    calls = []

    def double(flat, into=None):
        calls.append(flat.size)
        np.multiply(flat, 2, out=flat if into is None else into)

    fusion.fused(tensors, outs, fusion.BufferPool, threshold=1 << 20, reduce=double,
                 prescale=1.0, postscale=0.5)
    assert sorted(calls) == [3, 9]  # one float64 bucket (5 + 4 elements), one int64
    for t, o in zip(tensors, outs):
        np.testing.assert_array_equal(o, t)


def test_gradient_buckets_reverse_order_threshold_and_dtype():
    f4, f2 = np.dtype(np.float32), np.dtype(np.float16)
    # Reversed: 5(f4,30) 4(f4,60) 3(f2,20) 2(f4,40) 1(f2,90) 0(f4,200).
    # A bucket takes tensors until it holds 100 bytes (DDP's rule): f4: 30+60 = 90 is below,
    # so 40 joins (130) and closes it; 200 alone. f2: 20 is below, so 90 joins (110).
    nbytes, dtypes = [200, 90, 40, 20, 60, 30], [f4, f2, f4, f2, f4, f4]
    assert fusion.plan_gradient_buckets(nbytes, dtypes, 100) == [[5, 4, 2], [3, 1], [0]]
    # Horovod's fusion of a grouped call keeps every bucket at most the threshold.
    assert fusion.plan_buckets(nbytes[::-1], dtypes[::-1], 100) == [[0, 1], [2], [3], [4],
                                                                    [5]]
    # One bucket per tensor, and one bucket per dtype.
    assert fusion.plan_gradient_buckets(nbytes, dtypes, 1) == [[5], [4], [3], [2], [1], [0]]
    assert fusion.plan_gradient_buckets(nbytes, dtypes, 1 << 40) == [[5, 4, 2, 0], [3, 1]]


def test_a_layers_bias_travels_with_its_weight():
    # 3 layers of (weight 16 MiB, bias 8 KiB) at a 16 MiB threshold, in parameter order: the
    # weight alone fills a bucket, and the bias that backward makes just before it rides in
    # the same bucket instead of making a collective of its own.
    f4, weight, bias = np.dtype(np.float32), 16 << 20, 8 << 10
    plan = fusion.plan_gradient_buckets([weight, bias] * 3, [f4] * 6, 16 << 20)
    assert plan == [[5, 4], [3, 2], [1, 0]]


def test_gradient_buckets_by_group_count():
    f4, f2 = np.dtype(np.float32), np.dtype(np.float16)
    # 5 tensors in 2 groups of reversed order: [4, 3, 2] and [1, 0], each split by dtype only.
    plan = fusion.plan_gradient_buckets([8] * 5, [f4, f4, f2, f4, f4], 1, groups=2)
    assert plan == [[4, 3], [2], [1, 0]]
    assert fusion.plan_gradient_buckets([8] * 2, [f4, f4], 1, groups=5) == [[1], [0]]


def test_a_lone_tensor_is_reduced_from_its_input_straight_into_its_output():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = np.empty_like(x)
    seen = []

    def double(flat, into=None):
        seen.append(into is not None)
        np.multiply(flat, 2, out=flat if into is None else into)

    fusion.fused([x], [out], fusion.BufferPool, 1 << 20, double)
    assert seen == [True]  # no copy into the output first
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3) * 2)
    np.testing.assert_array_equal(x, np.arange(6).reshape(2, 3))  # the input is only read
    fusion.fused([x], [out], fusion.BufferPool, 1 << 20, double, prescale=0.5)
    assert seen == [True, False]  # a prescale needs the scaled copy
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))


def test_runs_of_nearly_equal_length_the_first_longer():
    assert fusion.split_runs(list(range(7)), 0) == [list(range(7))]
    assert fusion.split_runs(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert fusion.split_runs(list(range(2)), 5) == [[0], [1]]
    assert fusion.split_runs([], 3) == []
