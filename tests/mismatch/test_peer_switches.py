"""The switches of TRL, OpenRLHF / NeMo-RL and KPop: numpy weights, exact moments, torch forms.

The seven estimators ``trl_token_truncate``, ``trl_token_mask``, ``trl_sequence_truncate``,
``trl_sequence_mask``, ``off_policy_mask``, ``seq_mask_tis`` and ``kpop`` are rebuilt here from
the formulas of their docstrings, their exact moments are checked against an explicit sum over
the enumerated sequences (and their bias against the closed forms the docstrings state), and
their torch forms in ``opd_literate.mismatch.correction`` are compared with them on the toys'
enumerated ``(M, T)`` batches, as ``test_correction.py`` does for the other eighteen (equal: the
same zeros, the other values within 1e-13 relative). The frameworks' own code is run in
``tests/integration/test_trl_is_modes.py``.
"""

import math
import pathlib
import re

import numpy as np
import pytest
import torch

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.toy import (
    estimator_moments,
    make_ar_toy,
    make_toy,
    response_mask,
    toy_from_logits,
)
from tests.helpers.batches import as_batch
from tests.helpers.committed import assert_matches_committed

INF = math.inf

DEFAULTS = {
    "trl_token_truncate": {"clip_min": 0.0, "clip_max": 3.0},
    "trl_token_mask": {"clip_min": 0.0, "clip_max": 3.0},
    "trl_sequence_truncate": {"clip_min": 0.0, "clip_max": 3.0},
    "trl_sequence_mask": {"clip_min": 0.0, "clip_max": 3.0},
    "off_policy_mask": {"threshold": 0.5},
    "seq_mask_tis": {"low": 0.999, "high": 1.002},
    "kpop": {"threshold": 0.1, "eps": 1e-6},
}

# Parameters at which every bound changes some weight of the toys below (checked).
OTHER = {
    "trl_token_truncate": {"clip_min": 0.7, "clip_max": 1.5},
    "trl_token_mask": {"clip_min": 0.7, "clip_max": 1.5},
    "trl_sequence_truncate": {"clip_min": 0.5, "clip_max": 1.5},
    "trl_sequence_mask": {"clip_min": 0.5, "clip_max": 1.5},
    "off_policy_mask": {"threshold": 0.05},
    "seq_mask_tis": {"low": 0.8, "high": 1.25},
    "kpop": {"threshold": 0.02, "eps": 1e-6},
}

TOYS = {
    "toy": make_toy(T=3, V=3, mismatch=0.6, seed=1),
    "ar_toy": make_ar_toy(T=3, V=4, mismatch=0.8, seed=1),  # ragged responses with padding
    "m1": make_toy(T=3, V=3, mismatch=1.0, seed=0),
    "m0": make_toy(T=3, V=3, mismatch=0.0, seed=0),  # every ratio is exactly 1
}
BASELINE = 0.5  # R - 0.5 = +-0.5: both signs of the advantage, and dividing by it is exact


def _parts(toy):
    log_rho_t = (toy["logp_train"] - toy["logp_sampler"]) * response_mask(toy)
    n = response_mask(toy).sum(axis=1)
    return np.exp(log_rho_t), np.exp(log_rho_t.sum(axis=1)), np.exp(log_rho_t.sum(axis=1) / n)


