"""The registry, the estimators beyond the lab's eight tasks, the comparison and bad input.

The eight lab estimators have their own test file, ``test_estimators.py`` (the lab's).
"""

import numpy as np
import pytest

from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.toy import estimator_moments, make_toy, sample_from_sampler

SWEEP = [0.0, 0.1, 0.3, 0.6, 1.0, 1.5]


def test_at_zero_mismatch_every_estimator_admitting_rho_one_equals_naive():
    toy = make_toy(mismatch=0.0)
    expected = E.naive(toy)
    assert estimator_moments(toy, expected)["rel_bias"] < 1e-12
    for name, spec in E.REGISTRY.items():
        np.testing.assert_allclose(spec.fn(toy, **spec.defaults), expected, rtol=1e-12,
                                   atol=1e-15, err_msg=name)


def test_infinite_caps_and_full_bands_remove_the_correction():
    toy = make_toy(mismatch=0.8)
    np.testing.assert_array_equal(E.seq_tis(toy, cap=np.inf), E.seq_is(toy))
    np.testing.assert_array_equal(E.token_tis(toy, cap=1e300), E.token_is(toy))
    np.testing.assert_array_equal(E.token_mis(toy, low=0.0, high=np.inf), E.token_is(toy))
    np.testing.assert_array_equal(E.seq_mis(toy, low=0.0, high=np.inf), E.seq_is(toy))
    rho = np.exp((toy["logp_train"] - toy["logp_sampler"]).sum(1))
    band = (rho.min() * 0.999, rho.max() * 1.001)
    np.testing.assert_array_equal(E.seq_mis(toy, *band), E.seq_is(toy))
    np.testing.assert_array_equal(E.icepop(toy, 0.0, np.inf), E.token_is(toy))
    np.testing.assert_array_equal(E.geo_rs(toy, 0.0, np.inf), E.naive(toy))
    np.testing.assert_array_equal(E.k3_seq_rs(toy, threshold=np.inf), E.naive(toy))


def test_ppo_clip_bypass_zeroes_only_in_the_advantage_direction():
    toy = make_toy(mismatch=1.0)
    rho_t = np.exp(toy["logp_train"] - toy["logp_sampler"])
    A = toy["R"][:, None] - 0.5
    # PPO's clip alone (no dual clip): one-sided in the advantage's direction
    w = E.ppo_clip_bypass(toy, eps=0.2, clip_ratio_c=np.inf, baseline=0.5, return_weights=True)
    zeroed = w == 0
    assert (zeroed == (((A > 0) & (rho_t > 1.2)) | ((A < 0) & (rho_t < 0.8)))).all()
    np.testing.assert_array_equal(w[~zeroed], rho_t[~zeroed])


def test_ppo_clip_bypass_dual_clip_removes_negative_advantage_tokens_above_c():
    """verl's vanilla PPO loss: for A < 0 the loss is min(L, -c A), constant once rho_t > c."""
    toy = make_toy(mismatch=1.0)
    rho_t = np.exp(toy["logp_train"] - toy["logp_sampler"])
    A = toy["R"][:, None] - 0.5
    w = E.ppo_clip_bypass(toy, baseline=0.5, return_weights=True)  # eps 0.2, c = 3
    dual = (A < 0) & (rho_t > 3.0)
    assert toy["p_sampler"] @ dual.any(axis=1) > 0.01  # the dual clip bites on this toy
    expected = np.where(((A > 0) & (rho_t > 1.2)) | ((A < 0) & (rho_t < 0.8)) | dual, 0.0, rho_t)
    np.testing.assert_array_equal(w, expected)
    # a smaller c removes more: every token with A < 0 and rho_t > 2
    w2 = E.ppo_clip_bypass(toy, clip_ratio_c=2.0, baseline=0.5, return_weights=True)
    assert ((w2 == 0) == ((expected == 0) | ((A < 0) & (rho_t > 2.0)))).all()
    # at baseline 0 no advantage is negative: the dual clip never bites
    np.testing.assert_array_equal(E.ppo_clip_bypass(toy, clip_ratio_c=1.01),
                                  E.ppo_clip_bypass(toy, clip_ratio_c=np.inf))
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        E.ppo_clip_bypass(toy, clip_ratio_c=1.0)


def test_monte_carlo_mean_agrees_with_exact_mean_within_four_standard_errors():
    toy = make_toy(mismatch=0.5)
    rng = np.random.default_rng(0)
    N = 40_000
    for name in ("naive", "token_tis", "seq_is"):
        spec = E.REGISTRY[name]
        per_seq = spec.fn(toy, **spec.defaults)
        exact = estimator_moments(toy, per_seq)["mean"]
        draws = sample_from_sampler(toy, N, rng)
        mc_mean = per_seq[draws].mean(axis=0)
        # exact per-coordinate standard error of a mean of N draws
        per_coord_var = np.einsum("m,mtv->tv", toy["p_sampler"], (per_seq - exact) ** 2)
        se = np.sqrt(per_coord_var / N)
        assert (np.abs(mc_mean - exact) <= 4 * se + 1e-15).all(), name


