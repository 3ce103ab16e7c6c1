"""The engine's sampler (opd_literate.mismatch.engine): its processing, its toy, and what every
estimator does under it, proved by enumeration against independent computations."""

import inspect
import itertools
import json
import math
import pathlib
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch import correction, engine
from opd_literate.mismatch.engine import (
    BOUNDARY_PROBS,
    NUCLEUS_TOLERANCE,
    SAMPLERS,
    boundary_toy,
    engine_toy,
    nucleus_disagreement,
    processed_log_probs,
    top_p_kept,
)
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
from tests.helpers.committed import assert_matches_committed

F32 = np.float32


def vllm_keep(logits, temperature, top_k, top_p, dtype=torch.float64):
    """The kept tokens of one row, by vLLM's algorithm as its docs and source describe it
    (apply_top_k_top_p_pytorch, vllm/v1/sample/ops/topk_topp_sampler.py lines 524-565 at
    v0.33.0): sort ascending, mask below the k-th largest, softmax, mask where the ascending
    cumulative sum is <= 1 - p, never the last. Written independently of engine.py (torch, an
    ascending order, a cumulative sum from below); in ``dtype``, p a tensor of it."""
    z = torch.as_tensor(np.asarray(logits, dtype=float)).to(dtype) / torch.tensor(temperature,
                                                                                dtype=dtype)
    z_sort, idx = z.sort(descending=False)
    if top_k is not None and top_k < len(z):
        z_sort = z_sort.masked_fill(z_sort < z_sort[len(z) - top_k], -math.inf)
    if top_p < 1.0:
        cumulative = z_sort.softmax(-1).cumsum(-1)
        cut = cumulative <= 1 - torch.tensor(top_p, dtype=dtype)
        cut[-1] = False
        z_sort = z_sort.masked_fill(cut, -math.inf)
    kept = torch.empty(len(z), dtype=torch.bool)
    kept[idx] = torch.isfinite(z_sort)
    return kept.numpy()


def near_a_boundary(logits, temperature, top_k, top_p, margin):
    """Whether some prefix of the ranking carries within ``margin`` of top_p, or two kept
    tokens tie."""
    probs = np.exp(processed_log_probs(logits, temperature, top_k))
    ranked = np.sort(probs[probs > 0])[::-1]
    return top_p < 1 and (np.min(np.abs(np.cumsum(ranked) - top_p)) < margin
                          or len(set(ranked.tolist())) < len(ranked))


def exact_float32(x):
    """A float32 value as an exact fraction (hand derivations of the float32 rules)."""
    return Fraction(float(F32(x)))


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
        if near_a_boundary(logits, temperature, top_k, top_p, 1e-9):
            continue
        np.testing.assert_array_equal(ours, vllm_keep(logits, temperature, top_k, top_p))
        checked += 1
    assert checked > 350


def test_the_vllm_sampler_is_vllms_algorithm_in_float32_off_the_boundary():
    """sampler="vllm" against the torch float32 re-derivation above, on rows whose prefix
    masses are at least 1e-6 from p and without ties: there the last bit of torch's softmax
    (which this machine's kernels round as they do) cannot move the cut."""
    g = np.random.default_rng(11)
    checked = 0
    for _ in range(400):
        V = int(g.integers(1, 12))
        logits = g.normal(0, 2, V)
        temperature = float(g.choice([0.3, 0.7, 1.0, 1.6]))
        top_k = [None, 1, 2, 3, 5][int(g.integers(5))]
        top_p = float(g.choice([0.1, 0.5, 0.9, 0.95, 1.0]))
        if near_a_boundary(logits, temperature, top_k, top_p, 1e-6):
            continue
        ours = np.isfinite(processed_log_probs(logits, temperature, top_k, top_p,
                                               sampler="vllm"))
        np.testing.assert_array_equal(ours, vllm_keep(logits, temperature, top_k, top_p,
                                                      torch.float32))
        checked += 1
    assert checked > 300


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
    (dict(reported="sampled"), r"reported must be one of \('processed', 'raw', 'tempered'\)"),
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


# ---------------------------------------------------------------------------------------------
# Which nucleus: the frameworks' float32 rules (module docstring). vLLM and SGLang do not
# install on a CPU: their rules are checked here on cases derived by hand from their source,
# vLLM release 0.33.0 (its wheel) vllm/v1/sample/ops/topk_topp_sampler.py lines 545-562, and
# SGLang 0.5.23 python/sglang/srt/layers/sampler.py lines 821-835; transformers' is checked
# against its installed warpers in tests/integration/test_engine_frameworks.py.
# ---------------------------------------------------------------------------------------------
HEADLINE = [0.5, 0.3, 0.15, 0.05]


def test_the_float32_cuts_by_hand():
    """vLLM: 1 - p with p a float32 tensor; transformers: float32(1 - p), 1 - p in float64."""
    assert exact_float32(0.8) == Fraction(13421773, 2**24)  # 0.800000011920928955...
    assert Fraction(1) - exact_float32(0.8) == Fraction(3355443, 2**24)  # exact in float32
    assert F32(1) - F32(0.8) == F32(Fraction(3355443, 2**24))  # 0.19999998807907104
    assert F32(1 - 0.8) == F32(0.2) == F32(Fraction(13421773, 2**26))  # 0.20000000298023224


