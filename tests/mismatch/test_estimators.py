"""The numpy catalogue of ``opd_literate.mismatch.estimators`` beyond the lab's eight weights
(those are in ``test_lab_estimators.py``, the lab's own file): the registry, the estimators
beyond the lab's eight tasks, the comparison and bad input; every statement of the
estimators' docstrings and of docs/mismatch.md, checked exactly; and the lines mutation
testing found unchecked.
"""

import math

import numpy as np
import pytest

from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.estimators import (
    REGISTRY,
    comparison_table,
    estimator_weights,
    format_table,
    mismatch_sweep,
    weighted_score,
)
from opd_literate.mismatch.opd_mismatch import opd_mismatch_table
from opd_literate.mismatch.toy import (
    ar_toy_from_logits,
    estimator_moments,
    log_softmax,
    make_ar_toy,
    make_toy,
    sample_from_sampler,
    toy_from_logits,
)

# The registry, the estimators beyond the lab's eight tasks, the comparison and bad input.


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


# Every statement of the estimators' docstrings and of docs/mismatch.md, checked exactly.
#
# Each test would fail on the statement or the code it replaced: the table computed without the
# baseline, a "second order" bias, a C^2 bound on the variance, the truncation-bias formulas with
# a plus sign, a chi-square product formula stated without its condition.


def rhos(toy):
    """(rho_t (M, T), rho (M,)) from the toy's log-probabilities."""
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    return np.exp(log_rho_t), np.exp(log_rho_t.sum(axis=1))


def advantage_times_score(toy, baseline):
    """A * sum_t s_t placed on its rows: the (M, T, V) REINFORCE term of each sequence."""
    return (toy["R"] - baseline)[:, None, None] * toy["score"]


# ---------------------------------------------------------------------------------------------
# Item 1: the comparison table passes the baseline to the weights
# ---------------------------------------------------------------------------------------------
def test_every_row_of_the_table_equals_the_estimator_called_directly():
    toy = make_toy(mismatch=1.0)
    rows = {r["name"]: r for r in E.comparison_table(toy, N=64, baseline=0.5)}
    assert set(rows) == set(E.REGISTRY) and len(rows) == 30
    for name, spec in E.REGISTRY.items():
        direct = estimator_moments(toy, spec.fn(toy, **spec.defaults, baseline=0.5))
        for key in ("bias", "var", "rel_bias"):
            assert rows[name][key] == pytest.approx(direct[key], rel=1e-12, abs=1e-15), name
        assert rows[name]["rel_rmse"] == pytest.approx(direct["rel_rmse"](64), rel=1e-12), name
    # The two whose weights depend on the advantage's sign (the figures: the table
    # without the baseline said 0.48 and 5.26).
    assert rows["ppo_clip_bypass"]["rel_bias"] > 4.0
    assert rows["gspo"]["rel_bias"] < 1.0


def test_mismatch_sweep_passes_the_baseline_too():
    sweep = E.mismatch_sweep([1.0], names=["ppo_clip_bypass", "gspo"], baseline=0.5)
    toy = make_toy(mismatch=1.0)
    for row in sweep[1.0]:
        spec = E.REGISTRY[row["name"]]
        direct = estimator_moments(toy, spec.fn(toy, **spec.defaults, baseline=0.5))
        assert row["rel_bias"] == pytest.approx(direct["rel_bias"], rel=1e-12)


def test_unknown_names_in_params_are_clear_errors():
    toy = make_toy(T=2, V=2)
    with pytest.raises(ValueError, match="unknown estimator 'token_tsi'"):
        E.comparison_table(toy, params={"token_tsi": {"cap": 3.0}})
    with pytest.raises(ValueError, match=r"params names estimators that are not compared: "
                                         r"\['seq_tis'\]"):
        E.comparison_table(toy, names=["token_tis"], params={"seq_tis": {"cap": 3.0}})
    with pytest.raises(ValueError, match=r"unknown parameters \['capp'\] for estimator "
                                         r"'token_tis'; it takes \['cap'\]"):
        E.comparison_table(toy, params={"token_tis": {"capp": 3.0}})
    rows = E.comparison_table(toy, names=["token_tis"], params={"token_tis": {"cap": 0.5}})
    assert rows[0]["token_frac"] > 0


# ---------------------------------------------------------------------------------------------
# Item 4: token_is is biased at first order in the mismatch
# ---------------------------------------------------------------------------------------------
def test_token_is_bias_is_first_order_in_the_mismatch():
    def bias(e):
        toy = make_toy(mismatch=e)
        return estimator_moments(toy, E.token_is(toy))["bias"]

    ratios = [bias(2 * e) / bias(e) for e in (0.1, 0.05, 0.025, 0.0125)]
    # bias(2e) / bias(e) -> 2 (first order); a second-order bias would give 4.
    assert all(abs(r - 2) > abs(s - 2) for r, s in zip(ratios, ratios[1:]))
    assert abs(ratios[-1] - 2) < 0.01


# ---------------------------------------------------------------------------------------------
# Item 5: C^2 bounds the second moment of seq_tis, not its variance
# ---------------------------------------------------------------------------------------------
def second_moment(toy, estimate):
    return float(np.einsum("m,mtv,mtv->", toy["p_sampler"], estimate, estimate))


@pytest.mark.parametrize("mismatch, cap, baseline", [(0.3, 2.0, 0.0), (1.0, 1.5, 0.4),
                                                     (1.5, 3.0, -0.3)])
def test_seq_tis_second_moment_is_at_most_c_squared_times_naive(mismatch, cap, baseline):
    toy = make_toy(mismatch=mismatch)
    tis = second_moment(toy, E.seq_tis(toy, cap=cap, baseline=baseline))
    assert tis <= cap**2 * second_moment(toy, E.naive(toy, baseline=baseline))


def test_seq_tis_variance_is_not_bounded_by_c_squared_times_naive():
    toy = make_toy(T=1, V=2, mismatch=0.5)
    baseline = float(np.exp(log_softmax(toy["theta"]))[0, 1])  # pi(1)
    naive = estimator_moments(toy, E.naive(toy, baseline=baseline))
    tis = estimator_moments(toy, E.seq_tis(toy, cap=2.0, baseline=baseline))
    assert naive["var"] < 1e-30 and naive["bias"] < 1e-15  # the same estimate for both tokens
    assert tis["var"] > 1e-3 > 2.0**2 * naive["var"]


def test_naive_is_unbiased_for_one_position_two_tokens_at_baseline_pi1_whatever_mu():
    """The counterexample to "naive is biased whenever mu != pi" (its docstring states it)."""
    for mismatch in (0.5, 1.0, 3.0):
        toy = make_toy(T=1, V=2, mismatch=mismatch, seed=4)
        baseline = float(np.exp(log_softmax(toy["theta"]))[0, 1])
        assert estimator_moments(toy, E.naive(toy))["rel_bias"] > 0.01
        assert estimator_moments(toy, E.naive(toy, baseline=baseline))["rel_bias"] < 1e-12