def reference(name, toy, baseline=0.0, **p):
    """The (M, T) or (M,) weights of the docstrings' formulas, written from scratch."""
    rho_t, rho, geo = _parts(toy)
    if name == "trl_token_truncate":
        return np.minimum(np.maximum(rho_t, p["clip_min"]), p["clip_max"])
    if name == "trl_token_mask":
        return rho_t * ((p["clip_min"] <= rho_t) & (rho_t <= p["clip_max"]))
    if name == "trl_sequence_truncate":
        return np.minimum(np.maximum(rho, p["clip_min"]), p["clip_max"])
    if name == "trl_sequence_mask":
        return rho * ((p["clip_min"] <= rho) & (rho <= p["clip_max"]))
    if name == "off_policy_mask":
        mask = response_mask(toy)
        k1 = ((toy["logp_sampler"] - toy["logp_train"]) * mask).sum(axis=1) / mask.sum(axis=1)
        return ((toy["R"] - baseline >= 0) | (k1 <= p["threshold"])) * 1.0
    if name == "seq_mask_tis":
        return ((p["low"] <= geo) & (geo <= p["high"]))[:, None] * rho_t
    if name == "kpop":
        pi = np.clip(np.exp(toy["logp_train"]), p["eps"], 1 - p["eps"])
        mu = np.clip(np.exp(toy["logp_sampler"]), p["eps"], 1 - p["eps"])

        def kl(a, b):
            return a * np.log(a / b) + (1 - a) * np.log((1 - a) / (1 - b))

        return rho_t * ((kl(pi, mu) <= p["threshold"]) & (kl(mu, pi) <= p["threshold"]))
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# The registry and the weights
# ---------------------------------------------------------------------------------------------
def test_the_seven_are_registered_with_these_defaults():
    # test_estimators.py and test_correction.py leave exactly these seven to this file
    assert len(E.REGISTRY) == 30 and set(DEFAULTS) <= set(E.REGISTRY)
    for name, defaults in DEFAULTS.items():
        spec = E.REGISTRY[name]
        assert spec.defaults == defaults and spec.fn is getattr(E, name) and not spec.unbiased
        assert name in E.__all__


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("baseline", [0.0, 0.5, 1.0])  # A = 0 for R = baseline
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_weights_are_the_formula(name, toy_name, baseline):
    toy = TOYS[toy_name]
    for params in ({}, OTHER[name]):
        want = reference(name, toy, baseline, **{**DEFAULTS[name], **params})
        got = getattr(E, name)(toy, **params, baseline=baseline, return_weights=True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # the estimate is w_t (R - b) s_t
    w = want if want.ndim == 2 else want[:, None]
    extra = (1,) * (toy["score"].ndim - 2)
    est = (w * (toy["R"] - baseline)[:, None]).reshape(w.shape + extra) * toy["score"]
    np.testing.assert_allclose(getattr(E, name)(toy, **OTHER[name], baseline=baseline), est,
                               rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("name", sorted(OTHER))
def test_the_other_bounds_bite(name):
    for toy_name in ("toy", "ar_toy", "m1"):
        toy = TOYS[toy_name]
        at_default = reference(name, toy, BASELINE, **DEFAULTS[name])
        other = reference(name, toy, BASELINE, **OTHER[name])
        assert not np.allclose(other, at_default), (name, toy_name)
        kind = E.REGISTRY[name].reference
        plain = E._reference_weights(toy, kind)
        assert not np.allclose(np.broadcast_to(other.T, plain.T.shape).T * response_mask(toy),
                               plain * response_mask(toy)), (name, toy_name)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_without_mismatch_every_weight_is_one(name):
    toy = TOYS["m0"]
    w = getattr(E, name)(toy, baseline=BASELINE, return_weights=True)
    np.testing.assert_array_equal(w, np.ones_like(w))


def test_bounds_are_inclusive():
    toy = TOYS["m0"]  # every ratio is exactly 1: on both bounds
    for name in ("trl_token_mask", "trl_sequence_mask"):
        assert (E.estimator_weights(toy, name, clip_min=1.0, clip_max=1.5) == 1).all()
        assert (E.estimator_weights(toy, name, clip_min=0.5, clip_max=1.0) == 1).all()
    assert (E.seq_mask_tis(toy, low=1.0, high=1.0, return_weights=True) == 1).all()
    assert (E.kpop(toy, threshold=0.0, return_weights=True) == 1).all()
    assert (E.off_policy_mask(toy, threshold=0.0, baseline=2.0, return_weights=True) == 1).all()


def test_wide_bounds_give_the_uncorrected_estimators():
    toy = make_toy(mismatch=1.0)
    wide = {"clip_min": 0.0, "clip_max": INF}
    np.testing.assert_array_equal(E.trl_token_truncate(toy, **wide), E.token_is(toy))
    np.testing.assert_array_equal(E.trl_token_mask(toy, **wide), E.token_is(toy))
    np.testing.assert_allclose(E.trl_sequence_truncate(toy, **wide), E.seq_is(toy), rtol=1e-15)
    np.testing.assert_allclose(E.trl_sequence_mask(toy, **wide), E.seq_is(toy), rtol=1e-15)
    np.testing.assert_array_equal(E.seq_mask_tis(toy, low=0.0, high=INF), E.token_is(toy))
    np.testing.assert_array_equal(E.kpop(toy, threshold=INF), E.token_is(toy))
    np.testing.assert_array_equal(E.off_policy_mask(toy, threshold=INF, baseline=0.5),
                                  E.naive(toy, baseline=0.5))
    # with R in {0, 1} and baseline 0 no advantage is negative: nothing to drop
    np.testing.assert_array_equal(E.off_policy_mask(toy, threshold=-1e9), E.naive(toy))


def test_the_trl_modes_are_the_catalogues_estimators_at_trls_bounds():
    toy = make_toy(mismatch=1.0)
    np.testing.assert_array_equal(E.trl_token_truncate(toy, clip_max=2.0), E.token_tis(toy, 2.0))
    np.testing.assert_array_equal(E.trl_token_truncate(toy, 0.5, 2.0), E.token_clamp(toy, 0.5, 2.0))
    np.testing.assert_array_equal(E.trl_token_mask(toy, 0.5, 2.0), E.token_mis(toy, 0.5, 2.0))
    np.testing.assert_allclose(E.trl_sequence_truncate(toy, clip_max=2.0), E.seq_tis(toy, 2.0),
                               rtol=1e-15)
    np.testing.assert_allclose(E.trl_sequence_mask(toy, 0.5, 2.0), E.seq_mis(toy, 0.5, 2.0),
                               rtol=1e-15)
    # seq-mask-tis is geo_rs_token_tis without the cap
    np.testing.assert_array_equal(E.seq_mask_tis(toy, 0.8, 1.25),
                                  E.geo_rs_token_tis(toy, 0.8, 1.25, cap=INF))


def test_the_sequence_ratio_is_the_sum_of_the_log_ratios_not_the_mean():
    two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    # rho = 0.625^2, 0.625 * 2.5, 2.5^2; the geometric means would be 0.625, 1.25, 2.5
    np.testing.assert_allclose(E.trl_sequence_mask(two, clip_max=INF, return_weights=True),
                               [0.390625, 1.5625, 1.5625, 6.25], rtol=1e-15)


def test_kpop_adapts_its_band_to_the_probability():
    """The docstring's example: ratio 2 kept at 0.02 -> 0.04, ratio 0.625 masked at 0.8 -> 0.5."""
    toy = toy_from_logits(np.log([[0.5, 0.04, 0.46]]), np.log([[0.8, 0.02, 0.18]]))
    p, q = np.array([0.5, 0.04, 0.46]), np.array([0.8, 0.02, 0.18])
    kl_pq = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    kl_qp = q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))
    np.testing.assert_allclose(kl_pq, [0.22314, 0.00793, 0.20603], atol=5e-6)
    np.testing.assert_allclose(kl_qp, [0.19274, 0.00634, 0.17365], atol=5e-6)
    np.testing.assert_allclose(E.kpop(toy, return_weights=True), [[0.0], [2.0], [0.0]],
                               rtol=1e-12)
    # the clamp eps: a probability below it is read as eps (0.04 -> 0.05 here)
    clamped = E.kpop(toy, threshold=0.1, eps=0.05, return_weights=True)
    np.testing.assert_allclose(clamped, [[0.0], [2.0], [0.0]], rtol=1e-12)


