"""The engine's sampler (opd_literate.mismatch.engine): its processing, its toy, and what every
estimator does under it, proved by enumeration against independent computations."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch import correction
from opd_literate.mismatch.engine import engine_toy, processed_log_probs
from opd_literate.mismatch.estimators import (
    REGISTRY,
    comparison_table,
    estimator_weights,
    naive,
    seq_is,
    token_ratios,
    weighted_score,
)
from opd_literate.mismatch.toy import (
    ar_toy_from_logits,
    estimator_moments,
    make_ar_toy,
    make_toy,
    toy_from_logits,
)


def vllm_keep(logits, temperature, top_k, top_p):
    """The kept tokens of one row, by vLLM's own algorithm (apply_top_k_top_p, read from
    vllm/v1/sample/ops/topk_topp_sampler.py): sort ascending, mask below the k-th largest,
    softmax, mask where the ascending cumulative sum is <= 1 - p, never the last. Written
    independently of engine.py (torch, ascending order, a cumulative sum from below)."""
    z = torch.as_tensor(np.asarray(logits, dtype=float)) / temperature
    z_sort, idx = z.sort(descending=False)
    if top_k is not None and top_k < len(z):
        z_sort = z_sort.masked_fill(z_sort < z_sort[len(z) - top_k], -math.inf)
    if top_p < 1.0:
        cumulative = z_sort.softmax(-1).cumsum(-1)
        cut = cumulative <= 1 - top_p
        cut[-1] = False
        z_sort = z_sort.masked_fill(cut, -math.inf)
    kept = torch.empty(len(z), dtype=torch.bool)
    kept[idx] = torch.isfinite(z_sort)
    return kept.numpy()


# ---------------------------------------------------------------------------------------------
# processed_log_probs
# ---------------------------------------------------------------------------------------------
def test_the_kept_tokens_are_vllms_on_random_rows():
    g = np.random.default_rng(0)
    checked = 0
    for _ in range(400):
        V = int(g.integers(1, 9))
        logits = g.normal(0, 2, V)
        temperature = float(g.choice([0.3, 0.7, 1.0, 1.6]))
        top_k = [None, 1, 2, 3, 5][int(g.integers(5))]
        top_p = float(g.choice([0.1, 0.5, 0.9, 0.95, 1.0]))
        ours = np.isfinite(processed_log_probs(logits, temperature, top_k, top_p))
        # The two rules read the same boundary from two sums; skip rows within rounding of it.
        probs = np.exp(processed_log_probs(logits, temperature, top_k))
        ranked = np.sort(probs)[::-1]
        if top_p < 1 and np.min(np.abs(np.cumsum(ranked) - top_p)) < 1e-9:
            continue
        np.testing.assert_array_equal(ours, vllm_keep(logits, temperature, top_k, top_p))
        checked += 1
    assert checked > 350


def test_a_row_is_the_renormalised_softmax_over_the_kept_tokens():
    g = np.random.default_rng(1)
    logits = g.normal(0, 1.5, (5, 6))
    out = processed_log_probs(logits, temperature=0.8, top_k=4, top_p=0.7)
    for row, z in zip(out, logits):
        kept = np.isfinite(row)
        mu = np.exp(z / 0.8 - np.max(z / 0.8))
        expected = np.where(kept, mu, 0) / mu[kept].sum()
        np.testing.assert_allclose(np.exp(row), expected, rtol=1e-13, atol=0)


def test_the_nucleus_is_the_smallest_top_set_reaching_p():
    """Brute force: the kept set is the shortest prefix of the ranking whose mass reaches p."""
    g = np.random.default_rng(2)
    for _ in range(200):
        V = int(g.integers(1, 7))
        logits, top_p = g.normal(0, 1, V), float(g.uniform(0.05, 0.99))
        probs = np.exp(processed_log_probs(logits))
        order = np.argsort(-probs)
        n = next(n for n in range(1, V + 1) if probs[order[:n]].sum() >= top_p - 1e-15)
        if abs(probs[order[:n]].sum() - top_p) < 1e-9:
            continue
        kept = np.isfinite(processed_log_probs(logits, top_p=top_p))
        assert set(np.flatnonzero(kept)) == set(order[:n].tolist())


def test_top_k_keeps_ties_with_the_kth_largest():
    out = processed_log_probs(np.array([2.0, 1.0, 1.0, 0.0]), top_k=2)
    assert np.isfinite(out).tolist() == [True, True, True, False]


def test_the_defaults_change_nothing_bit_for_bit():
    logits = np.random.default_rng(3).normal(0, 1, (3, 5))
    from opd_literate.mismatch.toy import log_softmax
    np.testing.assert_array_equal(processed_log_probs(logits), log_softmax(logits))
    np.testing.assert_array_equal(processed_log_probs(logits, top_k=5, top_p=1.0),
                                  log_softmax(logits))


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(temperature=math.nan), "temperature must be a finite number"),
    (dict(temperature=True), "temperature must be a real number"),
    (dict(temperature=1e-310), "logits / temperature overflows float64"),
    (dict(top_k=0), "top_k must be None"),
    (dict(top_k=1.5), "top_k must be None or an integer"),
    (dict(top_k=True), "top_k must be None or an integer"),
    (dict(top_p=0.0), "top_p must be > 0"),
    (dict(top_p=1.5), "top_p must be <= 1.0"),
    (dict(top_p=math.nan), "top_p must be a finite number"),
])
def test_bad_sampling_parameters_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        processed_log_probs(np.array([1e10, 0.0]), **kwargs)


@pytest.mark.parametrize("logits, message", [
    (np.array([0.0, np.nan]), "logits must be finite, got nan"),
    (np.array([0.0, np.inf]), "logits must be finite, got inf"),
    (np.array(1.0), r"logits must have shape \(..., V\) with V >= 1, got \(\)"),
    (np.zeros((2, 0)), r"got \(2, 0\)"),
    (np.array([True, False]), "logits must hold real numbers, got dtype bool"),
])
def test_bad_logits_are_named(logits, message):
    with pytest.raises((ValueError, TypeError), match=message):
        processed_log_probs(logits)


# ---------------------------------------------------------------------------------------------
# engine_toy: the defaults, the support, the target
# ---------------------------------------------------------------------------------------------
TOY_ARRAYS = ("Y", "logp_train", "logp_sampler", "p_train", "p_sampler", "R", "score",
              "true_grad")


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_the_default_engine_is_the_toys_sampler_bit_for_bit(make):
    toy = make()
    engine = engine_toy(toy)
    for key in TOY_ARRAYS + (("mask", "prev") if "mask" in toy else ()):
        np.testing.assert_array_equal(engine[key], toy[key], err_msg=key)
    assert engine["truncated_mass"] == 0.0 and not engine["truncated_grad"].any()


def test_the_target_gradient_is_autograds_of_the_tempered_objective():
    """J_tau(theta) = sum_y prod_t softmax(theta_t / tau)[y_t] R(y), differentiated by torch."""
    toy = make_toy(T=3, V=3, seed=4)
    tau = 0.6
    theta = torch.tensor(toy["theta"], requires_grad=True)
    log_pi = torch.log_softmax(theta / tau, dim=-1)
    Y = torch.as_tensor(toy["Y"])
    J = (torch.exp(log_pi[torch.arange(3), Y].sum(1)) * torch.as_tensor(toy["R"])).sum()
    J.backward()
    engine = engine_toy(toy, temperature=tau, top_p=0.6)
    np.testing.assert_allclose(engine["true_grad"], theta.grad.numpy(), rtol=0, atol=1e-14)


def test_the_ar_target_gradient_is_autograds_of_the_tempered_objective():
    toy = make_ar_toy(T=3, V=3, seed=5)
    tau = 1.4
    theta = torch.tensor(toy["theta"], requires_grad=True)
    log_pi = torch.log_softmax(theta / tau, dim=-1)
    Y, prev, mask = (torch.as_tensor(toy[k]) for k in ("Y", "prev", "mask"))
    token = log_pi[torch.arange(3)[None, :], prev.clamp(max=3), Y]  # the padding's row is V
    token = torch.where(mask > 0, token, torch.zeros((), dtype=token.dtype))
    J = (torch.exp(token.sum(1)) * torch.as_tensor(toy["R"])).sum()
    J.backward()
    engine = engine_toy(toy, temperature=tau, top_k=2)
    np.testing.assert_allclose(engine["true_grad"], theta.grad.numpy(), rtol=0, atol=1e-14)


def test_the_support_is_every_sequence_of_kept_tokens():
    toy = make_toy(T=4, V=4, mismatch=0.5, seed=6)
    engine = engine_toy(toy, temperature=0.9, top_k=3, top_p=0.8)
    kept = np.isfinite(processed_log_probs(toy["theta"] + 0.5 * toy["b"], 0.9, 3, 0.8))
    expected = [y for y in itertools.product(range(4), repeat=4)
                if all(kept[t, v] for t, v in enumerate(y))]
    assert engine["Y"].tolist() == [list(y) for y in expected]
    assert abs(engine["p_sampler"].sum() - 1) < 1e-12
    assert set(np.unique(engine["Y"][:, 0])) == set(np.flatnonzero(kept[0]))


def test_truncated_grad_and_mass_are_the_sequences_left_out():
    toy = make_toy(T=3, V=4, mismatch=0.3, seed=7)
    tau = 0.8
    engine = engine_toy(toy, temperature=tau, top_p=0.75)
    full = engine_toy(toy, temperature=tau)  # nothing cut: every sequence, under pi_tau
    written = {tuple(y) for y in engine["Y"].tolist()}
    out = np.array([tuple(y) not in written for y in full["Y"].tolist()])
    assert out.any()
    contribution = full["p_train"] * full["R"]
    expected = np.einsum("m,mtv->tv", contribution[out], full["score"][out])
    np.testing.assert_allclose(engine["truncated_grad"], expected, rtol=0, atol=1e-15)
    assert abs(engine["truncated_mass"] - full["p_train"][out].sum()) < 1e-15


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("sampling", [dict(top_p=0.9), dict(temperature=0.7, top_p=0.8),
                                      dict(top_k=2, temperature=1.3)])
def test_seq_is_with_processed_log_probs_misses_exactly_the_truncated_part(make, sampling):
    engine = engine_toy(make(), **sampling)
    mean = estimator_moments(engine, seq_is(engine))["mean"]
    np.testing.assert_allclose(mean, engine["true_grad"] - engine["truncated_grad"],
                               rtol=0, atol=1e-13)
    if engine["truncated_mass"] > 0:
        assert np.abs(engine["truncated_grad"]).max() > 1e-6  # a real bias, not rounding


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_without_truncation_seq_is_is_unbiased_only_with_the_processed_log_probs(make):
    toy = make()
    right = engine_toy(toy, temperature=0.7)
    wrong = engine_toy(toy, temperature=0.7, reported="raw")
    assert estimator_moments(right, seq_is(right))["rel_bias"] < 1e-12
    assert estimator_moments(wrong, seq_is(wrong))["rel_bias"] > 0.2


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_without_mismatch_each_processed_ratio_is_the_kept_mass_of_its_position(make):
    toy = make(mismatch=0.0)
    tau, top_p = 0.8, 0.85
    engine = engine_toy(toy, temperature=tau, top_p=top_p)
    mu_tau = np.exp(processed_log_probs(toy["theta"], tau))
    kept = np.isfinite(processed_log_probs(toy["theta"], tau, top_p=top_p))
    kept_mass = np.where(kept, mu_tau, 0).sum(-1)  # per row
    if "mask" in toy:
        rows = kept_mass[np.arange(toy["T"])[None, :], engine["prev"]]
        expected = np.where(engine["mask"] > 0, rows, 1.0)
    else:
        expected = np.broadcast_to(kept_mass, engine["Y"].shape)
    np.testing.assert_allclose(token_ratios(engine), expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_without_mismatch_or_truncation_every_estimator_is_naive_and_unbiased(make):
    """tau != 1 alone is no mismatch when the engine reports the processed log-probs: every ratio
    is 1. Reported raw, the same engine looks mismatched and the corrections add bias."""
    toy = make(mismatch=0.0)
    engine = engine_toy(toy, temperature=0.7)
    reference = naive(engine)
    for name in REGISTRY:
        estimate = weighted_score(engine, estimator_weights(engine, name), 0.0)
        np.testing.assert_allclose(estimate, reference, rtol=0, atol=1e-12, err_msg=name)
    assert estimator_moments(engine, reference)["rel_bias"] < 1e-12
    raw = engine_toy(toy, temperature=0.7, reported="raw")
    rows = {r["name"]: r for r in comparison_table(raw, names=["token_is", "seq_is"])}
    assert rows["token_is"]["rel_bias"] > 0.05 and rows["seq_is"]["rel_bias"] > 0.05


def test_a_trainer_without_the_temperature_estimates_the_untempered_gradient():
    """Processed log-probs, trainer at tau = 1: seq_is is unbiased for grad J_1, not grad J_tau."""
    toy = make_toy(T=4, V=3, mismatch=0.3, seed=8)
    engine = engine_toy(toy, temperature=0.6, trainer_temperature=False)
    mean = estimator_moments(engine, seq_is(engine))["mean"]
    np.testing.assert_allclose(mean, toy["true_grad"], rtol=0, atol=1e-13)  # grad J_1
    assert np.linalg.norm(mean - engine["true_grad"]) > 0.1 * np.linalg.norm(engine["true_grad"])
    np.testing.assert_array_equal(engine["logp_train"], toy["logp_train"])


def test_at_top_p_09_the_raw_ratio_gives_seq_is_less_bias_on_the_chapters_toy():
    """The mismatch chapter's sentence under its top-p table."""
    toy = make_toy()
    bias = {reported: estimator_moments(e, seq_is(e))["rel_bias"]
            for reported in ("processed", "raw")
            for e in [engine_toy(toy, top_p=0.9, reported=reported)]}
    assert bias["raw"] < bias["processed"] - 0.05


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_the_trainers_own_arrays_agree_with_the_toys_enumeration(make):
    """engine._trainer (used for the untempered and the masked trainers) against _enumerate."""
    toy = make()
    untempered = engine_toy(toy, trainer_temperature=False)  # tau = 1: the toy's own trainer
    for key in ("logp_train", "p_train", "score"):
        np.testing.assert_allclose(untempered[key], toy[key], rtol=0, atol=1e-15, err_msg=key)
    replayed = engine_toy(toy, trainer_mask=True)  # nothing cut: the mask is every token
    for key in ("logp_train", "p_train", "score"):
        np.testing.assert_allclose(replayed[key], toy[key], rtol=0, atol=1e-15, err_msg=key)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("mismatch", [0.0, 0.5])
