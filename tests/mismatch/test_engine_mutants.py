"""The cases the full mutation run of opd_literate.mismatch.engine found no test held
(docs/mutation.md): refusals that name what they were given, float32's range closed at its
maximum, row-wise softmaxes, the exact nucleus at its edge, the defaults of
nucleus_disagreement, and what engine_toy returns.

Every expectation is worked out by hand from the documented rule (each test says how), not read
back from the module: exact float64 identities, a float32 range edge, distributions whose
probabilities are simple fractions, and the keys engine_toy documents."""

import math

import numpy as np
import pytest

from opd_literate.mismatch.engine import (
    engine_toy,
    nucleus_disagreement,
    processed_log_probs,
    top_p_kept,
)
from opd_literate.mismatch.toy import make_ar_toy, make_toy, toy_from_logits

FLOAT32_SAMPLERS = ("vllm", "transformers", "sglang")
F32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------
# Refusals name the argument's own type and the toy's own key
# ---------------------------------------------------------------------------------------------
def test_a_sampler_of_the_wrong_type_is_named_with_its_type():
    """_check_sampler_3: the message names the type passed (int), not NoneType."""
    with pytest.raises(TypeError, match=r"got int 1$"):
        processed_log_probs([0.0, 0.0], sampler=1)


def test_a_reported_of_the_wrong_type_is_named_with_its_type():
    """engine_toy_22: the message names the type passed (int), not NoneType."""
    with pytest.raises(TypeError, match=r"reported must be one of .*, got int 1$"):
        engine_toy(make_toy(T=1, V=2), reported=1)


def test_an_autoregressive_toy_without_eos_is_refused_by_name():
    """_check_engine_toy_22: a toy with "mask" must carry "eos"; the refusal names it (a
    ValueError from check_toy, not a KeyError later)."""
    toy = make_ar_toy(T=2, V=2)
    del toy["eos"]
    with pytest.raises(ValueError, match=r"missing the keys \['eos'\]"):
        engine_toy(toy)


def test_the_sampler_logits_are_named_when_they_leave_float32s_range():
    """engine_toy_47, 54, 55, 56: theta = 0 and b = (0, 1e39), mismatch 1: the sampler's logits
    (0, 1e39) are finite in float64 (theta / temperature is fine) but beyond float32's maximum
    3.4e38, and the refusal starts with the name of what overflowed."""
    toy = toy_from_logits([[0.0, 0.0]], [[0.0, 1e39]])
    for sampler in FLOAT32_SAMPLERS:
        with pytest.raises(ValueError, match=r"^theta \+ mismatch \* b must be within float32's "
                                             r"range for sampler="):
            engine_toy(toy, sampler=sampler)


# ---------------------------------------------------------------------------------------------
# float32's range is closed at its maximum
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", FLOAT32_SAMPLERS)
def test_the_largest_float32_logit_is_within_float32s_range(sampler):
    """_scaled_float32_4: |z| = float32 max is representable, so it is accepted. Nothing is cut;
    the float64 log-softmax of (M, 0) is (0, -M) exactly: log(e^0 + e^-M) = log(1) = 0."""
    out = processed_log_probs([F32_MAX, 0.0], sampler=sampler)
    assert out.tolist() == [0.0, -F32_MAX]