def test_off_policy_mask_keeps_a_zero_advantage():
    flip = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.2, 0.8]]))  # R = 1, 0
    # baseline 0: token 1 has A = 0, kept though its k1 = log 1.6 > 0.4
    assert E.off_policy_mask(flip, threshold=0.4, return_weights=True).tolist() == [1.0, 1.0]
    assert E.off_policy_mask(flip, threshold=0.4, baseline=1e-12,
                             return_weights=True).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("name, kwargs, error, message", [
    ("trl_token_truncate", {"clip_min": 2.0, "clip_max": 2.0}, ValueError,
     "clip_min must be < clip_max"),
    ("trl_token_mask", {"clip_min": -0.1}, ValueError, "clip_min must be >= 0.0"),
    ("trl_sequence_mask", {"clip_min": INF}, ValueError, "clip_min must be a finite number"),
    ("trl_sequence_truncate", {"clip_max": 0.0}, ValueError, "clip_max must be > 0"),
    ("trl_sequence_truncate", {"clip_max": float("nan")}, ValueError, "clip_max must be a finite"),
    ("off_policy_mask", {"threshold": float("nan")}, ValueError, "threshold must be a finite"),
    ("off_policy_mask", {"threshold": True}, TypeError, "threshold must be a real number"),
    ("seq_mask_tis", {"low": 2.0, "high": 1.0}, ValueError, "low must be <= high"),
    ("kpop", {"threshold": -1.0}, ValueError, "threshold must be >= 0.0"),
    ("kpop", {"eps": 0.0}, ValueError, "eps must be > 0"),
    ("kpop", {"eps": 0.5}, ValueError, "eps must be < 0.5"),
    ("kpop", {"baseline": float("inf")}, ValueError, "baseline must be a finite"),
])
def test_errors_name_the_argument(name, kwargs, error, message):
    for return_weights in (False, True):
        with pytest.raises(error, match=message):
            getattr(E, name)(TOYS["toy"], **kwargs, return_weights=return_weights)