def test_the_headline_row_by_hand():
    """(0.5, 0.3, 0.15, 0.05) at top-p 0.8, each rule's arithmetic on the float32 values."""
    low = exact_float32(0.05) + exact_float32(0.15)  # the ascending cumulative sum's 2nd term
    assert exact_float32(float(low)) == Fraction(13421773, 2**26)  # stored as float32(0.2)
    vllm_cut, transformers_cut = Fraction(3355443, 2**24), exact_float32(0.2)
    assert exact_float32(float(low)) > vllm_cut          # vLLM keeps 0.15
    assert exact_float32(float(low)) <= transformers_cut  # transformers cuts it
    # SGLang: float32(0.5 + 0.3 + 0.15) is a tie between two float32 values, rounded to even
    top3 = exact_float32(0.5) + exact_float32(0.3) + exact_float32(0.15)
    up = Fraction(float(np.nextafter(F32(0.95), F32(1))))
    assert top3 == (exact_float32(0.95) + up) / 2 and exact_float32(float(top3)) == up
    above = up - exact_float32(0.15)                       # 0.80000004172..., a tie again
    assert exact_float32(float(above)) > exact_float32(0.8)  # SGLang cuts 0.15
    expected = {"exact": 2, "vllm": 3, "transformers": 2, "sglang": 2}
    for sampler, n in expected.items():
        assert top_p_kept(HEADLINE, 0.8, sampler).sum() == n, sampler
        kept = np.isfinite(processed_log_probs(np.log(HEADLINE), top_p=0.8, sampler=sampler))
        assert kept.tolist() == [True] * n + [False] * (4 - n), sampler


def test_ties_break_in_opposite_directions():
    """An ascending sort (vLLM, transformers) puts a tie's lower index first and cuts it."""
    uniform = [0.25] * 4  # every float32 sum here is exact
    assert top_p_kept(uniform, 0.5).tolist() == [True, True, False, False]
    assert top_p_kept(uniform, 0.5, "vllm").tolist() == [False, False, True, True]
    assert top_p_kept(uniform, 0.5, "transformers").tolist() == [False, False, True, True]
    # SGLang keeps a token whose mass above is p exactly: 0.5 > 0.5 is false
    assert top_p_kept(uniform, 0.5, "sglang").tolist() == [True, True, True, False]
    # Even the guard: two tied top tokens, vLLM keeps the last of its ascending order
    pair = np.log([0.5, 0.5])
    kept = {s: np.isfinite(processed_log_probs(pair, top_p=0.3, sampler=s)).tolist()
            for s in SAMPLERS}
    assert kept == {"exact": [True, False], "vllm": [False, True], "transformers": [False, True],
                    "sglang": [True, False]}


def test_sglang_cuts_top_k_by_rank_and_top_p_on_the_full_distribution():
    ties = np.array([1.0, 1.0, 0.0])
    for sampler in ("exact", "vllm", "transformers"):  # ties with the k-th largest stay
        assert np.isfinite(processed_log_probs(ties, top_k=1, sampler=sampler)).tolist() == [
            True, True, False]
    assert np.isfinite(processed_log_probs(ties, top_k=1, sampler="sglang")).tolist() == [
        True, False, False]
    # 0.4, 0.3, 0.2, 0.1 with top-k 2 and top-p 0.5: renormalised, the mass above 0.3 is
    # 0.4 / 0.7 = 0.571 >= 0.5 (cut); on the full distribution it is 0.4 <= 0.5 (kept)
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    for sampler, n in {"exact": 1, "vllm": 1, "transformers": 1, "sglang": 2}.items():
        kept = np.isfinite(processed_log_probs(logits, top_k=2, top_p=0.5, sampler=sampler))
        assert kept.sum() == n, sampler


def test_transformers_reads_min_p_after_top_p():
    """0.5, 0.3, 0.2 with min-p 0.5 (cut below 0.25) and top-p 0.6. vLLM: min-p first, then
    the mass above 0.3 among the survivors is 0.625 >= 0.6 (cut). transformers: top-p first,
    the mass above 0.3 is 0.5 < 0.6 (kept), then min-p keeps 0.3 >= 0.25."""
    logits = np.log([0.5, 0.3, 0.2])
    kept = {s: np.isfinite(processed_log_probs(logits, top_p=0.6, min_p=0.5, sampler=s)).tolist()
            for s in SAMPLERS}
    assert kept == {"exact": [True, False, False], "vllm": [True, False, False],
                    "transformers": [True, True, False], "sglang": [True, True, False]}


def test_sglangs_top_p_line_cuts_past_a_float32_sum_above_one():
    """At p = 1 the line still runs once any cut does (top_k_top_p_min_p_sampling_from_probs_
    torch): float32(0.5) + (float32(0.5) + 2 ulps) = 1 + 2**-23 exactly, above float32(1)."""
    probs = np.array([F32(0.5), F32(0.5) + F32(2**-23), F32(1e-9)], dtype=F32)
    order = np.arange(3)  # already descending
    kept = engine._cut_framework(engine._framework_sums(probs, order, "sglang"), 1.0, "sglang")
    assert kept.tolist() == [True, True, False]


def test_in_exact_arithmetic_vllm_and_transformers_keep_the_exact_set():
    """On integers: masking where the cumulative sum from below is <= n - j keeps what
    "above < j" keeps, whatever the ties (both rank them by a sort); SGLang's "above > j"
    keeps one token more exactly where the count above a token is j."""
    for counts in itertools.product(range(1, 8), repeat=3):
        n_total = sum(counts)
        ranked = sorted(counts, reverse=True)
        above = np.cumsum(ranked) - ranked
        below = np.cumsum(ranked[::-1])[::-1]  # the mass at or below each ranked token
        for j in range(1, n_total):
            exact = above < j
            from_below = ~(below <= n_total - j)
            from_below[0] = True
            sglang = ~(above > j)
            assert (from_below == exact).all()
            assert sglang.sum() == exact.sum() + (j in above.tolist())


