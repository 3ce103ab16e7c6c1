"""Group baselines under rejection (opd_literate.mismatch.groups): the advantages against their
definitions written out answer by answer, the exact sums over groups against a brute-force loop
over every ordered group, the closed-form means against the enumeration, and every statement of
the module docstring."""

import itertools
import math
import pathlib
import re
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.groups import (
    BASELINES,
    MAX_GROUP_ENTRIES,
    REJECTIONS,
    VERL_CHOICES,
    VERL_EPSILON,
    closed_form_mean,
    enumerate_groups,
    group_advantages,
    group_estimates,
    group_moments,
    group_table,
    kept_statistics,
    rejection_weights,
)
from opd_literate.mismatch.toy import estimator_moments, make_ar_toy, make_toy, toy_from_logits
from tests.helpers.committed import assert_matches_committed

CLOSED = ("grpo_all", "grpo_kept", "rloo_all", "rloo_kept")
# Bands that reject part of the responses of the toys below, not all of them.
BITING = {"seq_mis": dict(low=0.5, high=2.0), "geo_rs": dict(low=0.8, high=1.25),
          "token_veto": dict(threshold=0.7), "k3_seq_rs": dict(threshold=0.2)}


def _toy(**kwargs):
    return make_toy(**{"T": 3, "V": 2, "mismatch": 0.5, "seed": 0, **kwargs})


def _weights(toy, name="seq_mis"):
    w = rejection_weights(toy, name, **BITING[name])
    assert 0 < (w > 0).sum() < len(w), f"{name} should reject part of the responses"
    return w


# ---------------------------------------------------------------------------------------------
# The definitions, written out answer by answer
# ---------------------------------------------------------------------------------------------
def _reference_advantages(r, kept, baseline, eps=VERL_EPSILON):
    family, over = baseline.rsplit("_", 1)
    members = [j for j in range(len(r)) if over == "all" or kept[j]]
    out = []
    for i in range(len(r)):
        if not kept[i]:
            out.append(0.0)
            continue
        values = [r[j] for j in members]
        if family == "rloo":
            others = [r[j] for j in members if j != i]
            out.append(r[i] - (statistics.fmean(others) if others else 0.0))
            continue
        mean = statistics.fmean(values) if len(values) > 1 else 0.0
        std = statistics.stdev(values) if len(values) > 1 else 1.0
        out.append((r[i] - mean) / (std + eps) if family == "grpo_std" else r[i] - mean)
    return out


@pytest.mark.parametrize("baseline", BASELINES)
def test_advantages_are_the_definitions(baseline):
    rng = np.random.default_rng(0)
    for G in (1, 2, 3, 5):
        for _ in range(40):
            r = rng.choice([0.0, 1.0, 0.5, -2.0], size=G)
            kept = rng.random(G) < 0.6
            np.testing.assert_allclose(group_advantages(r, kept, baseline),
                                       _reference_advantages(r.tolist(), kept.tolist(), baseline),
                                       rtol=1e-12, atol=1e-14)


def test_advantages_broadcast_over_leading_axes_group_by_group():
    rng = np.random.default_rng(1)
    r, kept = rng.normal(size=(3, 4, 5)), rng.random((3, 4, 5)) < 0.5
    for baseline in BASELINES:
        batched = group_advantages(r, kept, baseline)
        for a, b in itertools.product(range(3), range(4)):
            np.testing.assert_array_equal(batched[a, b],
                                          group_advantages(r[a, b], kept[a, b], baseline))


@pytest.mark.parametrize("baseline", ["grpo_all", "grpo_kept", "grpo_std_all", "grpo_std_kept",
                                      "rloo_all", "rloo_kept"])
def test_the_advantages_of_a_set_sum_to_zero(baseline):
    rng = np.random.default_rng(2)
    r = rng.normal(size=(50, 4))
    everything = np.ones((50, 4), dtype=bool)
    np.testing.assert_allclose(group_advantages(r, everything, baseline).sum(axis=1), 0.0,
                               atol=1e-12)
    if baseline.endswith("_kept"):  # over the kept answers, when at least two are kept
        kept = np.array([True, False, True, True])
        advantage = group_advantages(r, np.broadcast_to(kept, r.shape).copy(), baseline)
        np.testing.assert_allclose(advantage[:, kept].sum(axis=1), 0.0, atol=1e-12)