def test_with_the_mask_replayed_seq_is_is_unbiased_for_the_truncated_policy(make, mismatch):
    engine = engine_toy(make(mismatch=mismatch), temperature=0.8, top_p=0.85, top_k=3,
                        trainer_mask=True)
    mean = estimator_moments(engine, seq_is(engine))["mean"]
    np.testing.assert_allclose(mean, engine["masked_grad"], rtol=0, atol=1e-13)
    if mismatch == 0.0:  # the trainer is the engine: every ratio is 1
        np.testing.assert_allclose(token_ratios(engine), 1.0, rtol=0, atol=1e-13)


def test_masked_grad_is_autograds_of_the_truncated_objective():
    """E_{pi_S}[R] with pi_S the tempered softmax over the kept tokens (kept sets fixed)."""
    toy = make_toy(T=3, V=4, mismatch=0.4, seed=9)
    tau, top_p = 0.9, 0.7
    kept = torch.as_tensor(np.isfinite(processed_log_probs(
        toy["theta"] + 0.4 * toy["b"], tau, top_p=top_p)))
    theta = torch.tensor(toy["theta"], requires_grad=True)
    log_pi = torch.log_softmax(torch.where(kept, theta / tau, -math.inf), dim=-1)
    Y = torch.as_tensor(toy["Y"])
    token = log_pi[torch.arange(3), Y]
    written = torch.isfinite(token).all(1)
    # -inf selected away on both branches: a cut sequence's gradient must be 0, not NaN
    p = torch.exp(torch.where(written[:, None], token, torch.zeros(())).sum(1))
    J = (torch.where(written, p, torch.zeros(())) * torch.as_tensor(toy["R"])).sum()
    J.backward()
    engine = engine_toy(toy, temperature=tau, top_p=top_p, trainer_mask=True)
    np.testing.assert_allclose(engine["masked_grad"], theta.grad.numpy(), rtol=0, atol=1e-14)