@pytest.mark.parametrize("toy_name", ["m1", "ar_toy"])
def test_comparison_rows_are_a_hand_built_loop(toy_name):
    """comparison_table's rows of the seven (at their defaults, baseline 0.5) from the formulas:
    a token counts as modified where its weight differs from its uncorrected ratio."""
    toy = TOYS[toy_name]
    rows = {r["name"]: r for r in E.comparison_table(toy, N=16, baseline=BASELINE)}
    rho_t, rho, _ = _parts(toy)
    mask, mu = response_mask(toy), toy["p_sampler"]
    for name in DEFAULTS:
        w = reference(name, toy, BASELINE, **DEFAULTS[name])
        w = np.broadcast_to(w if w.ndim == 2 else w[:, None], rho_t.shape)
        plain = {"one": np.ones_like(rho_t), "token": rho_t,
                 "sequence": np.broadcast_to(rho[:, None], rho_t.shape)}[E.REGISTRY[name].reference]
        modified = (np.abs(w - plain) > 1e-12 * plain) & (mask > 0)
        moments = estimator_moments(toy, E.weighted_score(toy, w, BASELINE))
        row = rows[name]
        assert row["bias"] == pytest.approx(moments["bias"], rel=1e-9, abs=1e-14), name
        assert row["var"] == pytest.approx(moments["var"], rel=1e-9, abs=1e-14), name
        assert row["rel_rmse"] == pytest.approx(moments["rel_rmse"](16), rel=1e-9), name
        assert row["token_frac"] == pytest.approx(
            float(mu @ (modified.sum(axis=1) / mask.sum(axis=1))), rel=1e-9, abs=1e-14), name
        assert row["seq_frac"] == pytest.approx(float(mu @ modified.any(axis=1)), rel=1e-9,
                                                abs=1e-14), name
        assert row["source"] == E.REGISTRY[name].source and row["unbiased"] is False


# ---------------------------------------------------------------------------------------------
# Exact moments: an explicit sum over the enumerated sequences, and the closed-form biases
# ---------------------------------------------------------------------------------------------
def _explicit_moments(toy, estimate):
    """mean = sum_m mu_m g_m, var = sum_m mu_m |g_m - mean|^2, one sequence at a time."""
    mean = np.zeros(estimate.shape[1:])
    for m, mu in enumerate(toy["p_sampler"]):
        mean += mu * estimate[m]
    var = sum(mu * float(((estimate[m] - mean) ** 2).sum())
              for m, mu in enumerate(toy["p_sampler"]))
    return mean, float(np.sqrt(((mean - toy["true_grad"]) ** 2).sum())), var


@pytest.mark.parametrize("toy_name", ["toy", "ar_toy", "m1"])
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_exact_moments_are_the_enumerated_sums(name, toy_name):
    toy = TOYS[toy_name]
    estimate = getattr(E, name)(toy, **OTHER[name], baseline=BASELINE)
    mean, bias, var = _explicit_moments(toy, estimate)
    moments = estimator_moments(toy, estimate)
    np.testing.assert_allclose(moments["mean"], mean, rtol=1e-12, atol=1e-15)
    assert moments["bias"] == pytest.approx(bias, rel=1e-10)
    assert moments["var"] == pytest.approx(var, rel=1e-10)
    assert bias > 1e-3  # biased, as the registry says


def _a_score(toy, baseline):
    """(M, T, ...) A * s_t: the REINFORCE term of each sequence on its rows."""
    extra = (1,) * (toy["score"].ndim - 1)
    return (toy["R"] - baseline).reshape((-1,) + extra) * toy["score"]