def test_a_lone_kept_answer_gets_verls_one_answer_convention():
    # verl: a prompt with one answer has mean 0 and std 1
    for baseline, expected in [("grpo_kept", 0.7), ("rloo_kept", 0.7),
                               ("grpo_std_kept", 0.7 / (1 + VERL_EPSILON))]:
        assert group_advantages([0.7, 3.0, 1.0], [True, False, False], baseline).tolist() == [
            expected, 0.0, 0.0]
    assert group_advantages([0.7, 3.0], [False, False], "rloo_kept").tolist() == [0.0, 0.0]


def test_a_group_with_equal_rewards_has_zero_std_advantages():
    assert group_advantages([1.0, 1.0, 1.0], [True] * 3, "grpo_std_all").tolist() == [0.0] * 3


# ---------------------------------------------------------------------------------------------
# The sums over groups
# ---------------------------------------------------------------------------------------------
def test_the_docstrings_counts_of_groups():
    assert len(enumerate_groups(np.full(8, 1 / 8), 4)[0]) == 330
    assert len(enumerate_groups(np.full(8, 1 / 8), 4, method="ordered")[0]) == 4096


@pytest.mark.parametrize("G", [2, 3, 4])
def test_multisets_carry_the_probability_of_their_orderings(G):
    mu = make_toy(T=2, V=2, mismatch=0.4)["p_sampler"]
    groups, prob = enumerate_groups(mu, G)
    ordered, ordered_prob = enumerate_groups(mu, G, method="ordered")
    assert math.isclose(prob.sum(), 1.0, rel_tol=1e-12)
    by_multiset = {}
    for g, q in zip(np.sort(ordered, axis=1), ordered_prob):
        by_multiset[tuple(g)] = by_multiset.get(tuple(g), 0.0) + q
    assert sorted(by_multiset) == [tuple(g) for g in groups]
    np.testing.assert_allclose([by_multiset[tuple(g)] for g in groups], prob, rtol=1e-12)


def _brute_force(toy, w, G, baseline):
    """Mean and total variance of the group estimate, a Python loop over every ordered group."""
    mu, R, score = toy["p_sampler"], toy["R"], toy["score"]
    probs, estimates = [], []
    for group in itertools.product(range(len(mu)), repeat=G):
        advantage = _reference_advantages([R[m] for m in group], [w[m] > 0 for m in group],
                                          baseline)
        estimates.append(sum(w[m] * a * score[m] for m, a in zip(group, advantage)) / G)
        probs.append(math.prod(mu[m] for m in group))
    probs, estimates = np.array(probs), np.array(estimates)
    mean = np.einsum("n,n...->...", probs, estimates)
    var = float(probs @ ((estimates - mean) ** 2).reshape(len(probs), -1).sum(axis=1))
    return mean, var


@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("name", ["seq_mis", "geo_rs"])
def test_moments_equal_a_brute_force_loop_over_every_ordered_group(baseline, name):
    toy = make_toy(T=2, V=2, mismatch=0.6, seed=1)
    w = rejection_weights(toy, name, **{"seq_mis": dict(low=0.0, high=1.2),
                                        "geo_rs": dict(low=0.95, high=2.0)}[name])
    assert 0 < (w > 0).sum() < len(w)
    mean, var = _brute_force(toy, w, 3, baseline)
    for method in ("multisets", "ordered"):
        moments = group_moments(toy, w, 3, baseline, method=method)
        np.testing.assert_allclose(moments["mean"], mean, rtol=1e-12, atol=1e-15)
        assert math.isclose(moments["var"], var, rel_tol=1e-11)
        assert math.isclose(moments["bias"], float(np.linalg.norm(mean - toy["true_grad"])),
                            rel_tol=1e-11)


@pytest.mark.parametrize("G", [2, 3, 4])
@pytest.mark.parametrize("name", REJECTIONS)
def test_closed_form_means_equal_the_enumeration(name, G):
    toy = _toy()
    w = _weights(toy, name)
    for baseline in CLOSED:
        np.testing.assert_allclose(closed_form_mean(toy, w, G, baseline),
                                   group_moments(toy, w, G, baseline)["mean"],
                                   rtol=1e-11, atol=1e-15, err_msg=baseline)


