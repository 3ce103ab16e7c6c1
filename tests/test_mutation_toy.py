r"""toy: the lines that mutation testing found unchecked (docs/mutation.md).

The boundary cases nobody builds otherwise (T = V = 1, a zero true gradient, N = 1, n = 0, a
toy of exactly MAX_TOY_BYTES), minimal dicts that hold only the documented keys, and the
error messages in full, with sizes computed here from the docstrings' formulas.
"""

import math
import re

import numpy as np
import pytest

from opd_literate.mismatch import toy as toy_module
from opd_literate.mismatch.toy import (
    ar_num_responses,
    ar_toy_from_logits,
    ar_toy_nbytes,
    check_toy,
    estimator_moments,
    log_softmax,
    make_ar_toy,
    make_toy,
    response_mask,
    sample_from_sampler,
    toy_from_logits,
    toy_nbytes,
)

GIB = 1024**3


def test_one_token_of_one_word():
    toy = make_toy(T=1, V=1)
    assert toy["Y"].tolist() == [[0]] and toy["p_sampler"].tolist() == [1.0]
    assert toy["true_grad"].tolist() == [[0.0]]  # pi = 1 whatever theta: no gradient
    ar = make_ar_toy(T=1, V=1, eos=False)
    assert ar["Y"].tolist() == [[0]] and ar["true_grad"].shape == (1, 2, 1)


def test_zero_true_gradient_has_relative_errors_zero_or_infinite():
    toy = make_toy(T=1, V=1)
    exact = estimator_moments(toy, np.zeros((1, 1, 1)))
    assert exact["rel_bias"] == 0.0 and exact["rel_rmse"](1) == 0.0
    off = estimator_moments(toy, np.ones((1, 1, 1)))
    assert off["rel_bias"] == math.inf and off["rel_rmse"](4) == math.inf
    assert off["bias"] == 1.0 and off["var"] == 0.0


def test_moments_by_hand_and_rel_rmse_at_one():
    # two sequences with mu = (0.25, 0.75), estimates 1 and 3 (one parameter), target 2
    toy = {"p_sampler": np.array([0.25, 0.75]), "true_grad": np.array([[2.0]])}
    m = estimator_moments(toy, np.array([[[1.0]], [[3.0]]]))
    mean = 0.25 * 1 + 0.75 * 3  # 2.5
    var = 0.25 * (1 - mean) ** 2 + 0.75 * (3 - mean) ** 2  # 0.75
    assert m["mean"].tolist() == [[mean]]
    assert m["bias"] == 0.5 and math.isclose(m["var"], var, rel_tol=1e-15)
    assert m["rel_bias"] == 0.25
    assert math.isclose(m["rel_rmse"](1), math.sqrt(0.25 + var) / 2, rel_tol=1e-15)
    assert math.isclose(m["rel_rmse"](3), math.sqrt(0.25 + var / 3) / 2, rel_tol=1e-15)
    for bad in (0, 0.5, -1, float("nan")):
        with pytest.raises(ValueError, match=f"^N must be >= 1, got {re.escape(repr(bad))}$"):
            m["rel_rmse"](bad)


@pytest.mark.parametrize("value", [2.0**600, 2.0**-600])
def test_moments_of_huge_and_tiny_values_by_hand(value):
    toy = {"p_sampler": np.array([0.5, 0.5]), "true_grad": np.array([[0.0]])}
    m = estimator_moments(dict(toy, true_grad=np.array([[value]])),
                          np.array([[[0.0]], [[2 * value]]]))
    assert m["bias"] == 0.0 and m["rel_bias"] == 0.0
    assert m["mean"].tolist() == [[value]]
    # var = value^2 (inf for 2^1200), rel_rmse(1) = sqrt(value^2) / value = 1
    assert m["var"] == (math.inf if value > 1 else 0.0)
    assert math.isclose(m["rel_rmse"](1), 1.0, rel_tol=1e-15)


def test_moment_errors():
    toy = {"p_sampler": np.array([0.5, 0.5]), "true_grad": np.zeros((1, 2))}
    with pytest.raises(ValueError, match=r"^per_seq_estimate must have shape \(M, T, V\) = "
                       r"\(2, 1, 2\), got \(2, 2\)$"):
        estimator_moments(toy, np.zeros((2, 2)))
    bad = np.zeros((2, 1, 2))
    bad[0, 0, 1] = np.nan
    bad[1, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"^per_seq_estimate holds 2 non-finite values; its "
                       "moments would be NaN$"):
        estimator_moments(toy, bad)