@pytest.mark.parametrize("toy_name", ["toy", "ar_toy", "m1"])
@pytest.mark.parametrize("clip_min, clip_max", [(0.0, 3.0), (0.5, 1.5), (0.8, INF)])
def test_sequence_modes_bias_is_the_mass_they_move(toy_name, clip_min, clip_max):
    """E_mu[w A s] - grad J: -(rho - C_max)_+ + (C_min - rho)_+ for truncation, -rho outside for
    the mask (rho's own estimate is unbiased)."""
    toy = TOYS[toy_name]
    _, rho, _ = _parts(toy)
    a_score = _a_score(toy, BASELINE)
    mu = toy["p_sampler"]

    def bias_vector(fn):
        return estimator_moments(toy, fn(toy, clip_min, clip_max, BASELINE))["mean"] \
            - toy["true_grad"]

    moved = np.maximum(clip_min - rho, 0.0) - np.maximum(rho - clip_max, 0.0)
    formula = np.einsum("m,m,m...->...", mu, moved, a_score)
    np.testing.assert_allclose(bias_vector(E.trl_sequence_truncate), formula, rtol=1e-9,
                               atol=1e-13)
    dropped = rho * ~((clip_min <= rho) & (rho <= clip_max))
    formula = -np.einsum("m,m,m...->...", mu, dropped, a_score)
    np.testing.assert_allclose(bias_vector(E.trl_sequence_mask), formula, rtol=1e-9, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# The numbers quoted for the chapter (comparison_table rows on make_toy and make_ar_toy)
# ---------------------------------------------------------------------------------------------
def _rows(toy, baseline, names, params=None):
    return {r["name"]: r for r in E.comparison_table(toy, names=names, N=64, baseline=baseline,
                                                     params=params)}


PAGE = pathlib.Path(__file__).parents[2] / "docs" / "mismatch.md"


def _page():
    return " ".join(PAGE.read_text().split())


def _stated(pattern):
    """The numbers of the chapter's sentence ``pattern`` (a regex with ``{n}`` for each)."""
    found = re.search(pattern.replace("{n}", r"([0-9.]+)"), _page())
    assert found, f"the sentence {pattern[:60]!r} is not on the page"
    return [float(x) for x in found.groups()]


def _close(computed, stated, digits=3):
    assert_matches_committed(computed, stated, rtol=0, atol=0.5 * 10.0**-digits,
                             why=f"the page prints {digits} decimals: half a unit of the last")


def test_the_chapters_sentence_on_trls_default_sequence_mask():
    """make_toy() (T=6, V=4, mismatch 0.3), baseline 0, and the same toy at other lengths."""
    rows = _rows(make_toy(), 0.0, ["seq_is", "seq_tis", "seq_mis", "trl_sequence_mask",
                                   "trl_sequence_truncate"])
    mask, trunc = rows["trl_sequence_mask"], rows["trl_sequence_truncate"]
    stated = _stated(r"TRL's default, `trl_sequence_mask`, drops {n} % of the sequences at "
                     r"\$\\epsilon = 0.3\$; its relative bias, {n}, lies between `seq_tis`'s "
                     r"{n} and `seq_mis`'s {n}, and its variance, {n}, is below `seq_tis`'s {n} "
                     r"and `seq_is`'s {n}\.")
    _close([100 * mask["seq_frac"]], stated[:1], digits=1)  # a percentage, one decimal
    _close([mask["rel_bias"], rows["seq_tis"]["rel_bias"], rows["seq_mis"]["rel_bias"],
            mask["var"], rows["seq_tis"]["var"], rows["seq_is"]["var"]], stated[1:])
    assert rows["seq_tis"]["rel_bias"] < mask["rel_bias"] < rows["seq_mis"]["rel_bias"]
    assert mask["var"] < rows["seq_tis"]["var"] < rows["seq_is"]["var"]
    lengths = _stated(r"on the same toy with 2, 4, 6 and 8 positions its relative bias is "
                      r"{n}, {n}, {n} and {n}\.")
    by_length = [_rows(make_toy(T=T), 0.0, ["trl_sequence_mask"])["trl_sequence_mask"]["rel_bias"]
                 for T in (2, 4, 6, 8)]
    _close(by_length, lengths)
    assert all(a < b for a, b in zip(by_length, by_length[1:]))  # "grow longer"
    _close([trunc["rel_bias"], trunc["var"]],
           _stated(r"\(`trl_sequence_truncate`\) keeps the bias at {n} for a variance of {n}\."))


def test_the_chapters_sentence_on_trls_token_modes():
    rows = _rows(make_toy(), 0.0, ["token_is", "trl_token_truncate", "trl_token_mask"])
    for name in ("trl_token_truncate", "trl_token_mask"):
        assert rows[name]["token_frac"] == 0.0  # "no token ratio reaches 3"
        assert rows[name]["rel_bias"] == pytest.approx(rows["token_is"]["rel_bias"], rel=1e-12)
    rows = _rows(make_toy(mismatch=1.0), 0.5, ["token_is", "trl_token_truncate",
                                               "trl_token_mask"])
    truncate, mask, token_is = rows["trl_token_truncate"], rows["trl_token_mask"], rows["token_is"]
    stated = _stated(r"truncation has relative bias {n} and variance {n}, masking {n} and {n}, "
                     r"against {n} and {n} for `token_is`")
    _close([truncate["rel_bias"], truncate["var"], mask["rel_bias"], mask["var"],
            token_is["rel_bias"], token_is["var"]], stated)


def test_the_chapters_sentence_on_the_off_policy_mask():
    for toy, baseline in ((make_toy(), 0.5), (make_toy(mismatch=1.0), 0.0)):
        assert _rows(toy, baseline, ["off_policy_mask"])["off_policy_mask"]["seq_frac"] == 0.0
    toy = make_toy(mismatch=1.0)
    rows = _rows(toy, 0.5, ["naive", "token_is", "off_policy_mask"])
    tight = _rows(toy, 0.5, ["off_policy_mask"],
                  {"off_policy_mask": {"threshold": 0.2}})["off_policy_mask"]
    stated = _stated(r"it drops {n} % of the sequences and cuts `naive`'s relative bias from {n} "
                     r"to {n}; at \$\\delta = 0.2\$ it drops {n} %, for a bias of {n}, below "
                     r"`token_is`'s, and a variance of {n}\.")
    _close([100 * rows["off_policy_mask"]["seq_frac"], 100 * tight["seq_frac"]],
           [stated[0], stated[3]], digits=1)
    _close([rows["naive"]["rel_bias"], rows["off_policy_mask"]["rel_bias"], tight["rel_bias"],
            tight["var"]], [stated[1], stated[2], stated[4], stated[5]])
    assert tight["rel_bias"] < rows["token_is"]["rel_bias"]


def test_the_chapters_sentence_on_seq_mask_tis():
    rows = _rows(make_toy(), 0.0, ["seq_mask_tis"])["seq_mask_tis"]
    stated = _stated(r"`seq_mask_tis` at NeMo-RL's band drops {n} % of the sequences at "
                     r"\$\\epsilon = 0.3\$ \(relative bias {n}\) and every one on the "
                     r"autoregressive toy")
    _close([100 * rows["seq_frac"]], stated[:1], digits=1)
    _close([rows["rel_bias"]], stated[1:])
    ar = _rows(make_ar_toy(), 0.0, ["seq_mask_tis"])["seq_mask_tis"]
    assert ar["seq_frac"] == pytest.approx(1.0, abs=1e-12)  # a sum of mu
    wide = {"seq_mask_tis": {"low": 0.5, "high": 5.0}}
    rows = _rows(make_toy(), 0.0, ["token_is", "seq_mask_tis"], wide)
    assert rows["seq_mask_tis"]["seq_frac"] == 0.0
    assert rows["seq_mask_tis"]["rel_bias"] == pytest.approx(rows["token_is"]["rel_bias"],
                                                             rel=1e-12)
    rows = _rows(make_toy(mismatch=1.0), 0.5, ["token_is", "seq_mask_tis"], wide)
    stated = _stated(r"it drops {n} % of the sequences for a bias of {n} and hardly less "
                     r"variance, {n}\.")
    _close([100 * rows["seq_mask_tis"]["seq_frac"]], stated[:1], digits=1)
    _close([rows["seq_mask_tis"]["rel_bias"], rows["seq_mask_tis"]["var"]], stated[1:])
    assert rows["token_is"]["var"] - rows["seq_mask_tis"]["var"] < 0.1  # "hardly less"
    assert rows["seq_mask_tis"]["var"] < rows["token_is"]["var"]


def test_the_chapters_sentence_on_kpop():
    rows = _rows(make_toy(), 0.0, ["token_is", "kpop"])
    assert rows["kpop"]["token_frac"] == 0.0
    assert rows["kpop"]["rel_bias"] == pytest.approx(rows["token_is"]["rel_bias"], rel=1e-12)
    kpop = _rows(make_toy(mismatch=1.0), 0.5, ["kpop"])["kpop"]
    stated = _stated(r"it masks {n} % of the tokens, for a relative bias of {n} and a variance "
                     r"of {n}:")
    _close([100 * kpop["token_frac"]], stated[:1], digits=1)
    _close([kpop["rel_bias"], kpop["var"]], stated[1:])


# ---------------------------------------------------------------------------------------------
# The torch forms on the toys' enumerated batches
# ---------------------------------------------------------------------------------------------
def torch_weights(name, toy, p):
    batch = as_batch(toy)
    if name.startswith("trl_"):
        mode = name[len("trl_"):]
        return C.trl_importance_weights(*batch, mode,
                                        vllm_importance_sampling_clip_min=p["clip_min"],
                                        vllm_importance_sampling_clip_max=p["clip_max"])[0]
    if name == "off_policy_mask":
        A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)
        trainer, sampler, mask = batch
        return C.off_policy_sequence_mask(trainer, sampler, A, mask, p["threshold"]).double()
    if name == "seq_mask_tis":
        return C.seq_mask_tis_weights(*batch, low=p["low"], high=p["high"])[0]
    if name == "kpop":
        keep, _ = C.kpop_mask(*batch, p["threshold"], eps=p["eps"])
        weights, _ = C.importance_weights(*batch, "token", rollout_is_threshold=INF)
        return weights * keep
    raise KeyError(name)