def test_closed_form_means_on_the_autoregressive_toy():
    toy = make_ar_toy(T=3, V=3, mismatch=0.8)
    w = rejection_weights(toy, "seq_mis", low=0.5, high=2.0)
    assert 0 < (w > 0).sum() < len(w)
    for baseline in CLOSED:
        np.testing.assert_allclose(closed_form_mean(toy, w, 3, baseline),
                                   group_moments(toy, w, 3, baseline)["mean"],
                                   rtol=1e-11, atol=1e-15, err_msg=baseline)


# ---------------------------------------------------------------------------------------------
# What the module docstring derives
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("G", [2, 3, 4])
@pytest.mark.parametrize("name,params", [("seq_mis", dict(low=0.0, high=np.inf)),
                                         ("geo_rs", dict(low=0.0, high=np.inf))])
def test_when_nothing_is_rejected_the_all_and_kept_choices_coincide(name, params, G):
    toy = _toy()
    w = rejection_weights(toy, name, **params)
    assert (w > 0).all()
    for family in ("grpo", "grpo_std", "rloo"):
        _, everything = group_estimates(toy, w, G, f"{family}_all")
        _, kept = group_estimates(toy, w, G, f"{family}_kept")
        np.testing.assert_array_equal(everything, kept)


def test_a_band_wide_enough_to_hold_every_ratio_rejects_nothing():
    toy = _toy()
    rho = np.exp((toy["logp_train"] - toy["logp_sampler"]).sum(axis=1))
    # 1e-9 beyond the extreme ratios: the band's log and the ratios' exp round apart
    w = rejection_weights(toy, "seq_mis", low=rho.min() * (1 - 1e-9), high=rho.max() * (1 + 1e-9))
    np.testing.assert_array_equal(w, rho)
    for family in ("grpo", "grpo_std", "rloo"):
        np.testing.assert_array_equal(group_estimates(toy, w, 3, f"{family}_all")[1],
                                      group_estimates(toy, w, 3, f"{family}_kept")[1])
    narrower = rejection_weights(toy, "seq_mis", low=rho.min() * (1 - 1e-9),
                                 high=rho.max() * (1 - 1e-9))
    assert (narrower == 0).sum() == 1  # the largest ratio just outside: rejected
    assert not np.array_equal(group_estimates(toy, narrower, 3, "rloo_all")[1],
                              group_estimates(toy, narrower, 3, "rloo_kept")[1])


@pytest.mark.parametrize("G", [2, 3, 4])
def test_without_rejection_and_with_the_sequence_ratio_rloo_is_unbiased(G):
    toy = _toy()
    rho = E.seq_is(toy, return_weights=True)
    for baseline in ("rloo_all", "rloo_kept"):
        assert group_moments(toy, rho, G, baseline)["rel_bias"] < 1e-12
    np.testing.assert_allclose(group_moments(toy, rho, G, "grpo_all")["mean"],
                               (G - 1) / G * toy["true_grad"], rtol=1e-12, atol=1e-15)
    assert np.abs(kept_statistics(toy, rho)["kept_score_mean"]).max() < 1e-15  # h_K = 0


@pytest.mark.parametrize("name", REJECTIONS)
def test_a_leave_one_out_baseline_acts_as_its_expectation(name):
    """E[rloo_all] is the single-answer estimator with the constant baseline E_mu[R], and
    E[rloo_kept] with r_K (1 - (1 - p)^(G - 1)): the estimators module's numbers."""
    toy, G = _toy(), 4
    w = _weights(toy, name)
    stats = kept_statistics(toy, w)
    for baseline, b in [("rloo_all", stats["reward_mean"]),
                        ("rloo_kept", stats["kept_reward_mean"] * (1 - (1 - stats["p"]) ** 3))]:
        single = E.weighted_score(toy, w, baseline=b)
        np.testing.assert_allclose(group_moments(toy, w, G, baseline)["mean"],
                                   estimator_moments(toy, single)["mean"], rtol=1e-11,
                                   atol=1e-15)
    np.testing.assert_allclose(stats["kept_gradient"],
                               estimator_moments(toy, E.weighted_score(toy, w))["mean"],
                               rtol=1e-12, atol=1e-15)