NUCLEUS_RECORD = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "data" / "engine"
                  / "nucleus_disagreement.json")


def test_the_nucleus_figures_of_the_chapter():
    """The chapter's sentences over the two-decimal table, on the committed record that the
    table is drawn from (``--nucleus-disagreement``; the slow tier recomputes it): rows and
    boundary rows by hand (each distribution has three distinct prefix masses, its top 1, 2 and
    3 tokens, all in 1..99 hundredths); no rule keeps fewer tokens than the exact one, or another
    number off the boundary; vLLM and transformers break ties the other way, SGLang never."""
    record = json.loads(NUCLEUS_RECORD.read_text())
    # the record is of the defaults (the chapter's four tokens in hundredths), every sampler
    # (the signature, not __defaults__: a wrapper such as mutmut's keeps only the former)
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(nucleus_disagreement).parameters.items()}
    assert (defaults["V"], defaults["resolution"]) == (4, 100)
    assert record["arguments"] == {"V": 4, "resolution": 100}
    assert tuple(record["samplers"]) == SAMPLERS
    stats = record["samplers"]
    assert stats["exact"]["distributions"] == math.comb(99, 3) == 156_849
    assert stats["exact"]["rows"] == 156_849 * 99 and stats["exact"]["boundary"] == 3 * 156_849
    assert stats["exact"]["differ"] == 0
    for sampler in SAMPLERS:
        d = stats[sampler]
        assert (d["sampler"], d["V"], d["resolution"]) == (sampler, 4, 100)
        assert (d["rows"], d["boundary"]) == (stats["exact"]["rows"], stats["exact"]["boundary"])
        assert d["fraction"] == d["differ"] / d["rows"], sampler  # the record's own quotient
    for sampler in ("vllm", "transformers", "sglang"):
        d = stats[sampler]
        assert d["fewer"] == 0 and d["resized_off_boundary"] == 0, sampler
        assert d["differ"] == d["more"] + d["swapped"] and d["more"] > 0, sampler
        assert 0 < d["fraction"] < 0.05, sampler
    assert stats["vllm"]["swapped"] > 0 and stats["transformers"]["swapped"] > 0
    assert stats["sglang"]["swapped"] == 0 and stats["sglang"]["differ_off_boundary"] == 0
    # vLLM's worst row by hand: 0.01, 0.07, 0.46, 0.46 at top-p 0.46; the exact rule keeps the
    # first 0.46 (above the second lie 0.46, not less), vLLM both
    worst = stats["vllm"]["worst"]
    assert worst["probs"] == [0.01, 0.07, 0.46, 0.46] and worst["top_p"] == 0.46
    assert worst["exact"] == [False, False, True, False] and worst["kept"] == [False, False,
                                                                               True, True]
    assert stats["vllm"]["max_mass_difference"] == 0.46


def test_the_float32_probabilities_of_the_nucleus_count_are_the_same_on_every_cpu():
    """Why the record's counts are compared exactly with a recount on any machine.

    A framework sampler of ``nucleus_disagreement`` rounds float64 values to float32 twice: the
    99 logits ``log(k / 100)``, and each row's probabilities ``e_v / sum(e)``, ``e = exp(z -
    max z)`` of those float32 logits. Everything after is exact or IEEE 754 arithmetic on the
    same float32 numbers (the differences ``z - max z`` are exact in float64, the partial sums
    of four float32 probabilities above 0.01 too, then comparisons), and the exact nucleus is
    counted on integers; the ``"exact"`` sampler decides with a margin of 1e-12 against float64
    errors near 1e-16, off the boundary 0.01 away. Only ``log`` and ``exp`` are the CPU's (numpy
    picks its AVX-512 kernels or libm, each accurate to a few ulps). Here every ``log`` and every
    ``exp`` is moved by 100 ulps in the direction that moves each rounded value most, both
    ways: every value rounds to the same float32 still, so the probabilities, and every count,
    are the same on any CPU whose exp and log are within 100 ulps of this one's (the page's
    footnote under the table says so)."""
    delta = 100 * 2.0**-52

    def same_float32(low, value, high):
        return ((low.astype(F32) == value.astype(F32)) & (high.astype(F32)
                                                          == value.astype(F32))).all()

    counts = engine._compositions(4, 100)
    assert counts.shape == (math.comb(99, 3), 4) and (counts > 0).all()
    assert (counts.sum(axis=1) == 100).all()
    assert (np.diff(counts @ 100 ** np.arange(3, -1, -1)) > 0).all()  # increasing: distinct
    logs = np.log(np.arange(1, 100) / 100)  # negative: (1 + delta) moves them down
    assert same_float32(logs * (1 + delta), logs, logs * (1 - delta))
    logits = np.log(counts / 100)
    z = logits.astype(F32).astype(float)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    rest = e.sum(axis=1, keepdims=True) - e  # the other three exponentials of each row
    x = e / (e + rest)
    low = e * (1 - delta) / (e * (1 - delta) + rest * (1 + delta))
    high = e * (1 + delta) / (e * (1 + delta) + rest * (1 - delta))
    assert same_float32(low, x, high)
    # x is the quotient the samplers round: their float32 probabilities, bit for bit
    s = engine._scaled_float32(logits, 1.0, "logits", "vllm")
    np.testing.assert_array_equal(engine._softmax_float32(s, np.ones(s.shape, dtype=bool)),
                                  (e / e.sum(axis=1, keepdims=True)).astype(F32))
    np.testing.assert_array_equal(x.astype(F32), (e / e.sum(axis=1, keepdims=True)).astype(F32))