def test_comparison_table_fractions_are_exact_probabilities():
    toy = make_toy(mismatch=0.6)
    rows = {r["name"]: r for r in E.comparison_table(toy, N=32)}
    rho_t = np.exp(toy["logp_train"] - toy["logp_sampler"])
    mu = toy["p_sampler"]
    assert rows["token_tis"]["token_frac"] == pytest.approx(float(mu @ (rho_t > 2.0).mean(1)))
    assert rows["token_tis"]["seq_frac"] == pytest.approx(float(mu @ (rho_t > 2.0).any(1)))
    assert rows["naive"]["token_frac"] == 0.0 and rows["seq_is"]["seq_frac"] == 0.0
    m = estimator_moments(toy, E.seq_tis(toy))
    assert rows["seq_tis"]["rel_rmse"] == pytest.approx(m["rel_rmse"](32))
    assert set(rows) == set(E.REGISTRY)
    assert "| `seq_is` |" in E.format_table(list(rows.values()))


def test_mismatch_sweep_structure():
    sweep = E.mismatch_sweep([0.0, 0.2], names=["naive", "seq_is"], T=3, V=3)
    assert list(sweep) == [0.0, 0.2]
    assert [r["name"] for r in sweep[0.2]] == ["naive", "seq_is"]


def test_overflowing_ratios_give_a_clear_error_not_nan():
    # The thresholds the toy docstring states: sequence ratios overflow from mismatch ~38.2 on,
    # per-token ratios from ~164.3 on (log(float max) = 709.8).
    assert np.isfinite(E.seq_is(make_toy(mismatch=38.1))).all()
    with pytest.raises(ValueError, match="sequence importance ratios overflow float64"):
        E.seq_is(make_toy(mismatch=38.3))
    assert np.isfinite(E.token_is(make_toy(mismatch=164.2))).all()
    with pytest.raises(ValueError, match="per-token importance ratios overflow float64"):
        E.token_is(make_toy(mismatch=164.4))
    with pytest.raises(ValueError, match="per-token importance ratios overflow float64"):
        E.token_is(make_toy(mismatch=1000.0))
    toy = make_toy(mismatch=50.0)
    assert np.isfinite(E.token_is(toy)).all()
    with pytest.raises(ValueError, match="sequence importance ratios overflow float64"):
        E.seq_is(toy)
    # Truncated and masked sequence ratios stay finite: computed in log space.
    log_rho = (toy["logp_train"] - toy["logp_sampler"]).sum(axis=1)
    assert log_rho.max() > 709.8
    w = E.seq_tis(toy, return_weights=True)
    np.testing.assert_allclose(w, np.exp(np.minimum(log_rho, np.log(2.0))), rtol=1e-12)
    w = E.seq_mis(toy, return_weights=True)
    inside = log_rho <= np.log(2.0)
    np.testing.assert_allclose(w, np.where(inside, np.exp(np.minimum(log_rho, 1.0)), 0.0),
                               rtol=1e-12)
    assert np.isfinite(E.geo_rs(toy)).all()  # the geometric mean itself is representable


def test_huge_baseline_is_a_clear_error_not_inf_or_nan():
    toy = make_toy(T=2, V=2, mismatch=1.0)
    with pytest.raises(ValueError, match=r"overflow float64 \(baseline=-1.7e\+308"):
        E.seq_is(toy, baseline=-1.7e308)
    assert np.isfinite(E.seq_is(toy, baseline=-1e300)).all()


class TestBadInput:
    def test_missing_keys(self):
        with pytest.raises(ValueError, match="toy is missing the keys"):
            E.naive({"R": np.zeros(2)})

    @pytest.mark.parametrize("call, message", [
        (lambda t: E.token_tis(t, cap=0.0), "cap must be > 0, got 0.0"),
        (lambda t: E.seq_tis(t, cap=-1), "cap must be > 0, got -1"),
        (lambda t: E.token_mis(t, low=3.0, high=2.0),
         "low must be <= high, got low=3.0 > high=2.0"),
        (lambda t: E.seq_mis(t, low=float("nan")), "low must be a finite number, got nan"),
        (lambda t: E.geo_rs(t, high=float("nan")), "high must be a finite number, got nan"),
        (lambda t: E.naive(t, baseline=float("inf")), "baseline must be a finite number, got inf"),
        (lambda t: E.seq_is(t, baseline=float("nan")), "baseline must be a finite number"),
        (lambda t: E.ppo_clip_bypass(t, eps=0), "eps must be > 0"),
        (lambda t: E.token_veto(t, threshold=-1e-4), "threshold must be >= 0"),
        (lambda t: E.comparison_table(t, names=["nope"]), "unknown estimator 'nope'"),
    ])
    def test_errors_name_the_parameter(self, call, message):
        with pytest.raises(ValueError, match=message):
            call(make_toy(T=2, V=2))


def test_k3_rejection_of_an_overflowing_ratio_is_silent_and_rejects():
    toy = make_toy(mismatch=1000.0)  # some rho_t overflow float64: k3 = inf, rejected
    weights = E.k3_seq_rs(toy, threshold=1e300, return_weights=True)
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    overflowing = log_rho_t.max(axis=1) > 709.8
    assert overflowing.any() and (weights[overflowing] == 0).all()
