"""Every statement of the estimators' docstrings and of docs/mismatch.md, checked exactly.

Each test would fail on the statement or the code it replaced: the table computed without the
baseline, a "second order" bias, a C^2 bound on the variance, the truncation-bias formulas with
a plus sign, a chi-square product formula stated without its condition.
"""

import numpy as np
import pytest

from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.opd_mismatch import opd_mismatch_table
from opd_literate.mismatch.toy import estimator_moments, log_softmax, make_toy, toy_from_logits


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
    assert set(rows) == set(E.REGISTRY) and len(rows) == 16
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