def test_a_cut_token_never_reaches_the_torch_corrections():
    """Its processed log-prob is -inf; a batch holding one as a sampled token is refused."""
    logits = np.log([[0.6, 0.3, 0.1]])
    log_mu = processed_log_probs(logits, top_p=0.8)
    assert log_mu[0, 2] == -math.inf
    engine = engine_toy(toy_from_logits(logits, logits), top_p=0.8)
    assert 2 not in engine["Y"]
    trainer = torch.tensor([[math.log(0.1)]], dtype=torch.float64)
    sampler = torch.tensor([[log_mu[0, 2]]], dtype=torch.float64)
    with pytest.raises(ValueError, match="sampler_logp must be finite where mask is 1"):
        correction.rollout_correction(trainer, sampler, torch.ones(1, 1), rollout_is="token")


@pytest.mark.parametrize("kwargs, message", [
    (dict(reported="sampled"), r"reported must be one of \('processed', 'raw'\)"),
    (dict(trainer_temperature="yes"), "trainer_temperature must be True or False"),
    (dict(trainer_mask=1), "trainer_mask must be True or False"),
    (dict(temperature=0), "temperature must be > 0"),
    (dict(top_p=2.0), "top_p must be <= 1.0"),
    (dict(top_k=-1), "top_k must be None"),
    (dict(temperature=1e-320), r"theta / temperature overflows float64"),
])
def test_bad_engine_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        engine_toy(make_toy(T=2, V=2), **kwargs)