@pytest.mark.slow
def test_the_committed_nucleus_record_is_the_count_recomputed_here(tmp_path):
    """The documented command, run here (10 to 15 s on 2 cores), writes the committed record."""
    from opd_literate.experiment import cli

    assert cli.main(["--nucleus-disagreement", "--out", str(tmp_path)]) == 0
    computed = json.loads((tmp_path / "nucleus_disagreement.json").read_text())
    # The counts are integers, compared exactly by the helper; they are the same on every CPU
    # (test_the_float32_probabilities_of_the_nucleus_count_are_the_same_on_every_cpu).
    assert_matches_committed(
        computed, json.loads(NUCLEUS_RECORD.read_text()), rtol=0.0, atol=0.0,
        why="every float of the record is a quotient of two integers (differ / rows, a kept mass "
            "in 1/resolution, a probability k / resolution, a top-p j / resolution), which IEEE "
            "754 rounds alike on every CPU", where="nucleus_disagreement.json")


@pytest.mark.parametrize("options, message", [
    (["--quick"], "--quick is not supported"),
    (["--seed", "0", "--steps", "3"], "--seed and --steps are not supported"),
    (["--methods", "rl"], "--methods is not supported"),
    (["--clamp-study"], "--clamp-study and --nucleus-disagreement write different files"),
])
def test_the_nucleus_command_refuses_the_trainings_options(options, message, tmp_path, capsys):
    """The count has fixed arguments and no seed: an option of the training is refused in one
    line (exit code 2) before any work, not silently ignored."""
    from opd_literate.experiment import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["--nucleus-disagreement", "--out", str(tmp_path), *options])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "nucleus_disagreement.json").exists()


def _nucleus_count(sampler, V, resolution):
    """``nucleus_disagreement``'s dict counted again, without its vectorised loop: the rows by
    itertools (in lexicographic order, as its), each top-p one call of processed_log_probs on
    every row, the exact nucleus from the integers by Python's stable sort; the worst row the
    first of the largest mass difference, in the order of top-p then of the rows."""
    rows = np.array([c for c in itertools.product(range(1, resolution), repeat=V)
                     if sum(c) == resolution])
    ranks = [sorted(range(V), key=lambda v: -c[v]) for c in rows.tolist()]  # ties by index
    above = np.array([[sum(c[u] for u in rank[:i]) for i in range(V)]
                      for c, rank in zip(rows.tolist(), ranks)])  # in rank order
    stats = dict(rows=0, boundary=0, differ=0, more=0, fewer=0, swapped=0,
                 differ_off_boundary=0, resized_off_boundary=0)
    worst_mass, worst = -1, None
    for j in range(1, resolution):
        kept = np.isfinite(processed_log_probs(np.log(rows / resolution), top_p=j / resolution,
                                               sampler=sampler))
        exact = np.zeros_like(kept)
        for i, rank in enumerate(ranks):
            exact[i, [v for v, a in zip(rank, above[i]) if a < j]] = True
        n, n_exact = kept.sum(axis=1), exact.sum(axis=1)
        differ = (kept != exact).any(axis=1)
        off = ~(above == j).any(axis=1)
        stats["rows"] += len(rows)
        stats["boundary"] += int((~off).sum())
        stats["differ"] += int(differ.sum())
        stats["more"] += int((n > n_exact).sum())
        stats["fewer"] += int((n < n_exact).sum())
        stats["swapped"] += int((differ & (n == n_exact)).sum())
        stats["differ_off_boundary"] += int((differ & off).sum())
        stats["resized_off_boundary"] += int((off & (n != n_exact)).sum())
        mass = np.abs((rows * kept).sum(axis=1) - (rows * exact).sum(axis=1))
        if mass.max() > worst_mass:
            i = int(np.argmax(mass))
            worst_mass = int(mass[i])
            worst = dict(probs=(rows[i] / resolution).tolist(), top_p=j / resolution,
                         kept=kept[i].tolist(), exact=exact[i].tolist())
    return dict(stats, sampler=sampler, V=V, resolution=resolution, distributions=len(rows),
                fraction=stats["differ"] / stats["rows"],
                max_mass_difference=worst_mass / resolution, worst=worst)


@pytest.mark.parametrize("V, resolution", [(3, 12), (4, 20)])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_nucleus_disagreement_against_a_direct_count(sampler, V, resolution):
    """Every field of the enumeration, recounted through processed_log_probs (the kept sets of
    each top-p) and the integers (the exact nucleus): small cases where every framework keeps
    more tokens and vLLM and transformers swap a tie, so that each count is exercised."""
    d = nucleus_disagreement(sampler, V, resolution)
    assert d == _nucleus_count(sampler, V, resolution)
    if sampler != "exact":
        assert d["more"] > 0 and (d["swapped"] > 0) == (sampler != "sglang")


def test_the_four_rules_keep_the_same_tokens_on_the_chapters_toy():
    """The chapter: its toy's logits are random, so no row sits on a boundary or a tie."""
    toy = make_toy()
    raw = toy["theta"] + toy["mismatch"] * toy["b"]
    for top_p in np.round(np.linspace(0.8, 1.0, 11), 2):  # the figure's grid
        kept = [np.isfinite(processed_log_probs(raw, top_p=top_p, sampler=s)) for s in SAMPLERS]
        for other in kept[1:]:
            np.testing.assert_array_equal(other, kept[0])