# ---------------------------------------------------------------------------------------------
# Item 6: the truncation-bias formulas, with their minus sign
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mismatch, cap, baseline", [(0.3, 2.0, 0.0), (1.0, 1.5, 0.4),
                                                     (0.6, 0.8, -0.2)])
def test_seq_tis_bias_is_minus_the_mass_above_the_cap(mismatch, cap, baseline):
    toy = make_toy(mismatch=mismatch)
    _, rho = rhos(toy)
    bias_vector = estimator_moments(toy, E.seq_tis(toy, cap=cap, baseline=baseline))["mean"] \
        - toy["true_grad"]
    above = np.maximum(rho - cap, 0.0)
    formula = -np.einsum("m,m,mtv->tv", toy["p_sampler"], above,
                         advantage_times_score(toy, baseline))
    assert np.abs(formula).max() > 1e-3  # the sign is visible
    np.testing.assert_allclose(bias_vector, formula, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("mismatch, low, high, baseline", [(0.3, 0.0, 2.0, 0.0),
                                                           (1.0, 0.5, 2.0, 0.4)])
def test_seq_mis_bias_is_minus_the_dropped_mass(mismatch, low, high, baseline):
    toy = make_toy(mismatch=mismatch)
    _, rho = rhos(toy)
    bias_vector = estimator_moments(
        toy, E.seq_mis(toy, low=low, high=high, baseline=baseline))["mean"] - toy["true_grad"]
    dropped = rho * ~((rho >= low) & (rho <= high))
    formula = -np.einsum("m,m,mtv->tv", toy["p_sampler"], dropped,
                         advantage_times_score(toy, baseline))
    assert np.abs(formula).max() > 1e-3
    np.testing.assert_allclose(bias_vector, formula, rtol=1e-9, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# Item 7: what holds only for independent positions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T, V, mismatch, seed", [(6, 4, 0.3, 0), (4, 3, 1.0, 2), (3, 5, 1.5, 7)])
def test_chi_square_product_formula_holds_on_the_independent_toy(T, V, mismatch, seed):
    toy = make_toy(T=T, V=V, mismatch=mismatch, seed=seed)
    _, rho = rhos(toy)
    second = float(toy["p_sampler"] @ rho**2)  # E_mu[rho^2], enumerated
    pi = np.exp(log_softmax(toy["theta"]))
    mu = np.exp(log_softmax(toy["theta"] + mismatch * toy["b"]))
    chi2 = (pi**2 / mu).sum(axis=1) - 1  # chi^2(pi_t || mu_t), from the tables alone
    assert second == pytest.approx(np.prod(1 + chi2), rel=1e-10)
    assert second > 1.01


# ---------------------------------------------------------------------------------------------
# The module docstring: the variance trade does not always pay
# ---------------------------------------------------------------------------------------------
def test_every_other_estimator_has_less_variance_than_seq_is_at_the_default_mismatch():
    rows = {r["name"]: r for r in E.comparison_table(make_toy())}
    assert all(r["var"] < rows["seq_is"]["var"] for n, r in rows.items() if n != "seq_is")


def test_but_token_is_has_more_variance_than_seq_is_at_mismatch_0_05():
    toy = make_toy(mismatch=0.05)
    assert estimator_moments(toy, E.token_is(toy))["var"] > \
        estimator_moments(toy, E.seq_is(toy))["var"]


# ---------------------------------------------------------------------------------------------
# verl's rules, written here from its source (rollout_corr_helper.py at E.VERL_COMMIT)
# ---------------------------------------------------------------------------------------------
def verl_k1_keep(k1_statistic, spec):
    """verl's k1 band: "a_b" keeps log a <= statistic <= log b; a float h means a = 1 / h."""
    if isinstance(spec, str):
        lower, upper = (float(x) for x in spec.split("_"))
    else:
        lower, upper = 1.0 / spec, float(spec)
    return (k1_statistic >= np.log(lower)) & (k1_statistic <= np.log(upper))


def test_geo_rs_defaults_are_verls_seq_mean_k1_preset():
    for mismatch in (0.002, 0.01, 0.3):
        toy = make_toy(mismatch=mismatch)
        k1 = -(toy["logp_train"] - toy["logp_sampler"])  # verl's token_k1 = -log rho_t
        keep = verl_k1_keep(k1.mean(axis=1), "0.999_1.001")  # seq_mean_k1
        np.testing.assert_array_equal(E.geo_rs(toy, return_weights=True), keep.astype(float))
    assert 0 < keep.mean() < 1 or mismatch == 0.3


def test_seq_mis_at_half_and_two_is_verls_decoupled_seq_is_rs_preset():
    toy = make_toy(mismatch=0.6)
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    keep = verl_k1_keep(-log_rho_t.sum(axis=1), "0.5_2.0")  # seq_sum_k1
    # rollout_is=sequence with threshold 2.0: min(rho, 2) on the kept sequences
    expected = np.where(keep, np.minimum(np.exp(log_rho_t.sum(axis=1)), 2.0), 0.0)
    np.testing.assert_allclose(E.seq_mis(toy, 0.5, 2.0, return_weights=True), expected,
                               rtol=1e-12)
    assert 0 < keep.mean() < 1


def test_token_mis_at_half_and_two_is_verls_token_k1_with_threshold_two():
    toy = make_toy(mismatch=0.6)
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    keep = verl_k1_keep(-log_rho_t, 2.0)  # token_k1, rollout_rs_threshold: 2.0
    expected = np.where(keep, np.minimum(np.exp(log_rho_t), 2.0), 0.0)  # rollout_is=token
    np.testing.assert_allclose(E.token_mis(toy, 0.5, 2.0, return_weights=True), expected,
                               rtol=1e-12)
    assert 0 < keep.mean() < 1


def test_ppo_clip_bypass_is_the_gradient_of_verls_dual_clip_loss():
    """Autograd through verl's vanilla loss formula (written out here) at theta_old = theta."""
    torch = pytest.importorskip("torch")
    toy = make_toy(T=3, V=3, mismatch=1.2, seed=5)
    log_rho = torch.tensor(toy["logp_train"] - toy["logp_sampler"], requires_grad=True)
    A = torch.tensor(toy["R"] - 0.5)[:, None].expand_as(log_rho)
    ratio = torch.exp(log_rho)
    losses1 = -A * ratio
    losses2 = -A * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
    clip1 = torch.maximum(losses1, losses2)
    clip2 = torch.minimum(-A * 3.0, clip1)
    loss = torch.where(A < 0, clip2, clip1).sum()
    loss.backward()
    # d loss / d log pi(y_t) = -w_t A: the weight is -grad / A
    weights = (-log_rho.grad / A).numpy()
    np.testing.assert_allclose(E.ppo_clip_bypass(toy, baseline=0.5, return_weights=True),
                               weights, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# docs/mismatch.md: the sentences under the table
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_rows():
    return {r["name"]: r for r in E.comparison_table(make_toy(), N=64)}


def test_seq_is_has_the_worst_rmse_of_the_three_at_batch_64(default_rows):
    assert default_rows["seq_is"]["rel_rmse"] > default_rows["naive"]["rel_rmse"]
    assert default_rows["seq_is"]["rel_bias"] < 1e-12


def test_verl_presets_reject_almost_every_sequence_of_the_toy(default_rows):
    for name in ("geo_rs", "k3_seq_rs", "geo_rs_token_tis"):
        assert default_rows[name]["seq_frac"] > 0.99, name


def test_ppo_clip_in_bypass_mode_has_more_bias_than_no_correction(default_rows):
    assert default_rows["ppo_clip_bypass"]["rel_bias"] > default_rows["naive"]["rel_bias"]


def test_wide_bands_coincide_with_their_uncorrected_estimator():
    toy = make_toy()
    np.testing.assert_array_equal(E.icepop(toy), E.token_is(toy))
    np.testing.assert_array_equal(E.cispo(toy), E.token_is(toy))
    np.testing.assert_array_equal(E.token_veto(toy), E.naive(toy))
    np.testing.assert_array_equal(E.dppo_tv(toy), E.token_is(toy))
    np.testing.assert_array_equal(E.dppo_kl(toy), E.token_is(toy))


def test_dppo_coincides_with_token_is_at_the_default_mismatch_for_the_stated_reasons():
    """"No token's probability differs by more than 0.2, nor does its binary KL exceed 0.2,
    and no ratio exceeds their cap of 3" (so the regions and the cap never bite)."""
    toy = make_toy()
    p, q = np.exp(toy["logp_train"]), np.exp(toy["logp_sampler"])
    kl = q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))
    assert np.abs(p - q).max() < 0.2 and kl.max() < 0.2 and (p / q).max() < 3.0


def test_dppo_removes_fewer_tokens_than_ppos_clip_with_less_bias_but_more_than_token_is():
    """docs/mismatch.md, under the table at mismatch 1.0 and baseline 0.5."""
    rows = {r["name"]: r for r in E.comparison_table(make_toy(mismatch=1.0), N=64, baseline=0.5)}
    for name in ("dppo_tv", "dppo_kl"):
        assert 0 < rows[name]["token_frac"] < rows["ppo_clip_bypass"]["token_frac"], name
        assert rows["token_is"]["rel_bias"] < rows[name]["rel_bias"], name
        assert rows[name]["rel_bias"] < rows["ppo_clip_bypass"]["rel_bias"], name


def test_masking_has_more_bias_and_less_variance_than_truncation(default_rows):
    for masked, truncated in (("token_mis", "token_tis"), ("seq_mis", "seq_tis")):
        assert default_rows[masked]["rel_bias"] > default_rows[truncated]["rel_bias"]
        assert default_rows[masked]["var"] < default_rows[truncated]["var"]


def test_the_sampler_log_prob_is_worse_than_any_trainer_recipe_in_the_opd_table():
    rows = opd_mismatch_table([0.1, 0.3, 0.5, 1.0, 1.5])
    for mismatch in (0.1, 0.3, 0.5, 1.0, 1.5):
        at = [r for r in rows if r["mismatch"] == mismatch]
        best_sampler = min(r["rel_bias"] for r in at if r["logp"] == "sampler")
        worst_trainer = max(r["rel_bias"] for r in at if r["logp"] == "trainer")
        assert best_sampler > worst_trainer, mismatch


# ---------------------------------------------------------------------------------------------
# The hand-made toy of the examples
# ---------------------------------------------------------------------------------------------
def test_the_hand_made_toy_has_the_ratios_the_examples_state():
    two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    rho_t, rho = rhos(two)
    np.testing.assert_allclose(rho_t, [[0.625, 0.625], [0.625, 2.5], [2.5, 0.625], [2.5, 2.5]])
    np.testing.assert_allclose(rho, [0.390625, 1.5625, 1.5625, 6.25])
    np.testing.assert_array_equal(two["R"], [1.0, 1.0, 1.0, 0.0])


# Found by mutation testing (docs/mutation.md): each estimator's weights are rebuilt here
# from the formula of its docstring (numpy, on the ratios rho_t = exp(log pi - log mu)), with the
# defaults the registry and the signatures document, on toys where every bound bites; band edges
# are hit exactly at mismatch 0, where every ratio is exactly 1. Error messages are matched in
# full, so each names its argument.


NAN, INF = float("nan"), float("inf")


def _toys():
    return {
        "m0": make_toy(T=3, V=3, mismatch=0.0, seed=0),      # every ratio is exactly 1
        "m0.002": make_toy(T=3, V=3, mismatch=0.002, seed=0),  # ratios near 1: tight bands
        "m1": make_toy(T=3, V=3, mismatch=1.0, seed=0),      # ratios 0.26 .. 3.8
        "m2": make_toy(T=3, V=3, mismatch=2.0, seed=0),      # ratios 0.14 .. 19.5
        "ar": make_ar_toy(T=3, V=3, mismatch=1.0, seed=2),   # padding after <eos>
        # rho_t = (2.5, 0.4, 1) at both positions: the sequence (0, 1) has rho_geo = 1 (inside
        # geo_rs's tight band) with a token ratio above the cap 2
        "cancel": toy_from_logits(np.log([[0.5, 0.2, 0.3]] * 2), np.log([[0.2, 0.5, 0.3]] * 2)),
    }


TOYS = _toys()


def _parts(toy):
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    mask = toy.get("mask", np.ones(log_rho_t.shape))
    log_rho_t = log_rho_t * mask
    n = mask.sum(axis=1)
    rho_t = np.exp(log_rho_t)
    rho = np.exp(log_rho_t.sum(axis=1))
    geo = np.exp(log_rho_t.sum(axis=1) / n)
    return rho_t, rho, geo, mask


def reference(name, toy, baseline=0.0, **p):
    """The (M, T) or (M,) weights of the docstrings' formulas."""
    rho_t, rho, geo, mask = _parts(toy)
    A = toy["R"] - baseline
    At = A[:, None]
    if name == "naive":
        return np.ones_like(rho_t)
    if name == "token_is":
        return rho_t
    if name == "seq_is":
        return rho
    if name == "token_tis":
        return np.minimum(rho_t, p["cap"])
    if name == "seq_tis":
        return np.minimum(rho, p["cap"])
    if name in ("token_mis", "icepop"):
        return np.where((p["low"] <= rho_t) & (rho_t <= p["high"]), rho_t, 0.0)
    if name == "seq_mis":
        return np.where((p["low"] <= rho) & (rho <= p["high"]), rho, 0.0)
    if name == "geo_rs":
        return ((p["low"] <= geo) & (geo <= p["high"])) * 1.0
    if name == "token_clamp":
        return np.minimum(np.maximum(rho_t, p["low"]), p["high"])
    if name == "cispo":
        return np.minimum(np.maximum(rho_t, max(1 - p["eps_low"], 0.0)), 1 + p["eps_high"])
    if name == "ppo_clip_bypass":
        cut = (((At > 0) & (rho_t > 1 + p["eps"])) | ((At < 0) & (rho_t < 1 - p["eps"]))
               | ((At < 0) & (rho_t > p["clip_ratio_c"])))
        return rho_t * (1 - cut)
    if name == "token_veto":
        return (np.where(mask > 0, rho_t, INF).min(axis=1) >= p["threshold"]) * 1.0
    if name == "k3_seq_rs":
        k3 = (rho_t - 1 - np.log(rho_t)) * mask
        return (k3.sum(axis=1) / mask.sum(axis=1) <= p["threshold"]) * 1.0
    if name == "geo_rs_token_tis":
        keep = (p["low"] <= geo) & (geo <= p["high"])
        return keep[:, None] * np.minimum(rho_t, p["cap"])
    if name == "gspo":
        cut = ((A > 0) & (geo > 1 + p["eps_high"])) | ((A < 0) & (geo < 1 - p["eps_low"]))
        return geo * (1 - cut)
    if name in ("dppo_tv", "dppo_kl"):
        pi, mu = np.exp(toy["logp_train"]), np.exp(toy["logp_sampler"])
        if name == "dppo_tv":
            up, down = pi - mu <= p["delta_high"], pi - mu >= -p["delta_low"]
        else:  # the binary KL(mu || pi) as verl writes it, with its 1e-8
            kl = mu * np.log(mu / pi) + (1 - mu) * np.log((1 - mu + 1e-8) / (1 - pi + 1e-8))
            up, down = (kl <= p["delta_high"]) | (pi <= mu), (kl <= p["delta_low"]) | (pi >= mu)
        return np.minimum(rho_t, p["clip_ratio_c"]) * np.where(At > 0, up, down)
    raise KeyError(name)


# The defaults as the signatures and the registry document them.
DEFAULTS = {
    "naive": {}, "token_is": {}, "seq_is": {},
    "token_tis": {"cap": 2.0}, "seq_tis": {"cap": 2.0},
    "token_mis": {"low": 0.0, "high": 2.0}, "seq_mis": {"low": 0.0, "high": 2.0},
    "geo_rs": {"low": 1 / 1.001, "high": 1 / 0.999},
    "icepop": {"low": 0.5, "high": 5.0}, "token_clamp": {"low": 0.5, "high": 2.0},
    "cispo": {"eps_low": 1.0, "eps_high": 4.0},
    "ppo_clip_bypass": {"eps": 0.2, "clip_ratio_c": 3.0},
    "token_veto": {"threshold": 1e-4}, "k3_seq_rs": {"threshold": 0.01},
    "geo_rs_token_tis": {"low": 1 / 1.001, "high": 1 / 0.999, "cap": 2.0},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
    "dppo_tv": {"delta_low": 0.2, "delta_high": 0.2, "clip_ratio_c": 3.0},
    "dppo_kl": {"delta_low": 0.2, "delta_high": 0.2, "clip_ratio_c": 3.0},
}

# Non-default parameters that move every bound.
OTHER = {
    "token_tis": {"cap": 1.5}, "seq_tis": {"cap": 1.5},
    "token_mis": {"low": 0.5, "high": 1.5}, "seq_mis": {"low": 0.5, "high": 1.5},
    "geo_rs": {"low": 0.8, "high": 1.3}, "icepop": {"low": 0.3, "high": 3.0},
    "token_clamp": {"low": 0.8, "high": 1.4}, "cispo": {"eps_low": 0.3, "eps_high": 0.5},
    "ppo_clip_bypass": {"eps": 0.5, "clip_ratio_c": 1.5},
    "token_veto": {"threshold": 0.5}, "k3_seq_rs": {"threshold": 0.3},
    "geo_rs_token_tis": {"low": 0.8, "high": 1.3, "cap": 1.5},
    "gspo": {"eps_low": 0.2, "eps_high": 0.3},
    "dppo_tv": {"delta_low": 0.05, "delta_high": 0.1, "clip_ratio_c": 1.5},
    "dppo_kl": {"delta_low": 0.02, "delta_high": 0.05, "clip_ratio_c": 1.5},
}


# The other frameworks' seven, rebuilt and checked in test_peer_switches.py.
PEER_SWITCHES = {"trl_token_truncate", "trl_token_mask", "trl_sequence_truncate",
                 "trl_sequence_mask", "off_policy_mask", "seq_mask_tis", "kpop"}
# verl's and TRL's other policy losses, rebuilt and checked in test_policy_losses.py.
POLICY_LOSSES = {"sapo", "gmpo", "clip_cov", "luspo", "vespo"}


def test_the_defaults_are_the_registrys():
    assert set(DEFAULTS) | PEER_SWITCHES | POLICY_LOSSES == set(REGISTRY)
    assert not set(DEFAULTS) & (PEER_SWITCHES | POLICY_LOSSES)
    for name in DEFAULTS:
        assert REGISTRY[name].defaults == DEFAULTS[name]


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("baseline", [0.0, 0.5, 1.0])  # A = 0 for R = baseline
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_weights_with_the_defaults_are_the_formula(name, toy_name, baseline):
    toy = TOYS[toy_name]
    fn = getattr(E, name)
    want = reference(name, toy, baseline, **DEFAULTS[name])
    got = fn(toy, baseline=baseline, return_weights=True)  # the signature's defaults
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # the estimate is w_t (R - b) s_t, checked on the weights above
    w = want if want.ndim == 2 else want[:, None]
    extra = (1,) * (toy["score"].ndim - 2)
    est = (w * (toy["R"] - baseline)[:, None]).reshape(w.shape + extra) * toy["score"]
    np.testing.assert_allclose(fn(toy, baseline=baseline), est, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("toy_name", ["m1", "m2", "ar", "m0.002", "cancel"])
@pytest.mark.parametrize("baseline", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", sorted(OTHER))
def test_weights_with_other_parameters_are_the_formula(name, toy_name, baseline):
    toy = TOYS[toy_name]
    want = reference(name, toy, baseline, **OTHER[name])
    got = getattr(E, name)(toy, **OTHER[name], baseline=baseline, return_weights=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # estimator_weights passes the parameters and the baseline on, (M, T) always
    ew = estimator_weights(toy, name, baseline=baseline, **OTHER[name])
    assert ew.shape == toy["logp_train"].shape and ew.dtype == np.float64
    flat = want if want.ndim == 2 else np.repeat(want[:, None], ew.shape[1], axis=1)
    np.testing.assert_allclose(ew, flat, rtol=1e-12, atol=0)


def test_the_bounds_bite_on_these_toys():
    rho_t, _, geo, _ = _parts(TOYS["cancel"])
    kept = (geo >= 1 / 1.001) & (geo <= 1 / 0.999)
    assert (rho_t[kept] > 2).any()
    rho_t = _parts(TOYS["m2"])[0]
    # icepop's and cispo's defaults bite, and the band [5, 6] is not empty
    assert ((5 < rho_t) & (rho_t < 6)).any() and rho_t.max() > 6 and rho_t.min() < 0.2
    rho_t, _, geo, _ = _parts(TOYS["m1"])
    assert ((3 < rho_t) & (rho_t < 4)).any()  # ppo's dual clip c = 3
    near = _parts(TOYS["m0.002"])[2]
    assert ((near > 1 / 1.001) & (near < 1 / 0.999)).any() and (near > 1 / 0.999).any()


@pytest.mark.parametrize("name, params", [
    ("token_mis", {"low": 1.0, "high": 1.0}), ("seq_mis", {"low": 1.0, "high": 1.0}),
    ("icepop", {"low": 1.0, "high": 1.0}), ("geo_rs", {"low": 1.0, "high": 1.0}),
    ("geo_rs_token_tis", {"low": 1.0, "high": 1.0, "cap": 1.0}),
    ("token_clamp", {"low": 1.0, "high": 1.0}), ("cispo", {"eps_low": 0.0, "eps_high": 0.0}),
    ("token_veto", {"threshold": 1.0}), ("k3_seq_rs", {"threshold": 0.0}),
    ("token_mis", {"low": INF, "high": INF}),
])
def test_bounds_are_inclusive_at_a_ratio_of_exactly_one(name, params):
    toy = TOYS["m0"]
    want = reference(name, toy, **params)
    got = getattr(E, name)(toy, **params, return_weights=True)
    np.testing.assert_array_equal(got, want)
    if params.get("low") != INF:
        assert (got == 1.0).all()  # rho = 1 sits on both bounds and is kept


@pytest.mark.parametrize("baseline", [0.0, 1.0])
def test_ppo_and_gspo_bounds_on_a_ratio(baseline):
    # eps chosen so that 1 + eps (or 1 - eps) is exactly a ratio of the toy: strict bounds keep it
    toy = TOYS["m1"]
    rho_t, _, geo, _ = _parts(toy)
    ratio = np.exp(toy["logp_train"] - toy["logp_sampler"])
    above = float(ratio[(ratio > 1) & (ratio < 2)][0])
    below = float(ratio[(ratio < 1) & (ratio > 0.5)][0])
    for eps in (above - 1.0, 1.0 - below):
        want = reference("ppo_clip_bypass", toy, baseline, eps=eps, clip_ratio_c=3.0)
        got = E.ppo_clip_bypass(toy, eps=eps, baseline=baseline, return_weights=True)
        np.testing.assert_array_equal(got, want)
    c = float(ratio[ratio > 1.5][0])
    got = E.ppo_clip_bypass(toy, clip_ratio_c=c, baseline=baseline, return_weights=True)
    np.testing.assert_array_equal(got, reference("ppo_clip_bypass", toy, baseline, eps=0.2,
                                                 clip_ratio_c=c))
    g = E.geometric_ratio(toy)
    for eps_high, eps_low in ((float(g[(g > 1) & (g < 2)][0]) - 1, 0.5),
                              (0.5, 1 - float(g[(g < 1) & (g > 0.5)][0]))):
        got = E.gspo(toy, eps_low=eps_low, eps_high=eps_high, baseline=baseline,
                     return_weights=True)
        np.testing.assert_array_equal(got, reference("gspo", toy, baseline, eps_low=eps_low,
                                                     eps_high=eps_high))


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_regions_are_one_sided_and_keep_tokens_ppos_clip_removes(name):
    """On the m1 toy with baseline 0.5 and OTHER's regions: the region removes tokens on both
    sides of the advantage, only those that moved in its direction, and keeps some that PPO's
    clip removes."""
    toy = TOYS["m1"]
    pi, mu = np.exp(toy["logp_train"]), np.exp(toy["logp_sampler"])
    A = toy["R"][:, None] - 0.5
    w = getattr(E, name)(toy, **OTHER[name], baseline=0.5, return_weights=True)
    removed = w == 0
    assert (removed & (A > 0)).any() and (removed & (A < 0)).any()
    # a token that moved against its advantage (or not at all) is never removed
    assert not (removed & (((A > 0) & (pi <= mu)) | ((A < 0) & (pi >= mu)))).any()
    ppo = E.ppo_clip_bypass(toy, baseline=0.5, return_weights=True)
    assert ((ppo == 0) & ~removed).any()
    # with no region left, the weight is the capped ratio everywhere
    open_region = getattr(E, name)(toy, delta_low=INF, delta_high=INF, clip_ratio_c=1.5,
                                   baseline=0.5, return_weights=True)
    np.testing.assert_array_equal(open_region, np.minimum(_parts(toy)[0], 1.5))


def test_dppo_tv_and_kl_disagree_on_rare_and_frequent_tokens():
    """The binary KL is larger than the TV for a rare token that became likely, smaller for a
    frequent one that moved by as much: one position, each token alone with A > 0."""
    rare = toy_from_logits(np.log([[0.19, 0.81]]), np.log([[0.001, 0.999]]))
    frequent = toy_from_logits(np.log([[0.81, 0.19]]), np.log([[0.6, 0.4]]))
    # sequence 0 (token 0, R = 1, A = 1 with baseline 0) is the one that moved up
    assert E.dppo_tv(rare, return_weights=True)[0, 0] == 3.0  # |0.189| <= 0.2, ratio 190 -> 3
    assert E.dppo_kl(rare, return_weights=True)[0, 0] == 0.0  # D = 0.204 > 0.2
    assert E.dppo_tv(frequent, return_weights=True)[0, 0] == 0.0  # 0.21 > 0.2
    assert E.dppo_kl(frequent, return_weights=True)[0, 0] == pytest.approx(1.35)  # D = 0.118


def test_caps_of_infinity_remove_the_truncation():
    toy = TOYS["m1"]
    rho_t, rho, geo, _ = _parts(toy)
    np.testing.assert_allclose(E.token_tis(toy, cap=INF, return_weights=True), rho_t, rtol=1e-12)
    np.testing.assert_allclose(E.seq_tis(toy, cap=INF, return_weights=True), rho, rtol=1e-12)
    np.testing.assert_allclose(E.cispo(toy, eps_low=1.0, eps_high=INF, return_weights=True),
                               rho_t, rtol=1e-12)
    np.testing.assert_allclose(
        E.geo_rs_token_tis(toy, low=0.0, high=INF, cap=INF, return_weights=True), rho_t,
        rtol=1e-12)
    np.testing.assert_array_equal(E.k3_seq_rs(toy, threshold=INF, return_weights=True), 1.0)
    np.testing.assert_allclose(E.ppo_clip_bypass(toy, clip_ratio_c=INF, baseline=1.0,
                                                 return_weights=True),
                               reference("ppo_clip_bypass", toy, 1.0, eps=0.2,
                                         clip_ratio_c=INF), rtol=1e-12)


# -------------------------------------------------------------------------------------------
# Errors that name the argument
# -------------------------------------------------------------------------------------------
ERRORS = [
    ("token_tis", {"cap": 0.0}, "cap must be > 0, got 0.0"),
    ("token_tis", {"cap": NAN}, "cap must be a finite number, got nan"),
    ("seq_tis", {"cap": -1.0}, "cap must be > 0, got -1.0"),
    ("geo_rs_token_tis", {"cap": 0.0}, "cap must be > 0, got 0.0"),
    ("geo_rs_token_tis", {"cap": NAN}, "cap must be a finite number, got nan"),
    ("geo_rs_token_tis", {"low": -0.1}, "low must be >= 0.0, got -0.1"),
    ("token_mis", {"low": -0.1}, "low must be >= 0.0, got -0.1"),
    ("token_mis", {"low": NAN}, "low must be a finite number, got nan"),
    ("token_mis", {"high": NAN}, "high must be a finite number, got nan"),
    ("seq_mis", {"low": 2.0, "high": 1.0}, "low must be <= high, got low=2.0 > high=1.0"),
    ("geo_rs", {"low": 1.5, "high": 1.0}, "low must be <= high, got low=1.5 > high=1.0"),
    ("token_clamp", {"low": -1.0}, "low must be >= 0.0, got -1.0"),
    ("icepop", {"high": NAN}, "high must be a finite number, got nan"),
    ("cispo", {"eps_low": NAN}, "eps_low must be a finite number, got nan"),
    ("cispo", {"eps_low": INF}, "eps_low must be a finite number, got inf"),
    ("cispo", {"eps_high": NAN}, "eps_high must be a finite number, got nan"),
    ("cispo", {"eps_low": -0.1}, r"eps_low and eps_high must be >= 0, got -0.1, 4.0"),
    ("cispo", {"eps_high": -0.1}, r"eps_low and eps_high must be >= 0, got 1.0, -0.1"),
    ("ppo_clip_bypass", {"eps": 0.0}, "eps must be > 0, got 0.0"),
    ("ppo_clip_bypass", {"eps": NAN}, "eps must be a finite number, got nan"),
    ("ppo_clip_bypass", {"clip_ratio_c": NAN}, "clip_ratio_c must be a finite number, got nan"),
    ("ppo_clip_bypass", {"clip_ratio_c": 1.0},
     r"clip_ratio_c must be > 1 \(the dual clip bounds ratios above 1\), got 1.0"),
    ("ppo_clip_bypass", {"baseline": NAN}, "baseline must be a finite number, got nan"),
    ("token_veto", {"threshold": -1.0}, "threshold must be >= 0, got -1.0"),
    ("token_veto", {"threshold": INF}, "threshold must be a finite number, got inf"),
    ("k3_seq_rs", {"threshold": -1.0}, "threshold must be >= 0, got -1.0"),
    ("k3_seq_rs", {"threshold": NAN}, "threshold must be a finite number, got nan"),
    ("gspo", {"eps_low": 0.0}, "eps_low must be > 0, got 0.0"),
    ("gspo", {"eps_high": 0.0}, "eps_high must be > 0, got 0.0"),
    ("gspo", {"eps_low": NAN}, "eps_low must be a finite number, got nan"),
    ("gspo", {"eps_high": INF}, "eps_high must be a finite number, got inf"),
    ("gspo", {"baseline": NAN}, "baseline must be a finite number, got nan"),
    ("naive", {"baseline": NAN}, "baseline must be a finite number, got nan"),
    ("token_is", {"baseline": INF}, "baseline must be a finite number, got inf"),
    ("dppo_tv", {"delta_low": -0.1}, "delta_low must be >= 0.0, got -0.1"),
    ("dppo_tv", {"delta_high": NAN}, "delta_high must be a finite number, got nan"),
    ("dppo_kl", {"clip_ratio_c": 0.0}, "clip_ratio_c must be > 0, got 0.0"),
    ("dppo_kl", {"clip_ratio_c": NAN}, "clip_ratio_c must be a finite number, got nan"),
    ("dppo_kl", {"baseline": NAN}, "baseline must be a finite number, got nan"),
]


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("name, kwargs, message", ERRORS)
def test_errors_name_the_argument(name, kwargs, message, return_weights):
    with pytest.raises(ValueError, match="^" + message):
        getattr(E, name)(TOYS["m1"], **kwargs, return_weights=return_weights)


@pytest.mark.parametrize("name, params", [
    ("cispo", {"eps_low": 0.0, "eps_high": 0.0}),
    ("k3_seq_rs", {"threshold": 0.0}), ("token_veto", {"threshold": 0.0}),
    ("token_mis", {"low": 0.0, "high": INF}), ("seq_mis", {"low": INF, "high": INF}),
])
def test_zero_and_infinite_bounds_are_accepted(name, params):
    toy = TOYS["m1"]
    np.testing.assert_allclose(getattr(E, name)(toy, **params, return_weights=True),
                               reference(name, toy, **params), rtol=1e-12)


def test_weighted_score_errors_and_dtypes():
    toy = TOYS["m1"]
    M, T = toy["logp_train"].shape
    with pytest.raises(ValueError, match=r"^weights must have shape \(M,\) or \(M, T\) = "
                       rf"\({M}, {T}\), got \({M}, {T + 1}\)$"):
        weighted_score(toy, np.ones((M, T + 1)))
    with pytest.raises(ValueError, match="^baseline must be a finite number, got nan"):
        weighted_score(toy, np.ones(M), baseline=NAN)
    bad = np.ones(M)
    bad[3] = np.inf
    with pytest.raises(ValueError, match=r"^weights hold 1 non-finite values \(an importance "
                       r"ratio overflowed at mismatch=1.0\?\); an estimate from them would be "
                       "NaN$"):
        weighted_score(toy, bad)
    with pytest.raises(ValueError, match=r"^the weights times the advantage R - baseline "
                       r"overflow float64 \(baseline=-10.0, largest weight 1e\+308\); use a "
                       "smaller baseline or mismatch$"):
        weighted_score(toy, np.full(M, 1e308), baseline=-10.0)
    # float32 and integer weights give the float64 estimate of the same values
    w = np.arange(M) % 3
    want = weighted_score(toy, w.astype(np.float64))
    assert weighted_score(toy, w).dtype == np.float64
    np.testing.assert_array_equal(weighted_score(toy, w), want)
    np.testing.assert_array_equal(weighted_score(toy, w.astype(np.float32)), want)
    # only R and score are needed
    np.testing.assert_array_equal(weighted_score({"R": toy["R"], "score": toy["score"]}, w),
                                  want)


def test_ratio_helpers_need_only_the_log_probabilities():
    toy = TOYS["m1"]
    logs = {"logp_train": toy["logp_train"], "logp_sampler": toy["logp_sampler"]}
    rho_t, _, geo, _ = _parts(toy)
    np.testing.assert_allclose(E.token_ratios(logs), rho_t, rtol=1e-12)
    np.testing.assert_allclose(E.geometric_ratio(logs), geo, rtol=1e-12)
    empty = {"logp_train": np.zeros((0, 2)), "logp_sampler": np.zeros((0, 2))}
    assert E.token_ratios(empty).shape == (0, 2)


@pytest.mark.parametrize("log_ratio, raises", [(800.0, True), (709.0, False)])
def test_overflowing_ratios_are_an_error_naming_the_mismatch(log_ratio, raises):
    hand = {"logp_train": np.array([[0.0]]), "logp_sampler": np.array([[-log_ratio]]),
            "mismatch": 50.0}
    if not raises:  # e^709 is below the largest float64, e^709.79 above it
        assert E.token_ratios(hand)[0, 0] == np.exp(709.0)
        return
    with pytest.raises(ValueError, match=r"^the per-token importance ratios overflow float64 "
                       r"\(log ratio up to 800 > 709.8\) at mismatch=50.0: the sampler gives "
                       "some sequences a probability that underflows; use a smaller mismatch$"):
        E.token_ratios(hand)


# -------------------------------------------------------------------------------------------
# The registry helpers, the comparison table and its renderings
# -------------------------------------------------------------------------------------------
def test_estimator_weights_errors():
    toy = TOYS["m1"]
    with pytest.raises(ValueError, match=r"^unknown parameters \['foo'\] for estimator "
                       r"'token_tis'; it takes \['cap'\]$"):
        estimator_weights(toy, "token_tis", foo=1.0)
    with pytest.raises(ValueError, match=r"^unknown estimator 'tis'; known: \['cispo', "):
        estimator_weights(toy, "tis")
    with pytest.raises(ValueError, match=r"^params names estimators that are not compared: "
                       r"\['seq_is'\]; compared: \['naive'\]$"):
        comparison_table(toy, names=["naive"], params={"seq_is": {}})


def _row(toy, name, weights, N, baseline):
    """One comparison row from hand-built weights; 'modified' against the uncorrected weight."""
    rho_t, rho, geo, mask = _parts(toy)
    uncorrected = {"one": np.ones_like(rho_t), "token": rho_t, "sequence": rho[:, None],
                   "geometric": geo[:, None]}[REGISTRY[name].reference]
    w = weights if weights.ndim == 2 else weights[:, None]
    w = np.broadcast_to(w, rho_t.shape)
    modified = (np.abs(w - uncorrected) > 1e-12 * np.abs(uncorrected)) & (mask > 0)
    moments = estimator_moments(toy, weighted_score(toy, weights, baseline))
    mu = toy["p_sampler"]
    return {"name": name, "bias": moments["bias"], "var": moments["var"],
            "rel_bias": moments["rel_bias"], "rel_rmse": moments["rel_rmse"](N),
            "token_frac": float(mu @ (modified.sum(axis=1) / mask.sum(axis=1))),
            "seq_frac": float(mu @ modified.any(axis=1)),
            "unbiased": REGISTRY[name].unbiased, "source": REGISTRY[name].source}


def _assert_rows(rows, expected):
    assert [r["name"] for r in rows] == [e["name"] for e in expected]
    for r, e in zip(rows, expected):
        assert set(r) == set(e)
        for key in ("name", "unbiased", "source"):
            assert r[key] == e[key]
        for key in ("rel_bias", "rel_rmse", "token_frac", "seq_frac"):
            assert math.isclose(r[key], e[key], rel_tol=1e-9, abs_tol=1e-14), (r["name"], key)
        for key in ("bias", "var"):
            np.testing.assert_allclose(r[key], e[key], rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("toy_name", ["m1", "ar"])
def test_comparison_table_is_a_hand_built_loop(toy_name):
    toy = TOYS[toy_name]
    names = sorted(DEFAULTS)
    params = {"token_tis": {"cap": 1.5}, "gspo": {"eps_low": 0.2, "eps_high": 0.3},
              "geo_rs_token_tis": {"low": 0.8, "high": 1.3, "cap": 1.5}}
    rows = comparison_table(toy, names=names, N=8, baseline=0.5, params=params)
    expected = [_row(toy, n, reference(n, toy, 0.5, **{**DEFAULTS[n], **params.get(n, {})}),
                     8, 0.5) for n in names]
    _assert_rows(rows, expected)


def test_comparison_table_defaults():
    toy = TOYS["m1"]
    rows = comparison_table(toy)
    assert [r["name"] for r in rows] == list(REGISTRY)  # every estimator, in the registry's order
    # the other frameworks' seven (test_peer_switches.py) and the policy losses
    # (test_policy_losses.py) have their rows checked there
    rows = [r for r in rows if r["name"] not in PEER_SWITCHES | POLICY_LOSSES]
    expected = [_row(toy, n, reference(n, toy, 0.0, **DEFAULTS[n]), 64, 0.0) for n in DEFAULTS]
    _assert_rows(rows, expected)


def test_token_fraction_counts_tiny_changes():
    # a clamp just below the largest ratio changes it by 1e-7 relative; a band that drops a
    # ratio below 1e-8 zeroes it: both tokens count as modified
    toy = toy_from_logits(np.log([[0.5, 0.5], [1 - 1e-9, 1e-9]]),
                          np.log([[0.8, 0.2], [0.5, 0.5]]))
    rho_t = _parts(toy)[0]
    high = float(rho_t.max()) * (1 - 1e-7)
    tiny = float(rho_t.min())
    assert tiny < 1e-8
    rows = comparison_table(toy, names=["token_clamp", "token_mis"],
                            params={"token_clamp": {"low": 0.0, "high": high},
                                    "token_mis": {"low": 1e-3, "high": INF}})
    clamp, mis = rows
    mu = toy["p_sampler"]
    Y = toy["Y"]
    top = rho_t == rho_t.max()
    assert math.isclose(clamp["token_frac"], float(mu @ top.mean(axis=1)), rel_tol=1e-12)
    assert clamp["token_frac"] > 0
    low = rho_t < 1e-3
    assert math.isclose(mis["token_frac"], float(mu @ low.mean(axis=1)), rel_tol=1e-12)
    assert mis["token_frac"] > 0 and Y.shape[1] == 2


def test_geometric_reference_is_rho_geo():
    # gspo with bounds that never bite leaves rho_geo unchanged: nothing counts as modified
    toy = TOYS["ar"]
    row, = comparison_table(toy, names=["gspo"], params={"gspo": {"eps_low": 0.999,
                                                                    "eps_high": 1e6}})
    assert row["token_frac"] == 0.0 and row["seq_frac"] == 0.0
    row, = comparison_table(toy, names=["seq_tis"], params={"seq_tis": {"cap": 1e6}})
    assert row["token_frac"] == 0.0


def test_mismatch_sweep_is_comparison_table_per_mismatch():
    sweep = mismatch_sweep([0.5, 1.0], names=["naive", "token_tis"], N=8, T=3, V=3, seed=2,
                           baseline=0.5)
    assert list(sweep) == [0.5, 1.0]
    for m, rows in sweep.items():
        toy = make_toy(T=3, V=3, mismatch=m, seed=2)
        _assert_rows(rows, [_row(toy, n, reference(n, toy, 0.5, **DEFAULTS[n]), 8, 0.5)
                            for n in ("naive", "token_tis")])
    # the defaults: N=64, T=6, V=4, seed=0, baseline 0, every registered estimator
    rows = mismatch_sweep([0.3])[0.3]
    toy = make_toy(T=6, V=4, mismatch=0.3, seed=0)
    assert [r["name"] for r in rows] == list(REGISTRY)
    _assert_rows(rows[:2], [_row(toy, n, reference(n, toy, 0.0, **DEFAULTS[n]), 64, 0.0)
                            for n in list(REGISTRY)[:2]])


def test_format_table_by_hand():
    row = {"name": "x", "rel_bias": 0.12345, "var": 1234.5, "rel_rmse": 0.5, "token_frac": 0.25,
           "seq_frac": 1.0, "unbiased": True}
    text = format_table([row, dict(row, name="y", unbiased=False)], N=8)
    assert text == (
        "| estimator | rel. bias | variance | rel. RMSE (N=8) | tokens modified "
        "| sequences modified | unbiased |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | :---: |\n"
        "| `x` | 0.1235 | 1234 | 0.5000 | 25.0% | 100.0% | yes |\n"
        "| `y` | 0.1235 | 1234 | 0.5000 | 25.0% | 100.0% | no |")
    assert "(N=64)" in format_table([])
    # the variance column at four significant digits whatever its size, trailing zeros kept
    variances = [0.283, 0.0007223, 2646.0, 123456.0]
    cells = [format_table([dict(row, var=v)]).splitlines()[-1].split(" | ")[2]
             for v in variances]
    assert cells == ["0.2830", "0.0007223", "2646", "1.235e+05"]


def test_k3_mean_is_over_the_responses_own_tokens():
    # a threshold between the mean over the n tokens and the mean over all T positions of a
    # short response: the response is rejected (the padding is not averaged in)
    toy = TOYS["ar"]
    rho_t, _, _, mask = _parts(toy)
    k3 = (rho_t - 1 - np.log(rho_t)) * mask
    n = mask.sum(axis=1)
    over_n, over_T = k3.sum(axis=1) / n, k3.sum(axis=1) / mask.shape[1]
    short = int(np.argmax((n < mask.shape[1]) & (over_n > 0)))
    threshold = (over_n[short] + over_T[short]) / 2
    got = E.k3_seq_rs(toy, threshold=threshold, return_weights=True)
    assert got[short] == 0.0
    np.testing.assert_array_equal(got, (over_n <= threshold) * 1.0)


def _length_sweep(lengths, names, mismatch, V, seeds, autoregressive, eos):
    out = {}
    for T in lengths:
        out[T] = {}
        for name in names:
            biases = []
            for seed in seeds:
                table = (make_ar_toy(T=max(lengths), V=V, mismatch=0.0, seed=seed, eos=eos)
                         if autoregressive else
                         make_toy(T=max(lengths), V=V, mismatch=0.0, seed=seed))
                sampler = table["theta"][:T] + mismatch * table["b"][:T]
                toy = (ar_toy_from_logits(table["theta"][:T], sampler, eos=eos) if autoregressive
                       else toy_from_logits(table["theta"][:T], sampler))
                biases.append(_row(toy, name, reference(name, toy, 0.0, **DEFAULTS[name]), 64,
                                   0.0)["rel_bias"])
            out[T][name] = float(np.median(biases))
    return out


@pytest.mark.parametrize("kwargs, explicit", [
    ({}, {"mismatch": 0.3, "V": 3, "seeds": range(5), "autoregressive": True, "eos": True}),
    ({"mismatch": 0.8, "V": 4, "seeds": [2, 3, 7], "autoregressive": True, "eos": False},
     {"mismatch": 0.8, "V": 4, "seeds": [2, 3, 7], "autoregressive": True, "eos": False}),
    ({"mismatch": 0.8, "V": 2, "seeds": [1, 4], "autoregressive": False},
     {"mismatch": 0.8, "V": 2, "seeds": [1, 4], "autoregressive": False, "eos": True}),
])
def test_length_sweep_is_a_median_over_seeds(kwargs, explicit):
    names = ["token_is", "token_tis"]
    got = E.length_sweep([1, 3], names, **kwargs)
    want = _length_sweep([1, 3], names, **explicit)
    assert list(got) == [1, 3]
    for T in got:
        for name in names:
            assert math.isclose(got[T][name], want[T][name], rel_tol=1e-9, abs_tol=1e-14)


def test_the_largest_finite_ratio_is_accepted_and_rho_geo_overflows_to_inf():
    # log ratio exactly log(float max): exp of it is finite, so it is no overflow
    edge = float(np.log(np.finfo(float).max))
    hand = {"logp_train": np.array([[0.0]]), "logp_sampler": np.array([[-edge]])}
    assert E.token_ratios(hand)[0, 0] == np.exp(edge) < np.inf
    # rho_geo beyond float max is inf (outside every finite band), silently
    big = {"logp_train": np.zeros((1, 2)), "logp_sampler": np.full((1, 2), -800.0)}
    assert E.geometric_ratio(big).tolist() == [np.inf]


@pytest.mark.parametrize("name, params", [("seq_tis", {"cap": INF}),
                                          ("seq_mis", {"low": 0.0, "high": INF})])
def test_overflowing_sequence_ratios_name_the_level_and_the_mismatch(name, params):
    hand = dict(TOYS["m1"])
    hand["logp_sampler"] = hand["logp_sampler"] - 400.0  # log rho = 3 * 400 > 709.8
    with pytest.raises(ValueError, match=r"^the sequence importance ratios overflow float64 "
                       r"\(log ratio up to 1\d\d\d > 709.8\) at mismatch=1.0: "):
        getattr(E, name)(hand, **params, return_weights=True)


def test_estimator_weights_default_baseline_is_zero():
    toy = TOYS["m1"]
    np.testing.assert_array_equal(
        estimator_weights(toy, "ppo_clip_bypass"),
        reference("ppo_clip_bypass", toy, 0.0, **DEFAULTS["ppo_clip_bypass"]))