def test_a_toy_without_its_logits_is_refused():
    toy = make_toy(T=2, V=2)
    del toy["b"]
    with pytest.raises(ValueError, match=r"missing the keys \['b'\]"):
        engine_toy(toy)


# ---------------------------------------------------------------------------------------------
# Properties (Hypothesis; the example count comes from the profile)
# ---------------------------------------------------------------------------------------------
@pytest.mark.properties
@given(V=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e300]),
       temperature=st.sampled_from([1e-3, 0.5, 1.0, 2.0, 1e3]),
       top_k=st.sampled_from([None, 1, 2, 5, 100]), top_p=st.sampled_from([1e-9, 0.3, 0.9, 1.0]),
       min_p=st.sampled_from([0.0, 0.1, 1.0]))
def test_processed_rows_are_distributions_that_keep_the_top_token(V, seed, scale, temperature,
                                                                   top_k, top_p, min_p):
    logits = np.random.default_rng(seed).normal(0, 1, (3, V)) * scale
    try:
        out = processed_log_probs(logits, temperature, top_k, top_p, min_p)
    except ValueError as error:  # only the overflow of logits / temperature is refused
        assert "overflows float64" in str(error)
        assert not np.isfinite(logits / temperature).all()
        return
    assert not np.isnan(out).any() and (out <= 0).all()
    kept = np.isfinite(out)
    assert kept[np.arange(3), np.argmax(logits, axis=-1)].all()
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, rtol=1e-12)
    if top_k is not None:  # never more than the top_k largest and their ties
        scaled = logits / temperature
        kth = np.sort(scaled, axis=-1)[:, -min(top_k, V)]
        assert not (kept & (scaled < kth[:, None])).any()