def test_on_the_boundary_toy_the_four_rules_are_four_engines():
    """The chapter's sentence under its sampler table: four kept sets; vLLM cuts the least
    mass yet has more bias than the exact rule (it cuts token 0, which the reward counts, at
    the third position)."""
    toy = boundary_toy()
    engines = {s: engine_toy(toy, top_p=0.8, sampler=s) for s in SAMPLERS}
    written = {s: frozenset(map(tuple, e["Y"].tolist())) for s, e in engines.items()}
    assert len(set(written.values())) == 4
    bias = {s: estimator_moments(e, seq_is(e))["rel_bias"] for s, e in engines.items()}
    assert len({round(b, 6) for b in bias.values()}) == 3
    # vLLM and transformers tie: with token 0 cut at the third position a sequence needs it at
    # both others to earn R = 1, so vLLM's extra tokens (2 first, 3 second) carry no reward
    assert math.isclose(bias["vllm"], bias["transformers"], rel_tol=1e-12)
    mass = {s: e["truncated_mass"] for s, e in engines.items()}
    assert min(mass, key=mass.get) == "vllm" and bias["vllm"] > bias["exact"]
    assert 0 not in engines["vllm"]["Y"][:, 2] and 0 in engines["exact"]["Y"][:, 2]
    for e in engines.values():  # epsilon = 0: seq_is misses exactly what the cut carries
        np.testing.assert_allclose(estimator_moments(e, seq_is(e))["mean"],
                                   e["true_grad"] - e["truncated_grad"], rtol=0, atol=1e-13)
    assert BOUNDARY_PROBS[2][0] == BOUNDARY_PROBS[2][2]  # the tie across the cut


def test_the_chapters_which_nucleus_sentences_are_the_ones_tested_here():
    """docs/mismatch_practice.md, "Which nucleus": its sentences with a number or a direction, each
    checked by a test above (named in the comment)."""
    import pathlib

    page = " ".join((pathlib.Path(__file__).resolve().parents[2] / "docs/mismatch_practice.md")
                    .read_text().split())
    for sentence in (
        # test_the_headline_row_by_hand
        "On $(0.5, 0.3, 0.15, 0.05)$ at top-$p$ 0.8, vLLM keeps three tokens and the others two.",
        # test_in_exact_arithmetic_vllm_and_transformers_keep_the_exact_set
        "In exact arithmetic vLLM's and transformers' rules keep the exact set, and SGLang's one "
        "token more where the mass above it equals $p$.",
        # test_ties_break_in_opposite_directions
        "the ascending sorts cut a tie's lower index first, the exact rule and SGLang keep it.",
        # test_the_nucleus_figures_of_the_chapter
        "Over every distribution of four tokens in hundredths, at every top-$p$ in hundredths, no "
        "framework keeps fewer tokens than the exact rule, and off the boundary none keeps "
        "another number of them",
        # test_the_four_rules_keep_the_same_tokens_on_the_chapters_toy
        "the four rules keep the same tokens at every position for every top-$p$ of the figure",
        # test_on_the_boundary_toy_the_four_rules_are_four_engines
        "three positions of exact decimals, trainer and sampler equal, top-$p$ 0.8), the four "
        "rules are four engines.",
        "vLLM cuts the least mass there and still has more bias than the exact rule: its tie "
        "break at the third position cuts token 0, the one the reward counts.",
    ):
        assert sentence in page, sentence


def test_torch_sort_orders_ties_by_index_on_a_cpu_up_to_16_entries():
    """The module docstring's remark on torch.sort (torch 2.13, CPU): stable=False sorts a
    row of up to 16 entries as a stable sort does, and a longer row not always."""
    g = torch.Generator().manual_seed(0)
    for n in range(1, 17):
        x = torch.randint(0, 3, (200, n), generator=g).float()
        for descending in (False, True):
            assert torch.equal(x.sort(dim=-1, descending=descending)[1],
                               x.sort(dim=-1, descending=descending, stable=True)[1])
    x = torch.zeros(17)
    assert not torch.equal(x.sort()[1], torch.arange(17))


def test_the_exact_rule_counts_a_mass_within_the_tolerance_as_reaching_p():
    probs = np.array([0.5, 0.3, 0.2])
    assert top_p_kept(probs, 0.8 + NUCLEUS_TOLERANCE / 2).tolist() == [True, True, False]
    assert top_p_kept(probs, 0.8 + 2 * NUCLEUS_TOLERANCE).tolist() == [True, True, True]
    assert top_p_kept(probs, 1e-15).tolist() == [True, False, False]  # the guard


# ---------------------------------------------------------------------------------------------
# Refusals of the samplers' functions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(sampler="VLLM"), ValueError, r"sampler must be one of \('exact', 'vllm'"),
    (dict(sampler=None), TypeError, "sampler must be one of .* got NoneType None"),
    (dict(sampler="transformers", temperature=1e-46), ValueError,
     "temperature=1e-46 is outside float32's positive range"),
    (dict(sampler="vllm", temperature=1e-46), ValueError, "where vLLM samples greedily"),
    (dict(sampler="sglang", temperature=1e39), ValueError, "outside float32's positive range"),
])
def test_bad_samplers_and_float32_temperatures_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        processed_log_probs(np.array([1.0, 0.0]), **kwargs)