@pytest.mark.parametrize("params", ["defaults", "other"])
@pytest.mark.parametrize("toy_name", ["toy", "ar_toy"])
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_torch_equals_numpy_on_the_enumerated_batch(name, toy_name, params):
    toy = TOYS[toy_name]
    p = {**DEFAULTS[name], **(OTHER[name] if params == "other" else {})}
    expected = E.estimator_weights(toy, name, baseline=BASELINE, **p) * response_mask(toy)
    got = torch_weights(name, toy, p).detach().numpy()
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got == 0, expected == 0)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("toy_name", ["toy", "ar_toy"])
def test_seq_mask_tis_is_verls_token_is_with_seq_mean_k1(toy_name):
    batch = as_batch(TOYS[toy_name])
    c = C.rollout_correction(*batch, rollout_is="token", rollout_is_threshold=INF,
                             rollout_rs="seq_mean_k1",
                             rollout_rs_threshold=f"{1 / 1.25!r}_{1 / 0.8!r}")
    weights, metrics = C.seq_mask_tis_weights(*batch, low=0.8, high=1.25)
    torch.testing.assert_close(weights, c.weights * c.keep, rtol=1e-13, atol=0)
    assert metrics["is_oob_ratio"] == c.metrics["rollout_corr/rollout_rs_seq_masked_fraction"]