@pytest.mark.parametrize("sampler", FLOAT32_SAMPLERS)
def test_the_largest_float32_temperature_is_within_float32s_range(sampler):
    """_scaled_float32_13: temperature = float32 max converts to float32 exactly and is > 0.
    (0, 1) / 3.4e38 is (0, 2.9e-39): both tokens at log(1/2) to within 1e-38."""
    out = processed_log_probs([0.0, 1.0], temperature=F32_MAX, sampler=sampler)
    np.testing.assert_allclose(out, [math.log(0.5)] * 2, rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# The float32 softmax is taken row by row, shifted by its own maximum
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", FLOAT32_SAMPLERS)
def test_min_p_on_logits_far_from_zero(sampler):
    """_softmax_float32_12: logits (400, 0): mu = (1, e^-400), and e^-400 < 0.5 * 1 is cut by
    min-p = 0.5. The kept token is then alone: log-prob 0. (Shifting by +max would overflow
    e^800.)"""
    out = processed_log_probs([400.0, 0.0], min_p=0.5, sampler=sampler)
    assert out.tolist() == [0.0, -math.inf]


@pytest.mark.parametrize("sampler", FLOAT32_SAMPLERS)
def test_min_p_on_rows_of_very_different_scales(sampler):
    """_softmax_float32_13, 15: two uniform rows, one at 0 and one at -800: each is uniform
    (1/2, 1/2), nothing is below 0.5 of its own maximum, both tokens at log(1/2). A maximum
    taken over the whole batch would underflow the second row (e^-800 = 0)."""
    out = processed_log_probs([[0.0, 0.0], [-800.0, -800.0]], min_p=0.5, sampler=sampler)
    np.testing.assert_allclose(out, np.full((2, 2), math.log(0.5)), rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# The exact nucleus: a mass above within NUCLEUS_TOLERANCE of p reaches p
# ---------------------------------------------------------------------------------------------
def test_a_mass_above_exactly_the_tolerance_below_p_reaches_p():
    """_cut_exact_2: t = 0.75 - 1e-12 (float64). 1 - t is exact (Sterbenz: t is in [1/2, 1]),
    t + (1 - t) = 1 exactly, and 1 - (1 - t) = t again, so the mass above the second token is
    exactly t, which is not below 0.75 by more than NUCLEUS_TOLERANCE = 1e-12: it is cut."""
    t = 0.75 - 1e-12
    assert top_p_kept([t, 1.0 - t], 0.75).tolist() == [True, False]


def test_top_p_does_not_restore_a_token_top_k_cut_on_a_long_row():
    """_kept_50: 100,000 tokens, all at logit 0 but the last at -1. top_k = V - 1 cuts the last
    (it is the only one below the (V-1)-th largest, 0). The survivors are uniform; the mass
    above the r-th of them is r / (V - 1) <= 1 - 1e-5, below top_p = nextafter(1, 0) by far, so
    top-p keeps them all, and the cut token stays cut (probability 0) whatever the float64
    cumulative sum of 99,999 equal terms rounds to."""
    V = 100_000
    z = np.zeros(V)
    z[-1] = -1.0
    out = processed_log_probs(z, top_k=V - 1, top_p=float(np.nextafter(1.0, 0.0)))
    assert np.isfinite(out[:-1]).all() and out[-1] == -math.inf
    np.testing.assert_allclose(out[:-1], -math.log(V - 1), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# nucleus_disagreement's documented defaults: four tokens in hundredths
# ---------------------------------------------------------------------------------------------
def test_nucleus_disagreement_defaults_to_four_tokens_in_hundredths():
    """nucleus_disagreement_1, 2: V = 4, resolution = 100: comb(99, 3) = 156,849 rows of four
    positive hundredths, each at the 99 top-p values j / 100."""
    d = nucleus_disagreement("exact")
    assert (d["V"], d["resolution"]) == (4, 100)
    assert d["distributions"] == math.comb(99, 3) == 156_849
    assert d["rows"] == 156_849 * 99


# ---------------------------------------------------------------------------------------------
# engine_toy: the truncated policy's gradient at a temperature, the trainer's p_train, the toy's
# own keys, and an AR toy without <eos>
# ---------------------------------------------------------------------------------------------
def test_masked_grad_carries_one_over_the_temperature():
    """_trainer_76: one position, probabilities (4/6, 1/6, 1/6) at temperature 2: pi_2 is the
    normalised square root, (2, 1, 1) / 4 = (1/2, 1/4, 1/4). Nothing is cut, so the truncated
    policy is pi_2 and masked_grad is grad J_2 = (1 / tau) pi_2(0) (e_0 - pi_2) (R = 1 for token
    0 only) = 0.5 * 0.5 * (1/2, -1/4, -1/4) = (1/8, -1/16, -1/16)."""
    logits = np.log([[4 / 6, 1 / 6, 1 / 6]])
    engine = engine_toy(toy_from_logits(logits, logits), temperature=2.0)
    expected = [[0.125, -0.0625, -0.0625]]
    np.testing.assert_allclose(engine["masked_grad"], expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(engine["true_grad"], expected, rtol=0, atol=1e-15)
    masked = engine_toy(toy_from_logits(logits, logits), temperature=2.0, trainer_mask=True)
    # the trainer's score of token y is (e_y - pi_2) / 2
    np.testing.assert_allclose(masked["score"][:, 0],
                               [[0.25, -0.125, -0.125], [-0.25, 0.375, -0.125],
                                [-0.25, -0.125, 0.375]], rtol=0, atol=1e-15)


def test_p_train_is_restricted_to_the_written_sequences():
    """engine_toy_198, 204: probabilities (0.5, 0.3, 0.2), trainer = sampler, top_p = 0.7: the
    third token (0.8 above it) is cut, the engine writes sequences (0) and (1), and the
    trainer's probabilities of those are 0.5 and 0.3."""
    logits = np.log([[0.5, 0.3, 0.2]])
    engine = engine_toy(toy_from_logits(logits, logits), top_p=0.7)
    assert engine["Y"].tolist() == [[0], [1]]
    np.testing.assert_allclose(engine["p_train"], [0.5, 0.3], rtol=0, atol=1e-15)
    assert "p_trainXX" not in engine


def test_the_toys_theta_b_and_mismatch_come_back_unchanged():
    """engine_toy_248-250, 266-268: "The keys of the toy": theta, b and mismatch are the toy's
    own (mismatch 0.3 of make_toy), not the engine's tempered theta / 2 or its b and
    mismatch = 1 of the enumeration."""
    toy = make_toy(T=2, V=2)
    engine = engine_toy(toy, temperature=2.0)
    np.testing.assert_array_equal(engine["theta"], toy["theta"])
    np.testing.assert_array_equal(engine["b"], toy["b"])
    assert engine["mismatch"] == 0.3


def test_an_autoregressive_toy_without_eos_keeps_every_full_length_response():
    """engine_toy_74: without <eos> every response has T tokens: with T = 2, V = 2 the four
    (0, 0), (0, 1), (1, 0), (1, 1), each of length 2. (With an <eos> token 1, (1) would end at
    once and there would be three.)"""
    toy = make_ar_toy(T=2, V=2, eos=False)
    engine = engine_toy(toy)
    assert sorted(map(tuple, engine["Y"].tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert engine["mask"].tolist() == [[1, 1]] * 4
    assert engine["eos"] is None

