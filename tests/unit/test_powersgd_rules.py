"""PowerSGD's settings, its rule for what is factored, orthonormalisation, and the sums on a
one-rank world, against hand computations and NumPy written here."""
import numpy as np
import pytest

from hvd_trainer.collectives import powersgd
from hvd_trainer.compression import Compression, from_params
from hvd_trainer.collectives.powersgd import PowerSGD, PowerSGDSum
from hvd_trainer.training.reducer import Reducer


@pytest.mark.parametrize("arguments, named", [
    ({"rank": 0}, "rank=0"), ({"rank": 2.5}, "rank=2.5"), ({"rank": True}, "rank=True"),
    ({"rank": "4"}, "rank='4'"), ({"start_iter": -1}, "start_iter=-1"),
    ({"min_compression_rate": 0}, "min_compression_rate=0"),
    ({"min_compression_rate": float("nan")}, "min_compression_rate=nan"),
    ({"use_error_feedback": 1}, "use_error_feedback=1"), ({"warm_start": None}, "warm_start"),
    ({"seed": -3}, "seed=-3")])
def test_bad_arguments_name_the_argument_and_the_fix(arguments, named):
    with pytest.raises(ValueError, match=named) as raised:
        Compression.powersgd(**arguments)
    assert "must be" in str(raised.value)


def test_rank_error_shows_a_valid_call():
    with pytest.raises(ValueError, match=r"integer ≥ 1.*Compression.powersgd\(rank=4\)"):
        Compression.powersgd(rank=0)


def test_settings_are_keyword_only_with_ddps_defaults():
    with pytest.raises(TypeError):
        Compression.powersgd(4)  # noqa - positional on purpose
    settings = Compression.powersgd()
    assert (settings.rank, settings.start_iter, settings.min_compression_rate,
            settings.use_error_feedback, settings.warm_start) == (1, 1000, 2.0, True, True)


def test_what_is_factored():
    rank4 = PowerSGD(rank=4)
    assert rank4.factors((64, 64), np.float32) == (64, 64, 4)   # (64+64)·4·2 < 4096
    assert rank4.factors((32, 16, 3, 3), np.float64) == (32, 144, 4)
    assert rank4.factors((64, 10), np.float32) == (64, 10, 4)   # 74·4·2 = 592 < 640
    assert rank4.factors((16, 9), np.float32) is None           # 25·4·2 = 200 ≥ 144
    assert rank4.factors((4096,), np.float32) is None           # 1-D: never
    assert rank4.factors((), np.float32) is None
    assert rank4.factors((64, 64), np.float16) is None
    assert rank4.factors((64, 64), np.int32) is None
    assert rank4.factors((0, 64), np.float32) is None
    # The rank is capped by the smaller side; a low rate compresses more.
    assert PowerSGD(rank=9, min_compression_rate=0.5).factors((3, 8), np.float32) == (3, 8, 3)


def test_orthonormalize_spans_the_columns_even_when_rank_deficient():
    rng = np.random.default_rng(0)
    p = rng.standard_normal((20, 3)).astype(np.float32)
    q = powersgd.orthonormalize(p)
    assert q.dtype == np.float32 and q.shape == (20, 3)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-5)  # same column space
    deficient = np.repeat(p[:, :1], 3, axis=1)
    for value in (deficient, np.zeros((20, 3), np.float32)):
        q = powersgd.orthonormalize(value)
        assert np.isfinite(q).all()
        np.testing.assert_allclose(q @ (q.T @ value), value, atol=1e-5)


def test_first_q_is_seeded_by_seed_tensor_and_draw():
    a = powersgd.first_q(0, 3, 0, (5, 2), np.dtype(np.float32))
    assert np.array_equal(a, powersgd.first_q(0, 3, 0, (5, 2), np.dtype(np.float32)))
    for other in ((1, 3, 0), (0, 4, 0), (0, 3, 1)):
        assert not np.array_equal(a, powersgd.first_q(*other, (5, 2), np.dtype(np.float32)))


def test_one_rank_sum_is_the_projection_with_error_feedback():
    """On one rank: P̂ spans M·Q, the result is P̂·P̂ᵀ·M, the residual M minus that."""
    settings = PowerSGD(rank=2, start_iter=1)
    state = PowerSGDSum(settings)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((12, 10)).astype(np.float32) for _ in range(3)]
    bias = rng.standard_normal(10).astype(np.float32)
    residual = np.zeros((12, 10))
    q = None
    for step, g in enumerate(grads):
        t, b = g.copy(), bias.copy()
        state.sum_([(0, t), (1, b)], "unit")
        np.testing.assert_array_equal(b, bias)  # 1-D: exact
        if step < 1:
            np.testing.assert_array_equal(t, g)  # before start_iter: exact
            continue
        m = g.astype(np.float64) + residual
        if q is None:
            q = np.random.default_rng([0, powersgd.zlib.crc32(b"0"), 0]).standard_normal(
                (10, 2)).astype(np.float32).astype(np.float64)
        basis, _ = np.linalg.qr(m @ q)
        q = m.T @ basis
        want = basis @ q.T
        residual = m - want
        np.testing.assert_allclose(t, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state.residuals[0], residual, atol=1e-4)
    assert state.steps == {0: 3, 1: 3} and state.factors[0].shape == (10, 2)


def test_state_round_trip():
    state = PowerSGDSum(PowerSGD(rank=1, start_iter=0))
    state.sum_([(7, np.ones((6, 5), np.float32))], "unit")
    again = PowerSGDSum(PowerSGD(rank=1, start_iter=0))
    again.restore(state.state())
    assert again.steps == {7: 1} and np.array_equal(again.factors[7], state.factors[7])
    again.restore(None)
    assert again.state() == {"residuals": {}, "factors": {}, "steps": {}}


def test_from_params_and_an_uncalled_compressor():
    made = from_params({"type": "powersgd", "rank": 4, "start_iter": 10})
    assert isinstance(made, PowerSGD) and (made.rank, made.start_iter) == (4, 10)
    with pytest.raises(ValueError, match="unknown keys \\['min_size'\\]"):
        from_params({"type": "powersgd", "min_size": 10})
    with pytest.raises(ValueError, match="rank=0"):
        from_params({"type": "powersgd", "rank": 0})
    with pytest.raises(ValueError, match=r"must be called.*Compression.powersgd\(rank=4\)"):
        Reducer(compression=Compression.powersgd)