def test_trl_none_bounds_are_no_bound():
    batch = as_batch(TOYS["toy"])
    for mode in C.TRL_IS_MODES:
        none, _ = C.trl_importance_weights(*batch, mode, vllm_importance_sampling_clip_min=None,
                                           vllm_importance_sampling_clip_max=2.0)
        zero, _ = C.trl_importance_weights(*batch, mode, vllm_importance_sampling_clip_min=0.0,
                                           vllm_importance_sampling_clip_max=2.0)
        torch.testing.assert_close(none, zero, rtol=0, atol=0)
    unbounded, _ = C.trl_importance_weights(*batch, "token_mask",
                                            vllm_importance_sampling_clip_max=None)
    plain, _ = C.importance_weights(*batch, "token", rollout_is_threshold=INF)
    torch.testing.assert_close(unbounded, plain, rtol=0, atol=0)


def test_trl_metrics_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.8, 0.2, 0.7], [0.2, 0.2, 0.7]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # rho_t = 0.625, 2.5 | 2.5, 2.5, 5/7
    _, m = C.trl_importance_weights(trainer, sampler, mask, "token_truncate")
    # |log rho_t| = log 1.6, log 2.5, log 2.5, log 2.5, log 1.4
    diffs = [math.log(1.6), math.log(2.5), math.log(2.5), math.log(2.5), math.log(1.4)]
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(diffs) / 5, rel=1e-12)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(2.5), rel=1e-12)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.625, rel=1e-12)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(2.5, rel=1e-12)
    mean = (0.625 + 2.5 * 3 + 5 / 7) / 5
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(mean, rel=1e-12)
    # per sequence: rho = 1.5625 and 6.25 * 5/7 = 4.46, masked at 3
    _, m = C.trl_importance_weights(trainer, sampler, mask)
    assert m["sampling/importance_sampling_ratio/min"] == 0.0
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5625, rel=1e-12)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.5625 / 2, rel=1e-12)


def test_kpop_metrics_by_hand():
    trainer = torch.log(torch.tensor([[0.04, 0.5, 0.3]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.02, 0.8, 0.3]], dtype=torch.float64))
    keep, m = C.kpop_mask(trainer, sampler, torch.ones(1, 3))
    assert keep.tolist() == [[True, False, True]]
    assert m["is_masked"] == pytest.approx(1 / 3)
    k3 = [2 - 1 - math.log(2), 0.625 - 1 - math.log(0.625), 0.0]
    assert m["masked_mismatch_kl"] == pytest.approx(k3[1], rel=1e-12)
    assert m["unmasked_mismatch_kl"] == pytest.approx((k3[0] + k3[2]) / 2, rel=1e-12)
    _, m = C.kpop_mask(trainer, sampler, torch.ones(1, 3), INF)
    assert m["is_masked"] == 0.0 and m["masked_mismatch_kl"] == 0.0


def _padded_batch(dtype):
    """Two responses, the second with padding that holds -inf and NaN."""
    trainer = torch.tensor([[-0.7, -1.2, -0.3], [-0.4, -math.inf, math.nan]], dtype=dtype)
    sampler = torch.tensor([[-0.9, -0.5, -0.35], [-1.1, math.nan, -math.inf]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return trainer, sampler, mask


def _all_forms(trainer, sampler, mask):
    A = torch.tensor([-1.0, 0.5], dtype=trainer.dtype)
    yield from (C.trl_importance_weights(trainer, sampler, mask, mode)[0]
                for mode in C.TRL_IS_MODES)
    yield C.off_policy_sequence_mask(trainer, sampler, A, mask, 0.1).to(trainer.dtype)
    yield C.seq_mask_tis_weights(trainer, sampler, mask, low=0.5, high=2.0)[0]
    yield C.kpop_mask(trainer, sampler, mask, 0.1)[0].to(trainer.dtype)


def test_padding_is_selected_away_and_half_precision_is_computed_in_float32():
    reference = list(_all_forms(*_padded_batch(torch.float64)))
    for r in reference:
        assert torch.isfinite(r).all() and (r[1, 1:] == 0).all()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for got, want in zip(_all_forms(*_padded_batch(dtype)), reference):
            assert torch.isfinite(got).all() and (got[1, 1:] == 0).all()
            if got.is_floating_point() and dtype != torch.float32:
                assert got.dtype in (torch.float32, dtype)
            # the inputs are rounded to the half-precision format; the arithmetic is float32
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0)
    w, _ = C.trl_importance_weights(*_padded_batch(torch.bfloat16), "token_truncate")
    assert w.dtype == torch.float32


def test_the_weights_are_detached_and_the_masks_bool():
    trainer, sampler, mask = _padded_batch(torch.float64)
    trainer = trainer.clone().requires_grad_()
    for mode in C.TRL_IS_MODES:
        assert not C.trl_importance_weights(trainer, sampler, mask, mode)[0].requires_grad
    assert not C.seq_mask_tis_weights(trainer, sampler, mask)[0].requires_grad
    assert C.kpop_mask(trainer, sampler, mask)[0].dtype == torch.bool
    A = torch.ones(2, 3, dtype=torch.float64)
    assert C.off_policy_sequence_mask(trainer, sampler, A, mask, 0.5).dtype == torch.bool


def test_off_policy_sequence_mask_reads_the_sign_per_token_with_per_token_advantages():
    trainer = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.8, 0.8]], dtype=torch.float64))  # k1 = log 1.6
    A = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    keep = C.off_policy_sequence_mask(trainer, sampler, A, torch.ones(1, 2), 0.4)
    assert keep.tolist() == [[True, False]]