def test_minimal_dicts_are_enough():
    p = np.array([0.25, 0.75])
    m = estimator_moments({"p_sampler": p, "true_grad": np.zeros(1)}, np.zeros((2, 1)))
    assert m["bias"] == 0.0
    rng = np.random.default_rng(0)
    idx = sample_from_sampler({"p_sampler": p}, 5, rng)
    assert idx.shape == (5,) and set(idx.tolist()) <= {0, 1}
    assert response_mask({"logp_train": np.zeros((2, 3))}).tolist() == [[1.0] * 3] * 2


def test_sampling_renormalizes_and_takes_zero_draws():
    rng = np.random.default_rng(0)
    # an unnormalized p (1 : 3) is divided by its sum, as the docstring's comment says
    idx = sample_from_sampler({"p_sampler": np.array([1.0, 3.0])}, 4000, rng)
    assert abs(np.mean(idx == 1) - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 4000)
    assert sample_from_sampler({"p_sampler": np.array([1.0])}, 0, rng).shape == (0,)
    assert sample_from_sampler({"p_sampler": np.array([1.0])}, np.int64(2), rng).tolist() == [0, 0]


@pytest.mark.parametrize("n", [-1, True, 2.5, "3", None])
def test_sampling_refuses_a_bad_count(n):
    with pytest.raises(ValueError, match=f"^n must be a non-negative integer, got "
                       f"{re.escape(repr(n))}$"):
        sample_from_sampler({"p_sampler": np.array([1.0])}, n, np.random.default_rng(0))


def test_check_toy_messages():
    with pytest.raises(TypeError, match="^toy must be the dict returned by make_toy, got list$"):
        check_toy([1, 2])
    with pytest.raises(ValueError, match=r"^toy is missing the keys \['R', 'true_grad'\]; build "
                       "it with make_toy$"):
        check_toy({k: 0 for k in ("Y", "logp_train", "logp_sampler", "p_sampler", "score")})
    check_toy({"a": 1}, keys=("a",))


def test_log_softmax_is_float64_whatever_the_input():
    z32 = np.array([0.0, np.log(3.0)], dtype=np.float32)
    out = log_softmax(z32)
    assert out.dtype == np.float64
    want = np.log([0.25, 0.75])
    np.testing.assert_allclose(out, want, rtol=1e-7)  # log 3 rounded to float32
    ints = log_softmax(np.array([0, 0]))
    assert ints.dtype == np.float64 and ints.tolist() == [-math.log(2)] * 2
    assert log_softmax([[1e308, -1e308]]).tolist() == [[0.0, -math.inf]]


# -------------------------------------------------------------------------------------------
# Sizes: the docstrings' formulas, the limit exactly and the messages in full
# -------------------------------------------------------------------------------------------
def test_sizes_by_the_formulas():
    # M = V**T; 8 bytes times (3 T + 3 + T V) per sequence
    assert toy_nbytes(2, 3) == 8 * 9 * (6 + 3 + 6)
    # M = sum_k (V - 1)^k with <eos>, V**T without; 8 bytes times (5 T + 3 + T (V + 1) V)
    assert ar_num_responses(3, 3) == 1 + 2 + 4 + 8
    assert ar_num_responses(3, 3, eos=False) == 27
    assert ar_num_responses(3, 2) == 4
    assert ar_toy_nbytes(3, 3) == 8 * 15 * (15 + 3 + 36)
    assert ar_toy_nbytes(3, 3, eos=False) == 8 * 27 * (15 + 3 + 36)


def test_a_toy_of_exactly_the_limit_is_built(monkeypatch):
    monkeypatch.setattr(toy_module, "MAX_TOY_BYTES", toy_nbytes(2, 2))
    assert make_toy(T=2, V=2)["Y"].shape == (4, 2)
    with pytest.raises(ValueError, match=r"^make_toy\(T=2, V=3\) would enumerate"):
        make_toy(T=2, V=3)
    monkeypatch.setattr(toy_module, "MAX_TOY_BYTES", ar_toy_nbytes(2, 3))
    assert make_ar_toy(T=2, V=3)["Y"].shape == (ar_num_responses(2, 3), 2)
    with pytest.raises(ValueError, match=r"^make_ar_toy\(T=3, V=3, eos=True\) would enumerate"):
        make_ar_toy(T=3, V=3)