def test_logits_beyond_float32_are_refused_for_a_float32_sampler():
    with pytest.raises(ValueError, match=r"logits must be within float32's range for "
                                         r"sampler='transformers'.*1e\+39"):
        processed_log_probs(np.array([1e39, 0.0]), sampler="transformers")
    with pytest.raises(ValueError, match="logits / temperature overflows float32"):
        processed_log_probs(np.array([3e38, 0.0]), temperature=0.5, sampler="vllm")
    assert np.isfinite(processed_log_probs(np.array([1e39, 0.0]))).all()  # float64: fine


@pytest.mark.parametrize("probs, error, message", [
    (np.array([True, False]), TypeError, "probs must hold real numbers, got dtype bool"),
    (np.array(0.5), ValueError, r"probs must have shape \(..., V\) with V >= 1, got \(\)"),
    (np.zeros((2, 0)), ValueError, r"got \(2, 0\)"),
    (np.array([0.5, np.nan]), ValueError, "probs must be finite, got nan at index 1"),
    (np.array([1.5, -0.5]), ValueError, r"probs must lie in \[0, 1\], got 1.5"),
    (np.array([0.5, 0.4]), ValueError, "each row of probs must sum to 1 .*got a row summing to"),
    ([[0.5, 0.5], [0.5]], ValueError, "probs must be a rectangular array"),
])
def test_bad_probabilities_are_named(probs, error, message):
    with pytest.raises(error, match=message):
        top_p_kept(probs, 0.5)


@pytest.mark.parametrize("top_p, sampler, error, message", [
    (0.0, "exact", ValueError, "top_p must be > 0"),
    (1.5, "vllm", ValueError, "top_p must be <= 1.0"),
    (math.nan, "sglang", ValueError, "top_p must be a finite number"),
    (True, "exact", TypeError, "top_p must be a real number"),
    (0.5, "flashinfer", ValueError, "sampler must be one of"),
])
def test_bad_top_p_arguments_are_named(top_p, sampler, error, message):
    with pytest.raises(error, match=message):
        top_p_kept([0.5, 0.5], top_p, sampler)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(sampler="tgi"), ValueError, "sampler must be one of"),
    (dict(sampler="vllm", V=1), ValueError, r"V must be in \[2, 8\], got 1"),
    (dict(sampler="vllm", V=2.0), TypeError, "V must be an integer, got 2.0"),
    (dict(sampler="vllm", V=True), TypeError, "V must be an integer, got True"),
    (dict(sampler="vllm", V=4, resolution=3), ValueError, r"resolution must be in \[4, 1000\]"),
    (dict(sampler="vllm", V=8, resolution=100), ValueError,
     "V=8, resolution=100 has 14,887,031,544 distributions, more than the 2,000,000"),
])
def test_bad_enumerations_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        nucleus_disagreement(**kwargs)


def test_a_bad_sampler_is_refused_by_engine_toy():
    with pytest.raises(ValueError, match="sampler must be one of"):
        engine_toy(make_toy(T=2, V=2), sampler="hf")


# ---------------------------------------------------------------------------------------------
# Properties of the samplers
# ---------------------------------------------------------------------------------------------
@pytest.mark.properties
@given(V=st.integers(1, 10), seed=st.integers(0, 2**32 - 1), sampler=st.sampled_from(SAMPLERS),
       scale=st.sampled_from([1e-3, 1.0, 5.0, 30.0]),
       temperature=st.sampled_from([0.25, 1.0, 2.0]), top_k=st.sampled_from([None, 1, 3]),
       top_p=st.sampled_from([1e-9, 0.3, 0.8, 0.95, 1.0]), min_p=st.sampled_from([0.0, 0.1]),
       ties=st.booleans())
def test_every_sampler_keeps_a_top_token_and_a_distribution(V, seed, sampler, scale, temperature,
                                                            top_k, top_p, min_p, ties):
    logits = np.random.default_rng(seed).normal(0, 1, (3, V)) * scale
    if ties:
        logits = np.round(logits)
    out = processed_log_probs(logits, temperature, top_k, top_p, min_p, sampler)
    assert not np.isnan(out).any() and (out <= 0).all()
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, rtol=1e-12)
    kept = np.isfinite(out)
    scaled = logits.astype(F32) / F32(temperature) if sampler != "exact" else logits / temperature
    top = scaled == scaled.max(axis=-1, keepdims=True)
    assert (kept & top).any(axis=-1).all()  # a most likely token always stays
    # What stays is a prefix of the ranking: no kept token is less likely than a cut one
    low_kept = np.where(kept, scaled, np.inf).min(axis=-1)
    high_cut = np.where(kept, -np.inf, scaled).max(axis=-1)
    assert (low_kept >= high_cut).all()


@pytest.mark.properties
@given(V=st.integers(2, 12), seed=st.integers(0, 2**32 - 1), sampler=st.sampled_from(SAMPLERS),
       top_p=st.floats(0.01, 0.99))
def test_off_the_boundary_every_sampler_keeps_the_exact_nucleus(V, seed, sampler, top_p):
    """Continuous logits (no ties): the rules differ only within float32 rounding of p."""
    logits = np.random.default_rng(seed).normal(0, 2, V)
    probs = np.exp(processed_log_probs(logits))
    prefix = np.cumsum(np.sort(probs)[::-1])
    if np.min(np.abs(prefix - top_p)) < 1e-5:
        return
    np.testing.assert_array_equal(
        np.isfinite(processed_log_probs(logits, top_p=top_p, sampler=sampler)),
        top_p_kept(probs, top_p))


