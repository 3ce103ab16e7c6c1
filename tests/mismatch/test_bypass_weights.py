"""``sapo_weights``, ``gspo_weights`` and ``clip_cov_weights``: the policy losses SAPO, GSPO and
Clip-Cov as REINFORCE weights. REINFORCE with the weights detached must have the loss's own
autograd gradient, token by token, on batches with zero advantages, clamped log-ratios, clipped
tokens and padding."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_literate.mismatch.correction import (
    clip_cov_loss,
    clip_cov_weights,
    gspo_loss,
    gspo_weights,
    reinforce_loss,
    sapo_loss,
    sapo_weights,
)

PAIRS = [(sapo_loss, sapo_weights, {}),
         (sapo_loss, sapo_weights, {"tau_pos": 0.3, "tau_neg": 2.0}),
         (gspo_loss, gspo_weights, {}),
         # a wide band, so that both sides of the clip occur
         (gspo_loss, gspo_weights, {"clip_ratio_low": 0.3, "clip_ratio_high": 0.5}),
         (clip_cov_loss, clip_cov_weights, {}),
         # a band that makes most tokens eligible, so that q < 1 is exercised
         (clip_cov_loss, clip_cov_weights, {"clip_cov_lb": -5.0, "clip_cov_ub": 5.0,
                                            "clip_cov_ratio": 0.2}),
         (clip_cov_loss, clip_cov_weights, {"clip_ratio_low": 0.5, "clip_ratio_high": 3.0,
                                            "clip_cov_lb": 0.0})]
IDS = ["sapo", "sapo taus", "gspo", "gspo wide", "clip_cov", "clip_cov wide band",
       "clip_cov asymmetric"]


def _batch(seed, B=6, T=5, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    trainer = torch.log_softmax(torch.randn(B, T, 4, generator=g, dtype=torch.float64), -1)[..., 0]
    sampler = trainer + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T)
    if B >= 4:
        advantages[0] = 0.0  # a response whose group had one reward: A = 0 everywhere
        advantages[1, :2] = 0.0
        mask[2, 3:] = 0.0
        mask[-1, 1:] = 0.0
    return trainer, sampler, advantages, mask


def _gradients(loss_fn, weights_fn, options, trainer, sampler, advantages, mask, reduction):
    leaf = trainer.clone().requires_grad_(True)
    loss, _ = loss_fn(leaf, sampler, advantages, mask, reduction=reduction, **options)
    (framework,) = torch.autograd.grad(loss, leaf)
    weights = weights_fn(trainer, sampler, advantages, mask, **options)
    leaf = trainer.clone().requires_grad_(True)
    ours = reinforce_loss(leaf, advantages, mask, weights, reduction=reduction)
    (weighted,) = torch.autograd.grad(ours, leaf)
    return framework, weighted, weights


@pytest.mark.parametrize("reduction", ["token-mean", "sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("loss_fn, weights_fn, options", PAIRS, ids=IDS)
def test_reinforce_with_the_weights_has_the_loss_gradient(loss_fn, weights_fn, options, seed,
                                                          reduction):
    batch = _batch(seed)
    framework, weighted, _ = _gradients(loss_fn, weights_fn, options, *batch, reduction)
    torch.testing.assert_close(weighted, framework, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_fn, weights_fn, options", PAIRS, ids=IDS)
def test_a_clamped_log_ratio_has_weight_zero(loss_fn, weights_fn, options):
    trainer, sampler, advantages, mask = _batch(0)
    sampler = sampler.clone()
    # log rho = +-25 on every token of two responses: beyond the clamp of 20, token by token
    # and for the geometric mean
    sampler[3] = trainer[3] - 25.0
    sampler[4] = trainer[4] + 25.0
    framework, weighted, weights = _gradients(loss_fn, weights_fn, options, trainer, sampler,
                                              advantages, mask, "sum")
    assert bool((weights[3:5] == 0).all())
    torch.testing.assert_close(weighted, framework, rtol=1e-12, atol=1e-15)


def test_clip_cov_weights_zero_exactly_the_clipped_tokens():
    trainer, sampler, advantages, mask = _batch(1, spread=0.5)
    weights = clip_cov_weights(trainer, sampler, advantages, mask, clip_cov_lb=1e9,
                               clip_cov_ub=2e9)  # nothing eligible: PPO's clip alone
    ratio = torch.exp(trainer - sampler)
    clipped = ((advantages > 0) & (ratio > 1.2)) | ((advantages < 0) & (ratio < 0.8))
    expected = torch.where(mask.bool() & ~clipped, ratio, torch.zeros_like(ratio))
    torch.testing.assert_close(weights, expected, rtol=1e-14, atol=0.0)


def test_sapo_weight_is_one_on_policy_and_below_the_ratio_off_it():
    trainer, _, advantages, mask = _batch(2)
    on = sapo_weights(trainer, trainer, advantages, mask)
    torch.testing.assert_close(on, mask.double(), rtol=0.0, atol=1e-15)
    sampler = trainer - 1.0  # rho = e: the gate's slope sech^2 < 1
    off = sapo_weights(trainer, sampler, advantages, mask)
    assert bool((off[mask.bool()] < torch.e).all()) and bool((off[mask.bool()] > 0).all())


@pytest.mark.parametrize("weights_fn", [sapo_weights, gspo_weights, clip_cov_weights])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(weights_fn, dtype):
    trainer, sampler, advantages, mask = _batch(3, spread=0.3)
    half = weights_fn(trainer.to(dtype), sampler.to(dtype), advantages.to(dtype), mask)
    wide = weights_fn(trainer.to(dtype).float(), sampler.to(dtype).float(),
                      advantages.to(dtype).float(), mask)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, wide, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("weights_fn", [sapo_weights, gspo_weights, clip_cov_weights])
def test_padding_may_hold_anything(weights_fn):
    trainer, sampler, advantages, mask = _batch(0)
    dirty = trainer.clone()
    dirty[~mask.bool()] = float("nan")
    dirty_adv = advantages.clone()
    dirty_adv[~mask.bool()] = float("inf")
    torch.testing.assert_close(weights_fn(dirty, sampler, dirty_adv, mask),
                               weights_fn(trainer, sampler, advantages, mask), rtol=0, atol=0)


@pytest.mark.parametrize("call, match", [
    (lambda b: sapo_weights(*b, tau_pos=0.0), "tau_pos"),
    (lambda b: sapo_weights(*b, tau_neg=float("nan")), "tau_neg"),
    (lambda b: sapo_weights(b[0], b[1], b[2][:, :2], b[3]), "advantages must have shape"),
    (lambda b: clip_cov_weights(*b, clip_cov_lb=2.0, clip_cov_ub=1.0), "clip_cov_lb"),
    (lambda b: clip_cov_weights(*b, clip_cov_ratio=0.0), "clip_cov_ratio"),
    (lambda b: clip_cov_weights(b[0], b[1], torch.full_like(b[2], float("nan")), b[3]),
     "advantages must be finite"),
    (lambda b: clip_cov_weights(b[0], b[1][:, :3], b[2], b[3]), "sampler_logp"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call(_batch(0))


@pytest.mark.properties
@settings(deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 6),
       st.floats(0.01, 30.0), st.integers(0, len(PAIRS) - 1),
       st.sampled_from(["token-mean", "sum", "seq-mean-token-mean"]))
def test_the_weights_give_the_loss_gradient_on_any_batch(seed, B, T, spread, pair, reduction):
    loss_fn, weights_fn, options = PAIRS[pair]
    batch = _batch(seed, B=B, T=T, spread=spread)
    framework, weighted, weights = _gradients(loss_fn, weights_fn, options, *batch, reduction)
    assert bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())
    torch.testing.assert_close(weighted, framework, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_fn, weights_fn, options", PAIRS, ids=IDS)
def test_in_float32_the_weights_give_the_loss_gradient_away_from_the_clips_edges(
        loss_fn, weights_fn, options, seed):
    """float32, the training's dtype: the same gradient to float32's rounding on every token
    whose ratio is not within 1e-4 of a clip's edge (there the loss's recomputed ratio, or
    torch.maximum's split of a tie, may decide otherwise; the docstrings say so)."""
    trainer, sampler, advantages, mask = (t.float() for t in _batch(seed, spread=0.3))
    framework, weighted, _ = _gradients(loss_fn, weights_fn, options, trainer, sampler,
                                        advantages, mask, "token-mean")
    token = torch.exp(trainer.double() - sampler.double())
    lengths = mask.double().sum(1, keepdim=True).clamp_min(1)
    geometric = torch.exp(((trainer.double() - sampler.double()) * mask).sum(1, keepdim=True)
                          / lengths).expand_as(token)
    edges = [1 - options.get("clip_ratio_low", options.get("clip_ratio", 0.2)),
             1 + options.get("clip_ratio_high", options.get("clip_ratio", 0.2))]
    if loss_fn is gspo_loss:
        edges = [1 - options.get("clip_ratio_low", 3e-4), 1 + options.get("clip_ratio_high", 4e-4)]
    near = torch.zeros_like(mask, dtype=torch.bool)
    if loss_fn is not sapo_loss:
        ratio = geometric if loss_fn is gspo_loss else token
        for edge in edges:
            near |= (ratio - edge).abs() < 1e-4
    far = mask.bool() & ~near
    torch.testing.assert_close(weighted[far], framework[far], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("call, message", [
    (lambda b: sapo_weights(*b, tau_pos=0.0), r"^tau_pos must be > 0, got 0.0"),
    (lambda b: sapo_weights(*b, tau_neg=0.0), r"^tau_neg must be > 0, got 0.0"),
    (lambda b: sapo_weights(*b, tau_neg=-1.0), r"^tau_neg must be > 0, got -1.0"),
    (lambda b: clip_cov_weights(*b, clip_cov_ratio=math.nan), r"^clip_cov_ratio must be"),
    (lambda b: clip_cov_weights(*b, clip_cov_lb=math.nan), r"^clip_cov_lb must be a finite"),
    (lambda b: clip_cov_weights(*b, clip_cov_ub=math.nan), r"^clip_cov_ub must be a finite"),
    (lambda b: clip_cov_loss(*b, clip_cov_ub=math.nan), r"^clip_cov_ub must be a finite"),
])
def test_each_refusal_names_its_argument_first(call, message):
    with pytest.raises(ValueError, match=message):
        call(_batch(0))


def test_an_infinite_covariance_band_is_accepted_and_makes_every_token_eligible():
    batch = _batch(1, spread=0.05)
    everything = clip_cov_weights(*batch, clip_cov_lb=-math.inf, clip_cov_ub=math.inf,
                                  clip_cov_ratio=0.5)
    nothing = clip_cov_weights(*batch, clip_cov_lb=1e9, clip_cov_ub=2e9)
    # about half of the eligible (every unclipped) token's weight is removed in expectation
    unclipped = nothing != 0
    assert bool(unclipped.any())
    assert bool((everything[unclipped] < nothing[unclipped]).all())
    torch.testing.assert_close(
        clip_cov_loss(*batch, clip_cov_lb=-math.inf, clip_cov_ub=math.inf)[0],
        clip_cov_loss(*batch, clip_cov_lb=-1e300, clip_cov_ub=1e300)[0])


def test_the_covariance_band_is_open_at_both_ends():
    """Dyadic values, so that the covariance is exactly 0.5 on both tokens: a band whose end is
    0.5 makes neither eligible, a band around it both (verl's > lb and < ub)."""
    trainer = torch.tensor([[-1.0, -3.0]], dtype=torch.float64)
    sampler = trainer.clone()  # ratio 1: nothing clipped
    A = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    inside = clip_cov_weights(trainer, sampler, A, mask, clip_cov_lb=0.25, clip_cov_ub=0.75)
    assert inside.tolist() == [[0.5, 0.5]]  # one of two removed in expectation
    for band in ({"clip_cov_lb": 0.5, "clip_cov_ub": 0.75}, {"clip_cov_lb": 0.25,
                                                              "clip_cov_ub": 0.5}):
        assert clip_cov_weights(trainer, sampler, A, mask, **band).tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("loss_fn, weights_fn, options", PAIRS, ids=IDS)
def test_a_log_ratio_of_exactly_20_still_sends_its_gradient(loss_fn, weights_fn, options):
    """The clamp's bounds pass the gradient (torch.clamp's derivative is 1 there)."""
    trainer = torch.tensor([[-1.0, -2.0], [-21.0, -22.0]], dtype=torch.float64)
    sampler = torch.tensor([[-21.0, -22.0], [-1.0, -2.0]], dtype=torch.float64)  # +-20 exactly
    A = torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    framework, weighted, weights = _gradients(loss_fn, weights_fn, options, trainer, sampler, A,
                                              mask, "sum")
    torch.testing.assert_close(weighted, framework, rtol=1e-12, atol=0.0)
    if weights_fn is sapo_weights:  # at -20 the gate's slope is not 0 (at +20 it underflows)
        assert bool((weights[1] != 0).all())
    else:  # A < 0 at +20 and A > 0 at -20: PPO's clip leaves both, their weight is the ratio
        assert bool((weights != 0).all())


def test_sapo_takes_tau_neg_where_the_advantage_is_0():
    """As sapo_loss does (tau_pos only where A > 0): the weight of a token with A = 0 is the
    tau_neg gate's, which is what counts it among the weighted tokens."""
    trainer = torch.log(torch.tensor([[0.5]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.2]], dtype=torch.float64))
    mask = torch.ones(1, 1)
    zero = sapo_weights(trainer, sampler, torch.zeros(1, 1), mask, tau_pos=3.0, tau_neg=0.5)
    negative = sapo_weights(trainer, sampler, -torch.ones(1, 1), mask, tau_pos=3.0, tau_neg=0.5)
    positive = sapo_weights(trainer, sampler, torch.ones(1, 1), mask, tau_pos=3.0, tau_neg=0.5)
    assert zero.item() == negative.item() != positive.item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clip_covs_covariance_is_taken_in_float32_for_half_inputs(dtype):
    """With a band that makes tokens eligible: float16 inputs give the weights of their float32
    upcast, the covariance included."""
    trainer, sampler, advantages, mask = _batch(4, spread=0.05)
    band = {"clip_cov_lb": 0.02, "clip_cov_ub": 5.0, "clip_cov_ratio": 0.2}
    half = clip_cov_weights(trainer.to(dtype), sampler.to(dtype), advantages.to(dtype), mask,
                            **band)
    wide = clip_cov_weights(trainer.to(dtype).float(), sampler.to(dtype).float(),
                            advantages.to(dtype).float(), mask, **band)
    assert bool((wide != torch.exp(trainer.to(dtype).float() - sampler.to(dtype).float())
                 * mask).any())  # some weight was reduced: tokens were eligible
    torch.testing.assert_close(half, wide, rtol=0.0, atol=0.0)


def test_gspo_weights_read_a_missing_lower_bound_as_0_like_gspo_loss():
    # clip_ratio_low=None is epsilon_l = 0 in both: the floor at 1, so s = 0.8 with A < 0 is
    # clipped (weight 0), where a floor at 0 would keep its ratio 0.8
    trainer = torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    sampler = trainer - math.log(0.8)
    A, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2)
    assert gspo_weights(trainer, sampler, A, mask, clip_ratio_low=None).tolist() == [[0.0, 0.0]]
    leaf = trainer.clone().requires_grad_(True)
    loss, _ = gspo_loss(leaf, sampler, A, mask, clip_ratio_low=None)
    (grad,) = torch.autograd.grad(loss, leaf)
    assert grad.abs().max() == 0
    # the same batch with the floor at 0 keeps the ratio
    kept = gspo_weights(trainer, sampler, A, mask, clip_ratio_low=1.0)
    torch.testing.assert_close(kept, torch.full((1, 2), 0.8, dtype=torch.float64))