def test_a_batch_without_tokens_gives_no_metrics():
    trainer = sampler = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.zeros(2, 3)
    for mode in C.TRL_IS_MODES:
        w, m = C.trl_importance_weights(trainer, sampler, mask, mode)
        assert m == {} and (w == 0).all()
    assert C.seq_mask_tis_weights(trainer, sampler, mask)[1] == {}
    assert C.kpop_mask(trainer, sampler, mask)[1] == {}


@pytest.mark.parametrize("call, error, message", [
    (lambda b: C.trl_importance_weights(*b, "token"), ValueError,
     "vllm_importance_sampling_mode must be one of"),
    (lambda b: C.trl_importance_weights(*b, "sequence_truncate",
                                        vllm_importance_sampling_clip_max=None), ValueError,
     "needs vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max"),
    (lambda b: C.trl_importance_weights(*b, vllm_importance_sampling_clip_min=3.0), ValueError,
     r"vllm_importance_sampling_clip_min \(3.0\) must be less than"),
    (lambda b: C.trl_importance_weights(*b, vllm_importance_sampling_clip_max=-1.0), ValueError,
     "vllm_importance_sampling_clip_max must be > 0"),
    (lambda b: C.trl_importance_weights(*b, vllm_importance_sampling_clip_min=float("nan")),
     ValueError, "vllm_importance_sampling_clip_min must be a finite number"),
    (lambda b: C.off_policy_sequence_mask(b[0], b[1], torch.ones(3), b[2], 0.5), ValueError,
     r"advantages must have shape \(B, T\)"),
    (lambda b: C.off_policy_sequence_mask(b[0], b[1], torch.ones(2), b[2], None), TypeError,
     "off_policy_mask_threshold must be a real number"),
    (lambda b: C.seq_mask_tis_weights(*b, low=2.0, high=1.0), ValueError, "low must be <= high"),
    (lambda b: C.kpop_mask(*b, -0.1), ValueError, "kpop_threshold must be >= 0.0"),
    (lambda b: C.kpop_mask(*b, eps=0.7), ValueError, "eps must be < 0.5"),
    (lambda b: C.kpop_mask(b[0] + 1.0, b[1], b[2]), ValueError,
     r"trainer_logp must be <= 0 where mask is 1 \(a log-probability: KPop"),
    (lambda b: C.trl_importance_weights(b[0][:, :2], b[1], b[2]), ValueError, "same shape"),
])
def test_errors_name_the_argument_torch(call, error, message):
    batch = _padded_batch(torch.float64)
    with pytest.raises(error, match=message):
        call(batch)


def test_nan_where_the_mask_is_one_is_an_error():
    trainer, sampler, mask = _padded_batch(torch.float64)
    bad = mask.clone()
    bad[1, 2] = 1  # trainer NaN there
    for call in (lambda: C.trl_importance_weights(trainer, sampler, bad),
                 lambda: C.seq_mask_tis_weights(trainer, sampler, bad),
                 lambda: C.kpop_mask(trainer, sampler, bad),
                 lambda: C.off_policy_sequence_mask(trainer, sampler, torch.ones(2), bad, 0.5)):
        with pytest.raises(ValueError, match=r"must be finite where mask is 1.*\(1, 2\)"):
            call()


def test_a_sequence_ratio_beyond_e20_is_masked_or_truncated_not_inf():
    trainer = torch.zeros(1, 3, dtype=torch.float32)
    sampler = torch.full((1, 3), -10.0)  # log rho = 30 > 20
    w, _ = C.trl_importance_weights(trainer, sampler, torch.ones(1, 3))
    assert (w == 0).all()
    w, _ = C.trl_importance_weights(trainer, sampler, torch.ones(1, 3), "sequence_truncate")
    assert (w == 3.0).all()
    w, _ = C.trl_importance_weights(trainer, sampler, torch.ones(1, 3), "sequence_mask",
                                    vllm_importance_sampling_clip_max=None)
    torch.testing.assert_close(w, torch.full((1, 3), math.exp(20.0)), rtol=1e-6, atol=0)