def test_oversize_messages_in_full():
    nbytes = 8 * 8**12 * (3 * 12 + 3 + 12 * 8)
    assert nbytes / GIB == 69120.0
    with pytest.raises(ValueError, match="^" + re.escape(
            "make_toy(T=12, V=8) would enumerate V**T = 68,719,476,736 sequences and take "
            "69120.0 GiB, above MAX_TOY_BYTES = 2 GiB; choose a smaller T or V") + "$"):
        make_toy(T=12, V=8)
    # T log2 V = 60 exactly: still the exact count (the cheap estimate is for > 60)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"make_toy(T=30, V=4) would enumerate V**T = {2**60:,} sequences and take "
            f"{8 * 213 * 2**60 / GIB:.1f} GiB")):
        make_toy(T=30, V=4)
    with pytest.raises(ValueError, match="^" + re.escape(
            "toy_from_logits(T=61, V=2) would enumerate V**T ~ 10^18 sequences, far above "
            "MAX_TOY_BYTES = 2 GiB; choose a smaller T or V") + "$"):
        toy_from_logits(np.zeros((61, 2)), np.zeros((61, 2)))
    M = sum(7**k for k in range(13))
    with pytest.raises(ValueError, match="^" + re.escape(
            f"make_ar_toy(T=12, V=8, eos=True) would enumerate {M:,} responses and take "
            f"{8 * M * (60 + 3 + 12 * 9 * 8) / GIB:.1f} GiB, above MAX_TOY_BYTES = 2 GiB; "
            "choose a smaller T or V") + "$"):
        make_ar_toy(T=12, V=8)
    with pytest.raises(ValueError, match="^" + re.escape(
            "make_ar_toy(T=100, V=4, eos=False) would enumerate about 10^60 responses, far "
            "above MAX_TOY_BYTES = 2 GiB; choose a smaller T or V") + "$"):
        make_ar_toy(T=100, V=4, eos=False)