def test_kept_rloos_bias_against_the_target_vanishes_with_g_and_all_rloos_does_not():
    toy = _toy()
    w = _weights(toy)
    stats = kept_statistics(toy, w)
    h, p = stats["kept_score_mean"], stats["p"]
    constant = float(np.linalg.norm((stats["kept_reward_mean"] - stats["reward_mean"]) * h))
    assert constant > 0.01
    previous = math.inf
    for G in (2, 3, 4, 6, 8):
        kept = group_moments(toy, w, G, "rloo_kept")["target_bias"]
        expected = (1 - p) ** (G - 1) * stats["kept_reward_mean"] * float(np.linalg.norm(h))
        assert math.isclose(kept, expected, rel_tol=1e-9)
        assert kept < previous
        previous = kept
        assert math.isclose(group_moments(toy, w, G, "rloo_all")["target_bias"], constant,
                            rel_tol=1e-9)
    assert previous < constant / 20  # at G = 8


def test_a_rejection_independent_of_the_reward_leaves_all_rloo_unbiased_for_the_target():
    """r_K = r: the reward reads the first position, the rejection the second, and the
    positions are independent under mu; then E[rloo_all] = C_K at every G."""
    toy = toy_from_logits(np.log([[0.5, 0.5], [0.5, 0.5]]), np.log([[0.7, 0.3], [0.6, 0.4]]))
    R = (toy["Y"][:, 0] == 0).astype(float)
    toy = dict(toy, R=R, true_grad=np.einsum("m,m,m...->...", toy["p_train"], R, toy["score"]))
    w = (toy["Y"][:, 1] == 0).astype(float)  # keep the responses whose second token is 0
    stats = kept_statistics(toy, w)
    assert math.isclose(stats["kept_reward_mean"], stats["reward_mean"], rel_tol=1e-12)
    assert np.linalg.norm(stats["kept_score_mean"]) > 0.1
    for G in (2, 3, 4):
        assert group_moments(toy, w, G, "rloo_all")["target_bias"] < 1e-15
        assert math.isclose(group_moments(toy, w, G, "rloo_kept")["target_bias"],
                            0.4 ** (G - 1) * stats["kept_reward_mean"]
                            * float(np.linalg.norm(stats["kept_score_mean"])), rel_tol=1e-9)


def test_the_target_is_p_times_a_covariance_over_the_kept_answers():
    toy = _toy()
    w = _weights(toy)
    stats = kept_statistics(toy, w)
    kept = w > 0
    mu_K = toy["p_sampler"] * kept / stats["p"]  # mu conditioned on k = 1
    ws = w[:, None, None] * toy["score"]
    covariance = (np.einsum("m,m,m...->...", mu_K, toy["R"], ws)
                  - (mu_K @ toy["R"]) * np.einsum("m,m...->...", mu_K, ws))
    np.testing.assert_allclose(stats["target"], stats["p"] * covariance, rtol=1e-12,
                               atol=1e-15)


def test_with_the_sequence_ratio_the_target_is_the_kept_distributions_gradient_plus_a_gap():
    """C_K = q grad E_pi[R | k] + (E_pi[R | k] - r_K) h_K, with k held fixed."""
    toy = _toy()
    w = rejection_weights(toy, "seq_mis", low=0.5, high=2.0)
    stats = kept_statistics(toy, w)
    pi_k = toy["p_train"] * (w > 0)
    q = pi_k.sum()
    reward_pi_K = pi_k @ toy["R"] / q
    # grad E_{pi_K}[R] = E_{pi_K}[R s] - E_{pi_K}[R] E_{pi_K}[s]
    grad = (np.einsum("m,m,m...->...", pi_k, toy["R"], toy["score"]) / q
            - reward_pi_K * np.einsum("m,m...->...", pi_k, toy["score"]) / q)
    np.testing.assert_allclose(stats["target"],
                               q * grad + (reward_pi_K - stats["kept_reward_mean"])
                               * stats["kept_score_mean"], rtol=1e-11, atol=1e-15)
    assert np.linalg.norm(stats["target"] - toy["true_grad"]) > 0.01  # not grad J