@pytest.mark.properties
@given(V=st.integers(1, 8), seed=st.integers(0, 2**32 - 1), sampler=st.sampled_from(SAMPLERS),
       p=st.floats(1e-6, 1.0), q=st.floats(1e-6, 1.0), decimals=st.booleans())
def test_top_p_kept_grows_with_p(V, seed, sampler, p, q, decimals):
    g = np.random.default_rng(seed)
    if decimals:  # exact decimals: the boundaries and ties of the chapter's table
        counts = g.multinomial(20 - V, np.ones(V) / V) + 1
        probs = counts / 20
    else:
        probs = g.dirichlet(np.ones(V))
    low, high = sorted((p, q))
    small, large = top_p_kept(probs, low, sampler), top_p_kept(probs, high, sampler)
    assert not (small & ~large).any() and small.any()


@pytest.mark.properties
@given(V=st.integers(2, 5), resolution=st.integers(5, 24), sampler=st.sampled_from(SAMPLERS))
def test_no_sampler_keeps_fewer_tokens_than_the_exact_nucleus(V, resolution, sampler):
    if resolution < V:
        return
    d = nucleus_disagreement(sampler, V, resolution)
    assert d["fewer"] == 0 and d["resized_off_boundary"] == 0
    assert d["differ"] == d["more"] + d["swapped"]
    assert d["rows"] == math.comb(resolution - 1, V - 1) * (resolution - 1)
    if sampler == "exact":
        assert d["differ"] == 0
    if sampler == "sglang":
        assert d["swapped"] == 0


# ---------------------------------------------------------------------------------------------
# engine_toy's and processed_log_probs' refusals: nothing broadcast, NaN named first
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, error, message", [
    (dict(b=np.zeros((1, 4))), ValueError,
     r"toy\['b'\] must have the shape of toy\['theta'\] \(3, 4\), got \(1, 4\)"),
    (dict(b=0.0), ValueError,
     r"toy\['b'\] must have the shape of toy\['theta'\] \(3, 4\), got \(\)"),
    (dict(theta=np.full((3, 4), np.nan)), ValueError,
     r"toy\['theta'\] must be finite, got nan at index \(0, 0\)"),
    (dict(b=np.where(np.eye(3, 4) > 0, np.inf, 0.0)), ValueError,
     r"toy\['b'\] must be finite, got inf at index \(0, 0\)"),
    (dict(mismatch=math.nan), ValueError, r"toy\['mismatch'\] must be a finite number, got nan"),
    (dict(mismatch=True), TypeError, r"toy\['mismatch'\] must be a real number, got bool"),
    (dict(mismatch="1"), TypeError, r"toy\['mismatch'\] must be a real number"),
    (dict(theta=np.ones((3, 4), dtype=bool)), TypeError,
     r"toy\['theta'\] must hold real numbers, got dtype bool"),
    (dict(theta=np.zeros((2, 4))), ValueError,
     r"toy\['theta'\] must have shape \(T, V\) = \(3, 4\) \(toy\['T'\] = 3, toy\['V'\] = 4\), "
     r"got \(2, 4\)"),
    (dict(b=np.full((3, 4), 1e308), mismatch=10.0), ValueError,
     r"toy\['theta'\] \+ toy\['mismatch'\] \* toy\['b'\] overflow float64"),
])
def test_engine_toy_refuses_a_bad_toy_by_name(change, error, message):
    with pytest.raises(error, match=message):
        engine_toy(dict(boundary_toy(), **change))


def test_engine_toy_refuses_a_bad_autoregressive_toy_by_name():
    toy = make_ar_toy(T=2, V=2)
    with pytest.raises(ValueError, match=r"toy\['b'\] must have the shape of toy\['theta'\] "
                                         r"\(2, 3, 2\), got \(3, 2\)"):
        engine_toy(dict(toy, b=toy["b"][0]))
    with pytest.raises(ValueError, match=r"must have shape \(T, V \+ 1, V\) = \(2, 3, 2\)"):
        engine_toy(dict(toy, theta=toy["theta"][:, :2], b=toy["b"][:, :2]))


@pytest.mark.parametrize("reported", [["raw"], np.array(["raw"]), None])
def test_engine_toy_refuses_a_reported_that_is_not_a_string(reported):
    with pytest.raises(TypeError,
                       match=r"reported must be one of \('processed', 'raw', 'tempered'\), got"):
        engine_toy(boundary_toy(), reported=reported)


def test_numpy_numbers_are_accepted_and_numpy_bools_refused():
    toy = boundary_toy()
    base = engine_toy(toy, top_k=2, top_p=0.9, temperature=0.5)
    same = engine_toy(dict(toy, mismatch=np.float64(1.0), T=np.int64(3), V=np.int64(4)),
                      top_k=np.int64(2), top_p=np.float64(0.9), temperature=np.float32(0.5),
                      reported=np.str_("processed"))
    for key in ("Y", "logp_sampler", "p_sampler", "true_grad"):
        np.testing.assert_array_equal(same[key], base[key])
    # integer logits are real numbers: the same as their floats
    np.testing.assert_array_equal(processed_log_probs(np.array([2, 0, 1]), top_k=np.int32(2)),
                                  processed_log_probs([2.0, 0.0, 1.0], top_k=2))
    with pytest.raises(TypeError, match="top_k must be None or an integer >= 1, got np.True_"):
        processed_log_probs([2.0, 0.0, 1.0], top_k=np.bool_(True))
    with pytest.raises(TypeError, match="top_p must be a real number, got bool"):
        engine_toy(toy, top_p=np.bool_(True))