# -------------------------------------------------------------------------------------------
# Argument errors in full
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, error, message", [
    (lambda: make_toy(T=0), ValueError, "T must be >= 1, got 0"),
    (lambda: make_toy(V=0), ValueError, "V must be >= 1, got 0"),
    (lambda: make_toy(T=2.0), TypeError, "T must be an integer, got 2.0"),
    (lambda: make_toy(V=True), TypeError, "V must be an integer, got True"),
    (lambda: make_toy(mismatch=float("nan")), ValueError,
     "mismatch must be a finite number, got nan"),
    (lambda: make_toy(mismatch=2e6), ValueError,
     "mismatch must be in [-1e+06, 1e+06] (MAX_MISMATCH), got 2000000.0: the sampler's logits "
     "theta + mismatch * b would be too large to compute its probabilities"),
    (lambda: make_ar_toy(T=2, V=2, eos=1), TypeError, "eos must be True or False, got 1"),
    (lambda: make_ar_toy(T=2, V=1), ValueError,
     "with eos=True, V must be >= 2 (token V - 1 is <eos>, and at least one other token is "
     "needed), got V=1"),
    (lambda: make_ar_toy(T=2, V=2, seed=-1), ValueError,
     "seed must be a non-negative integer, got -1"),
    (lambda: make_ar_toy(T=2, V=2, seed=True), ValueError,
     "seed must be a non-negative integer, got True"),
    (lambda: toy_from_logits(np.zeros((2, 2)), np.zeros((2, 3))), ValueError,
     "sampler_logits must have the shape of train_logits (2, 2), got (2, 3)"),
    (lambda: toy_from_logits(np.zeros((2, 2), dtype=bool), np.zeros((2, 2))), TypeError,
     "train_logits must hold real numbers, got dtype bool"),
    (lambda: toy_from_logits(np.zeros((2, 2)), np.array([["a", "b"]] * 2)), TypeError,
     "sampler_logits must hold real numbers, got dtype <U1"),
    (lambda: toy_from_logits(np.zeros(2), np.zeros(2)), ValueError,
     "train_logits must have shape (T, V) with T, V >= 1, got (2,)"),
    (lambda: toy_from_logits(np.zeros((2, 0)), np.zeros((2, 0))), ValueError,
     "train_logits must have shape (T, V) with T, V >= 1, got (2, 0)"),
    (lambda: toy_from_logits(np.zeros((1, 2)), np.array([[0.0, np.inf]])), ValueError,
     "sampler_logits must be finite, got inf"),
    (lambda: toy_from_logits(np.array([[1e308, -1e308]]), np.zeros((1, 2))), ValueError,
     "a token has probability 0 (log-probability -inf) under the trainer or the sampler: its "
     "importance ratio is undefined; use smaller logits"),
    (lambda: ar_toy_from_logits(np.zeros((2, 3, 2)), np.zeros((2, 3, 3))), ValueError,
     "sampler_logits must have shape (T, V + 1, V) with T, V >= 1, got (2, 3, 3)"),
    (lambda: ar_toy_from_logits(np.zeros((2, 3, 2)), np.zeros((1, 3, 2))), ValueError,
     "sampler_logits must have the shape of train_logits (2, 3, 2), got (1, 3, 2)"),
    (lambda: ar_toy_from_logits(np.full((1, 3, 2), np.nan), np.zeros((1, 3, 2))), ValueError,
     "train_logits must be finite, got nan"),
    (lambda: ar_toy_from_logits(np.zeros((1, 3, 2), dtype=complex), np.zeros((1, 3, 2))),
     TypeError, "train_logits must hold real numbers, got dtype complex128"),
    (lambda: ar_toy_from_logits(np.array([[[1e308, -1e308]] * 3]), np.zeros((1, 3, 2))),
     ValueError, "a token has probability 0 (log-probability -inf) under the trainer or the "
     "sampler: its importance ratio is undefined; use smaller logits"),
])
def test_argument_errors_in_full(call, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        call()


# -------------------------------------------------------------------------------------------
# The documented draws and the keys of the toys built from logits
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, T, V, mismatch, seed", [
    ({}, 5, 3, 0.3, 0),  # the documented defaults
    ({"T": 2, "V": 2, "mismatch": 0.1, "seed": 4}, 2, 2, 0.1, 4),
])
def test_autoregressive_toy_is_the_documented_draw(kwargs, T, V, mismatch, seed):
    toy = make_ar_toy(**kwargs)
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 0.7, size=(T, V + 1, V))
    b = rng.standard_t(3, size=(T, V + 1, V))
    np.testing.assert_array_equal(toy["theta"], theta)
    np.testing.assert_array_equal(toy["b"], b)
    assert toy["mismatch"] == mismatch and toy["T"] == T and toy["V"] == V
    assert len(toy["Y"]) == sum((V - 1) ** k for k in range(T + 1))
    # the sampler reads theta + mismatch * b: its first token's log-probabilities
    first = toy["Y"][:, 0]
    log_mu0 = _log_softmax(theta[0, 0] + mismatch * b[0, 0])
    np.testing.assert_allclose(toy["logp_sampler"][:, 0], log_mu0[first], rtol=1e-12)


def _log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_toys_from_logits_keep_the_logits():
    train, sampler = np.array([[0.0, 1.0], [2.0, 0.5]]), np.array([[0.5, 0.0], [1.0, 1.0]])
    toy = toy_from_logits(train, sampler)
    assert toy["theta"].tolist() == train.tolist() and toy["mismatch"] == 1.0
    assert toy["b"].tolist() == (sampler - train).tolist()
    train3 = np.arange(12.0).reshape(2, 3, 2) / 10
    sampler3 = np.ones((2, 3, 2)) * [0.0, 0.5]
    ar = ar_toy_from_logits(train3, sampler3)
    assert ar["theta"].tolist() == train3.tolist() and ar["mismatch"] == 1.0
    assert ar["b"].tolist() == (sampler3 - train3).tolist()


def test_logits_of_any_real_dtype_are_read_as_float64():
    for dtype in (np.float32, np.int64, np.int8):
        toy = toy_from_logits(np.zeros((1, 2), dtype=dtype), np.ones((1, 2), dtype=dtype))
        assert toy["theta"].dtype == np.float64 and toy["p_train"].tolist() == [0.5, 0.5]
        ar = ar_toy_from_logits(np.zeros((1, 3, 2), dtype=dtype), np.zeros((1, 3, 2), dtype=dtype))
        assert ar["theta"].dtype == np.float64 and ar["p_train"].tolist() == [0.5, 0.5]