def test_the_binomial_identity_of_kept_grpo_and_its_one_over_g_approach():
    toy = _toy()
    w = _weights(toy)
    stats = kept_statistics(toy, w)
    p, g, target = stats["p"], stats["kept_gradient"], stats["target"]
    for G in (2, 3, 4, 7):
        total = sum(math.comb(G - 1, j) * p**j * (1 - p) ** (G - 1 - j) * j / (j + 1)
                    for j in range(1, G))
        np.testing.assert_allclose(closed_form_mean(toy, w, G, "grpo_kept"),
                                   (1 - p) ** (G - 1) * g + total * target, rtol=1e-12,
                                   atol=1e-15)
    # G (E - C_K) + C_K / p = G (1 - p)^(G - 1) g_K + (1 - p)^G C_K / p: to 0 as G grows
    errors = [np.linalg.norm(G * (closed_form_mean(toy, w, G, "grpo_kept") - target)
                             + target / p) for G in (5, 10, 20, 40)]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0.01 > 1e-6 > errors[-1]


def test_nothing_ever_kept_gives_zero_means():
    toy = _toy()
    zero = np.zeros(len(toy["R"]))
    for baseline in BASELINES:
        assert np.abs(group_moments(toy, zero, 3, baseline)["mean"]).max() == 0.0
    for baseline in CLOSED:
        assert np.abs(closed_form_mean(toy, zero, 3, baseline)).max() == 0.0