@pytest.mark.properties
@given(T=st.integers(1, 3), V=st.integers(2, 4), seed=st.integers(0, 2**32 - 1),
       ar=st.booleans(), temperature=st.sampled_from([0.4, 1.0, 1.7]),
       top_k=st.sampled_from([None, 1, 2]), top_p=st.sampled_from([0.5, 0.9, 1.0]),
       reported=st.sampled_from(["processed", "raw"]), trainer_temperature=st.booleans(),
       trainer_mask=st.booleans())
def test_every_engine_toy_is_a_toy_the_estimators_accept(T, V, seed, ar, temperature, top_k,
                                                          top_p, reported, trainer_temperature,
                                                          trainer_mask):
    g = np.random.default_rng(seed)
    shape = (T, V + 1, V) if ar else (T, V)
    train, sampler = g.normal(0, 1, shape), g.normal(0, 1, shape)
    toy = ar_toy_from_logits(train, sampler) if ar else toy_from_logits(train, sampler)
    engine = engine_toy(toy, temperature, top_k, top_p, reported, trainer_temperature,
                        trainer_mask)
    assert abs(engine["p_sampler"].sum() - 1) < 1e-12 and (engine["p_sampler"] > 0).all()
    assert np.isfinite(engine["logp_sampler"]).all()
    assert 0.0 <= engine["truncated_mass"] < 1.0
    if reported == "processed" and trainer_temperature:
        mean = estimator_moments(engine, seq_is(engine))["mean"]
        target = engine["masked_grad"] if trainer_mask else (engine["true_grad"]
                                                             - engine["truncated_grad"])
        np.testing.assert_allclose(mean, target, rtol=0, atol=1e-12)
    assert np.isfinite(engine["logp_train"]).all() and np.isfinite(engine["score"]).all()
    for row in comparison_table(engine, names=["naive", "token_tis", "seq_mis", "icepop"]):
        assert math.isfinite(row["bias"]) and math.isfinite(row["var"])