@pytest.mark.parametrize("logits, error, message", [
    ([[0.0, 1.0], [0.0]], ValueError, "logits must be a rectangular array of real numbers"),
    (np.array([1 + 2j, 0.0]), TypeError, "logits must hold real numbers, got dtype complex128"),
    ([0.0, None], TypeError, "logits must hold real numbers, got dtype object"),
    (np.array([[0.0, 1.0], [np.nan, 0.0]]), ValueError,
     r"logits must be finite, got nan at index \(1, 0\)"),
])
def test_bad_logits_are_refused_by_name_before_any_arithmetic(logits, error, message):
    with pytest.raises(error, match=message):
        processed_log_probs(logits, top_p=0.5, sampler="vllm")


# ---------------------------------------------------------------------------------------------
# engine_toy: what it records, and the masked trainer without the temperature
# ---------------------------------------------------------------------------------------------
def test_engine_toy_records_its_documented_defaults():
    engine = engine_toy(boundary_toy())
    assert {key: engine[key] for key in ("temperature", "top_k", "top_p", "min_p", "sampler",
                                          "reported", "trainer_temperature", "trainer_mask")} == {
        "temperature": 1.0, "top_k": None, "top_p": 1.0, "min_p": 0.0, "sampler": "exact",
        "reported": "processed", "trainer_temperature": True, "trainer_mask": False}
    assert type(engine["trainer_temperature"]) is bool and type(engine["trainer_mask"]) is bool
    recorded = engine_toy(boundary_toy(), temperature=0.5, top_k=np.int64(3), top_p=0.9,
                          min_p=0.05, sampler="sglang", reported="raw",
                          trainer_temperature=np.bool_(False), trainer_mask=np.bool_(True))
    assert (recorded["temperature"], recorded["top_k"], recorded["top_p"], recorded["min_p"],
            recorded["sampler"], recorded["reported"]) == (0.5, 3, 0.9, 0.05, "sglang", "raw")
    assert recorded["trainer_temperature"] is False and recorded["trainer_mask"] is True


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_a_masked_trainer_without_the_temperature_is_the_untempered_softmax_over_the_kept(make):
    """trainer_mask=True, trainer_temperature=False: log pi(y_t) is the log-softmax of the raw
    theta_t over the engine's kept tokens S_t (the temperature is the engine's only), and the
    score its gradient, by torch autograd on each written sequence."""
    toy = make(T=2, V=3, mismatch=0.4, seed=12)
    tau, top_p = 0.6, 0.75
    engine = engine_toy(toy, temperature=tau, top_p=top_p, trainer_mask=True,
                        trainer_temperature=False)
    kept = np.isfinite(processed_log_probs(toy["theta"] + 0.4 * toy["b"], tau, top_p=top_p))
    assert not kept.all()  # something is cut, or the mask would change nothing
    for m, y in enumerate(engine["Y"].tolist()):
        theta = torch.tensor(toy["theta"], requires_grad=True)
        log_pi = torch.log_softmax(torch.where(torch.as_tensor(kept), theta, -math.inf), -1)
        if "mask" in toy:
            prev, real = engine["prev"][m].tolist(), engine["mask"][m] > 0
            tokens = [log_pi[t, prev[t], y[t]] if real[t] else torch.zeros((), dtype=theta.dtype)
                      for t in range(len(y))]
        else:
            tokens = [log_pi[t, y[t]] for t in range(len(y))]
        torch.stack(tokens).sum().backward()
        logp = torch.stack(tokens).detach().numpy()
        np.testing.assert_allclose(engine["logp_train"][m], logp, rtol=0, atol=1e-14)
        np.testing.assert_allclose(engine["score"][m], theta.grad.numpy(), rtol=0, atol=1e-14)
        assert math.isclose(engine["p_train"][m], math.exp(logp.sum()), rel_tol=1e-13)


@pytest.mark.parametrize("sampler", engine.SAMPLERS)
@pytest.mark.parametrize("cuts", [{}, {"top_p": 0.5}, {"top_k": 2, "min_p": 0.1}])
def test_a_batch_of_no_rows_gives_no_rows_under_every_sampler(sampler, cuts):
    out = processed_log_probs(np.zeros((0, 4)), sampler=sampler, **cuts)
    assert out.shape == (0, 4) and out.dtype == np.float64


def test_below_vllms_greedy_temperature_the_vllm_sampler_is_refused():
    """vLLM takes the argmax below _SAMPLING_EPS = 1e-5 instead of dividing by the temperature
    (vllm/v1/sample/sampler.py): a model that divided would describe another sampler."""
    logits = np.array([[1.0, 0.5, 0.0]])
    message = (r"^temperature=9e-06 is below 1e-05, where vLLM samples greedily \(_SAMPLING_EPS, "
               r"vllm/v1/sample/sampler.py\); for its greedy sampler give top_k=1 at "
               r"temperature=1.0$")
    with pytest.raises(ValueError, match=message):
        processed_log_probs(logits, temperature=9e-6, sampler="vllm")
    with pytest.raises(ValueError, match=message):
        engine_toy(make_toy(T=1, V=3), temperature=9e-6, sampler="vllm")
    # at the threshold vLLM divides, and so does the model; the other samplers divide anyway
    assert np.isfinite(processed_log_probs(logits, temperature=1e-5, sampler="vllm")).any()
    assert np.isfinite(processed_log_probs(logits, temperature=9e-6, sampler="sglang")).any()
    greedy = processed_log_probs(logits, top_k=1, sampler="vllm")
    assert greedy.tolist() == [[0.0, -math.inf, -math.inf]]