@pytest.mark.parametrize("G", [2, 3, 4])
def test_grpo_over_all_answers_is_rloo_scaled_group_by_group(G):
    toy = _toy()
    w = _weights(toy)
    _, grpo = group_estimates(toy, w, G, "grpo_all")
    _, rloo = group_estimates(toy, w, G, "rloo_all")
    np.testing.assert_allclose(grpo, (G - 1) / G * rloo, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", REJECTIONS)
def test_with_binary_rewards_every_all_choice_points_the_same_way(name):
    """R in {0, 1}: each _all mean is a positive multiple of E[kws | R=1] - E[kws | R=0]."""
    toy = _toy()
    w = _weights(toy, name)
    mu, R = toy["p_sampler"], toy["R"]
    ws = w[:, None, None] * toy["score"]
    direction = (np.einsum("m,m...->...", mu * R, ws) / (mu @ R)
                 - np.einsum("m,m...->...", mu * (1 - R), ws) / (mu @ (1 - R)))
    for baseline in ("grpo_all", "grpo_std_all", "rloo_all"):
        mean = group_moments(toy, w, 4, baseline)["mean"]
        scale = float(np.sum(mean * direction) / np.sum(direction * direction))
        assert scale > 0
        np.testing.assert_allclose(mean, scale * direction, rtol=1e-10, atol=1e-15)


def test_the_one_position_example_where_kept_baselines_cancel_the_gradient():
    one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    w = E.seq_mis(one, high=2.0, return_weights=True)
    assert w.tolist()[1] == 0.0 and one["R"].tolist() == [1.0, 0.0]  # rejected: reward 0
    for G in (2, 3, 4):
        everything = group_moments(one, w, G, "rloo_all")
        kept = group_moments(one, w, G, "rloo_kept")
        np.testing.assert_allclose(everything["mean"], 0.2 * one["true_grad"], rtol=1e-12)
        np.testing.assert_allclose(kept["mean"], 0.2 ** (G - 1) * one["true_grad"], rtol=1e-12)
        assert kept["rel_bias"] >= everything["rel_bias"]
        for baseline in ("grpo_kept", "grpo_std_kept"):  # the kept answers' rewards are all 1
            np.testing.assert_allclose(group_moments(one, w, G, baseline)["mean"],
                                       0.2 ** (G - 1) * one["true_grad"], rtol=1e-5)


def test_group_table_marks_verls_choices():
    toy = _toy()
    rows = group_table(toy, _weights(toy), 3)
    assert [r["baseline"] for r in rows] == list(BASELINES)
    assert {r["baseline"] for r in rows if r["verl"]} == set(VERL_CHOICES.values())
    assert VERL_CHOICES == {"grpo": "grpo_std_all", "grpo_no_std": "grpo_all",
                            "rloo": "rloo_all"}
    for row in rows:
        moments = group_moments(toy, _weights(toy), 3, row["baseline"])
        assert row["bias"] == moments["bias"] and row["var"] == moments["var"]
        assert row["rel_rmse"] == moments["rel_rmse"](64)


def test_rejection_weights_are_the_catalogues_per_response_weights():
    toy = make_ar_toy(T=3, V=3, mismatch=0.8)
    for name in REJECTIONS:
        full = E.estimator_weights(toy, name, **BITING[name])
        w = rejection_weights(toy, name, **BITING[name])
        np.testing.assert_array_equal(np.broadcast_to(w[:, None], full.shape), full)


# ---------------------------------------------------------------------------------------------
# Random small toys
# ---------------------------------------------------------------------------------------------
@st.composite
def _cases(draw):
    T, V = draw(st.sampled_from([(1, 2), (1, 3), (2, 2), (2, 3)]))
    logits = st.floats(-2.0, 2.0, allow_nan=False)
    train = np.array(draw(st.lists(logits, min_size=T * V, max_size=T * V))).reshape(T, V)
    sampler = np.array(draw(st.lists(logits, min_size=T * V, max_size=T * V))).reshape(T, V)
    toy = toy_from_logits(train, sampler)
    M = V**T
    keep = np.array(draw(st.lists(st.booleans(), min_size=M, max_size=M)))
    scale = np.array(draw(st.lists(st.floats(0.1, 3.0), min_size=M, max_size=M)))
    G = draw(st.sampled_from([2, 3]))
    return toy, np.where(keep, scale, 0.0), G


@given(_cases(), st.sampled_from(BASELINES))
def test_random_toys_enumerations_agree_and_are_finite(case, baseline):
    toy, w, G = case
    multisets = group_moments(toy, w, G, baseline)
    ordered = group_moments(toy, w, G, baseline, method="ordered")
    np.testing.assert_allclose(multisets["mean"], ordered["mean"], rtol=1e-10, atol=1e-13)
    assert math.isclose(multisets["var"], ordered["var"], rel_tol=1e-9, abs_tol=1e-13)
    assert np.isfinite(multisets["mean"]).all() and math.isfinite(multisets["var"])
    if baseline in CLOSED:
        np.testing.assert_allclose(closed_form_mean(toy, w, G, baseline), multisets["mean"],
                                   rtol=1e-10, atol=1e-13)
    if (w > 0).all():
        other = baseline.replace("_all", "_kept") if baseline.endswith("_all") else \
            baseline.replace("_kept", "_all")
        np.testing.assert_array_equal(group_estimates(toy, w, G, baseline)[1],
                                      group_estimates(toy, w, G, other)[1])


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input_is_a_clear_error():
    toy = _toy()
    w = _weights(toy)
    with pytest.raises(ValueError, match="baseline must be one of"):
        group_advantages([1.0, 0.0], [True, True], "grpo")
    with pytest.raises(TypeError, match="kept must be a bool array"):
        group_advantages([1.0, 0.0], [1, 0], "rloo_all")
    with pytest.raises(ValueError, match=r"kept must have the shape of rewards \(2,\)"):
        group_advantages([1.0, 0.0], [True], "rloo_all")
    with pytest.raises(ValueError, match="rewards must be finite, got nan"):
        group_advantages([1.0, np.nan], [True, True], "rloo_all")
    with pytest.raises(ValueError, match="rewards must have shape"):
        group_advantages(1.0, True, "rloo_all")
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages([1.0, 0.0], [True, True], "grpo_std_all", eps=0.0)
    with pytest.raises(ValueError, match="G must be >= 2"):
        group_moments(toy, w, 1, "rloo_all")
    with pytest.raises(TypeError, match="G must be an integer"):
        group_moments(toy, w, True, "rloo_all")
    with pytest.raises(ValueError, match=r"weights must have shape \(M,\) = \(8,\)"):
        group_moments(toy, w[:4], 2, "rloo_all")
    with pytest.raises(ValueError, match="weights must be >= 0"):
        group_moments(toy, -w, 2, "rloo_all")
    with pytest.raises(ValueError, match="weights must be finite"):
        group_moments(toy, np.full(8, np.nan), 2, "rloo_all")
    with pytest.raises(ValueError, match="method must be one of"):
        group_moments(toy, w, 2, "rloo_all", method="pairs")
    with pytest.raises(ValueError, match="has no closed form"):
        closed_form_mean(toy, w, 2, "grpo_std_all")
    with pytest.raises(ValueError, match="sequence-level rejection"):
        rejection_weights(toy, "token_mis")
    with pytest.raises(ValueError, match="MAX_GROUP_ENTRIES"):
        group_moments(toy, w, 12, "rloo_all", method="ordered")
    with pytest.raises(ValueError, match="MAX_GROUP_ENTRIES"):
        enumerate_groups(np.full(64, 1 / 64), 6)
    assert MAX_GROUP_ENTRIES == 2**22


# ---------------------------------------------------------------------------------------------
# The mismatch chapter's sentences, read back against the functions (its tables are computed at
# build time by docs/hooks/generate.py, _groups, on the same toy)
# ---------------------------------------------------------------------------------------------
PAGE = pathlib.Path(__file__).parents[2] / "docs" / "mismatch.md"
HALF = 5e-5  # half a unit of the fourth decimal the page prints (0.5e-3 for three decimals)


def _chapter_toy():
    toy = make_toy(T=3, V=2, mismatch=0.3, seed=0)  # generate.GROUPS_TOY and GROUPS_BAND
    return toy, rejection_weights(toy, "seq_mis", low=0.5, high=2.0)


def test_the_chapters_sentences_are_its_tables():
    page = " ".join(PAGE.read_text().split())
    toy, w = _chapter_toy()
    rows = {r["baseline"]: r for r in group_table(toy, w, 4)}
    found = re.search(r"the six choices put the relative bias against \$\\nabla J\$ between "
                      r"([0-9.]+) and ([0-9.]+), and which choice is nearer \$\\nabla J\$ "
                      r"depends on the baseline \(verl's `rloo_all` for RLOO, the kept-only "
                      r"`grpo_std_kept` for GRPO with its standard deviation\)", page)
    assert found, "the sentence on the six choices' bias is not on the page"
    biases = [r["rel_bias"] for r in rows.values()]
    assert_matches_committed([min(biases), max(biases)], [float(x) for x in found.groups()],
                             rtol=0, atol=5e-4, why="three decimals on the page")
    assert rows["rloo_all"]["rel_bias"] < rows["rloo_kept"]["rel_bias"]
    assert rows["grpo_std_kept"]["rel_bias"] < rows["grpo_std_all"]["rel_bias"]
    found = re.search(r"\(from ([0-9.]+) at \$G = 2\$ to ([0-9.]+) at \$G = 8\$, while "
                      r"`rloo_all` stays at ([0-9.]+)\), and pays in variance, since fewer "
                      r"answers enter its baseline \(([0-9.]+) against ([0-9.]+) at \$G = 4\$\)",
                      page)
    assert found, "the sentence on RLOO against the group size is not on the page"
    kept = {G: group_moments(toy, w, G, "rloo_kept") for G in (2, 4, 8)}
    every = {G: group_moments(toy, w, G, "rloo_all") for G in (2, 3, 4, 8)}
    stated = [float(x) for x in found.groups()]
    computed = [kept[2]["target_bias"], kept[8]["target_bias"], every[4]["target_bias"],
                kept[4]["var"], every[4]["var"]]
    assert_matches_committed(computed, stated, rtol=0, atol=HALF,
                             why="the page prints four decimals: half a unit of the last one")
    # "stays": the offset of rloo_all is the same at every G (the closed form's)
    offsets = [every[G]["target_bias"] for G in every]
    assert max(offsets) - min(offsets) < 1e-12
    assert "verl 0.9.1 computes the `_all` choices" in page
    assert {b for b, r in rows.items() if r["verl"]} == {"grpo_all", "grpo_std_all", "rloo_all"}


def test_without_rejection_the_two_rloo_choices_are_one_unbiased_estimator_on_the_chapters_toy():
    toy, _ = _chapter_toy()
    rho = E.seq_is(toy, return_weights=True)
    kept, every = (group_moments(toy, rho, 4, b) for b in ("rloo_kept", "rloo_all"))
    assert kept["rel_bias"] < 1e-12 and every["rel_bias"] < 1e-12
    assert abs(kept["var"] - every["var"]) < 1e-12