# ---------------------------------------------------------------------------------------------
# min-p
# ---------------------------------------------------------------------------------------------
def test_min_p_drops_the_tokens_below_a_fraction_of_the_top_probability():
    out = processed_log_probs(np.log([0.5, 0.3, 0.12, 0.08]), min_p=0.2)  # 0.2 * 0.5 = 0.1
    np.testing.assert_allclose(np.exp(out), np.array([0.5, 0.3, 0.12, 0]) / 0.92, rtol=1e-14)


def test_min_p_is_read_after_the_temperature_and_before_top_p():
    """vLLM's order: min-p on softmax(z / tau), then top-p on the survivors, renormalised."""
    g = np.random.default_rng(10)
    for _ in range(100):
        z = g.normal(0, 1.5, 6)
        tau, min_p, top_p = float(g.uniform(0.5, 1.5)), float(g.uniform(0, 0.5)), 0.8
        mu = np.exp(z / tau - np.max(z / tau))
        mu /= mu.sum()
        survivors = np.where(mu >= min_p * mu.max(), mu, 0.0)
        if np.min(np.abs(np.cumsum(np.sort(survivors / survivors.sum())[::-1]) - top_p)) < 1e-9:
            continue
        log_survivors = np.log(np.where(survivors > 0, survivors, 1e-300))  # ~0 mass
        expected = vllm_keep(log_survivors, 1.0, None, top_p) & (survivors > 0)
        got = np.isfinite(processed_log_probs(z, tau, top_p=top_p, min_p=min_p))
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("min_p, message", [(-0.1, "min_p must be >= 0.0"),
                                            (1.5, "min_p must be <= 1.0"),
                                            (math.nan, "min_p must be a finite number")])
def test_bad_min_p_is_named(min_p, message):
    with pytest.raises(ValueError, match=message):
        processed_log_probs(np.zeros(3), min_p=min_p)