def test_a_mask_of_integers_is_returned_as_float():
    mask = response_mask({"logp_train": np.zeros((1, 2)), "mask": np.array([[1, 0]])})
    assert mask.dtype == np.float64 and mask.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("shape", [(1, 3, 2, 1), (0, 3, 2), (1, 3, 3)])
def test_autoregressive_logits_of_a_wrong_shape(shape):
    with pytest.raises(ValueError, match="^" + re.escape(
            f"train_logits must have shape (T, V + 1, V) with T, V >= 1, got {shape}") + "$"):
        ar_toy_from_logits(np.zeros(shape), np.zeros(shape))


def test_oversize_autoregressive_toy_from_logits_counts_with_eos():
    # with <eos> and V = 3: M = sum_{k <= 61} 2^k = 2^62 - 1 responses
    M = 2**62 - 1
    with pytest.raises(ValueError, match="^" + re.escape(
            f"ar_toy_from_logits(T=61, V=3, eos=True) would enumerate {M:,} responses and take "
            f"{8 * M * (5 * 61 + 3 + 61 * 4 * 3) / GIB:.1f} GiB")):
        ar_toy_from_logits(np.zeros((61, 4, 3)), np.zeros((61, 4, 3)))


def test_autoregressive_toy_records_its_eos():
    assert make_ar_toy(T=2, V=3)["eos"] == 2  # the token V - 1
    assert make_ar_toy(T=2, V=3, eos=False)["eos"] is None


def test_oversize_autoregressive_toy_without_eos_counts_every_sequence():
    M = 3**20
    with pytest.raises(ValueError, match="^" + re.escape(
            f"make_ar_toy(T=20, V=3, eos=False) would enumerate {M:,} responses and take "
            f"{8 * M * (5 * 20 + 3 + 20 * 4 * 3) / GIB:.1f} GiB, above MAX_TOY_BYTES = 2 GiB")):
        make_ar_toy(T=20, V=3, eos=False)


@pytest.mark.parametrize("V, eos, digits", [
    (3, True, round((10**6 + 1) * math.log10(2))),  # M < 2^(T + 1)
    (5, False, round(10**6 * math.log10(5))),        # M = 5^T
])
def test_a_huge_autoregressive_toy_is_refused_from_its_logarithm(V, eos, digits):
    # T = 10^6: M is never formed (summing its 10^6 powers would take minutes)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"make_ar_toy(T=1000000, V={V}, eos={eos}) would enumerate about 10^{digits} "
            "responses, far above MAX_TOY_BYTES = 2 GiB")):
        make_ar_toy(T=10**6, V=V, eos=eos)


def test_size_messages_print_the_limit_in_gib(monkeypatch):
    monkeypatch.setattr(toy_module, "MAX_TOY_BYTES", 1000 * GIB)
    with pytest.raises(ValueError, match=r"far above MAX_TOY_BYTES = 1000 GiB; choose"):
        make_ar_toy(T=100, V=4, eos=False)
    with pytest.raises(ValueError, match=r"far above MAX_TOY_BYTES = 1000 GiB; choose"):
        make_toy(T=100, V=4)
    with pytest.raises(ValueError, match=r", above MAX_TOY_BYTES = 1000 GiB; choose"):
        make_toy(T=14, V=8)
    with pytest.raises(ValueError, match=r", above MAX_TOY_BYTES = 1000 GiB; choose"):
        make_ar_toy(T=14, V=8)


@pytest.mark.parametrize("T, V, name", [(0, 2, "T"), (2, 0, "V")])
def test_response_count_names_the_argument(T, V, name):
    with pytest.raises(ValueError, match=f"^{name} must be >= 1, got 0$"):
        ar_num_responses(T, V)


def test_moments_of_no_parameter():
    # no parameter at all: nothing to be wrong about
    m = estimator_moments({"p_sampler": np.array([0.5, 0.5]), "true_grad": np.zeros(0)},
                          np.zeros((2, 0)))
    assert m["bias"] == 0.0 and m["rel_bias"] == 0.0
