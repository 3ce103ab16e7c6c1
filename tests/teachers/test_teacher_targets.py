"""opd_literate.teachers.teacher_targets: the torch targets against the numpy reference on every
enumerated response of the many-teachers toys, their identities, the padding, half precision,
placement and bad input.

Tolerance ``1e-12``: a target is a sum or a log-sum-exp of at most a few float64 terms of size
below 30, computed in another order than numpy's.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch.toy import response_mask
from opd_literate.teachers.many_teachers import make_prompts, target_token_logprobs
from opd_literate.teachers.teacher_targets import TARGET_KINDS, teacher_target_logprobs

ATOL = 1e-12


def _batch(prompts, x):
    """Prompt ``x``'s enumerated responses as a trainer's batch: (K, M, T), (M, T), (M,)."""
    toy = prompts["toys"][x]
    M = toy["logp_teachers"].shape[1]
    return (torch.tensor(toy["logp_teachers"]), torch.tensor(response_mask(toy)),
            torch.full((M,), int(prompts["routes"][x])))


@pytest.mark.parametrize("autoregressive", [False, True])
@pytest.mark.parametrize("kind, weighting", [(kind, w) for kind in TARGET_KINDS
                                             for w in ("uniform", "random")
                                             if (kind, w) != ("routed", "random")])
def test_the_targets_are_the_numpy_references_on_every_response(kind, autoregressive, weighting):
    prompts = make_prompts(P=3, K=3, T=3, V=3, autoregressive=autoregressive, seed=4)
    weights = None
    if weighting == "random":  # routed takes no weights: it reads the routes
        weights = np.random.default_rng(1).dirichlet(np.ones(3), size=3)
        weights[0] = [0.0, 0.3, 0.7]  # a weight 0: that teacher drops out
    expected = target_token_logprobs(prompts, kind, weights)
    for x in range(3):
        logp, mask, routes = _batch(prompts, x)
        got = teacher_target_logprobs(
            logp, mask, kind, None if weights is None else torch.tensor(weights[x]),
            routes if kind == "routed" else None)
        np.testing.assert_allclose(got.numpy(), expected[x], rtol=0, atol=ATOL)


def test_the_sequence_mixture_telescopes_to_the_mixture_of_sequences():
    """sum_t log qbar(y_t | y_<t) = log sum_k w_k q_k(y), for every response."""
    prompts = make_prompts(autoregressive=True, seed=2)
    logp, mask, _ = _batch(prompts, 0)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    target = teacher_target_logprobs(logp, mask, "sequence_mixture", w)
    whole = torch.logsumexp(w.log()[:, None] + (logp * mask).sum(-1), dim=0)
    torch.testing.assert_close(target.sum(-1), whole, rtol=0, atol=ATOL)


def test_a_weight_zero_is_the_teacher_left_out():
    prompts = make_prompts(K=3, seed=3)
    logp, mask, _ = _batch(prompts, 1)
    for kind in ("weighted_kl", "token_mixture", "sequence_mixture"):
        three = teacher_target_logprobs(logp, mask, kind, torch.tensor([0.4, 0.0, 0.6]))
        two = teacher_target_logprobs(logp[[0, 2]], mask, kind, torch.tensor([0.4, 0.6]))
        torch.testing.assert_close(three, two, rtol=0, atol=ATOL)


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 5.0])
def test_the_padding_never_reaches_a_valid_token(garbage):
    prompts = make_prompts(autoregressive=True, seed=5)
    logp, mask, routes = _batch(prompts, 2)
    dirty = logp.masked_fill(~mask.bool()[None], garbage)
    for kind in TARGET_KINDS:
        extra = {"routes": routes} if kind == "routed" else {}
        clean = teacher_target_logprobs(logp, mask, kind, **extra)
        out = teacher_target_logprobs(dirty, mask, kind, **extra)
        assert torch.equal(clean, out) and bool((out[~mask.bool()] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    prompts = make_prompts(seed=6)
    logp, mask, routes = _batch(prompts, 0)
    half = logp.to(dtype)
    for kind in TARGET_KINDS:
        extra = {"routes": routes} if kind == "routed" else {}
        out = teacher_target_logprobs(half, mask, kind, **extra)
        reference = teacher_target_logprobs(half.float(), mask, kind, **extra)
        assert out.dtype == torch.float32 and torch.equal(out, reference)


def test_every_tensor_it_creates_follows_its_inputs():
    """Under a meta default device, a tensor made without the input's device would be meta."""
    prompts = make_prompts(seed=7)
    logp, mask, routes = _batch(prompts, 0)
    with torch.device("meta"):
        for kind in TARGET_KINDS:
            extra = {"routes": routes} if kind == "routed" else {}
            assert teacher_target_logprobs(logp, mask, kind, **extra).device.type == "cpu"


def test_the_targets_carry_no_gradient():
    prompts = make_prompts(seed=8)
    logp, mask, _ = _batch(prompts, 0)
    assert not teacher_target_logprobs(logp.requires_grad_(), mask, "token_mixture").requires_grad


@pytest.mark.properties  # the example count from the profile: 25, or 1,000 with "ci"
@given(K=st.integers(1, 4), B=st.integers(1, 4), T=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_jensen_orders_the_weighted_sum_below_the_per_token_mixture(K, B, T, seed):
    """sum_k w_k log q_k <= log sum_k w_k q_k (concavity of log), equal for one teacher; the
    per-token mixture lies between the teachers' least and largest log-probability."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(K, B, T, generator=g, dtype=torch.float64) * 0.99 + 0.01)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    w = torch.rand(B, K, generator=g, dtype=torch.float64) + 0.01
    w = w / w.sum(-1, keepdim=True)
    weighted = teacher_target_logprobs(logp, mask, "weighted_kl", w)
    mixture = teacher_target_logprobs(logp, mask, "token_mixture", w)
    assert bool((weighted <= mixture + 1e-12).all())
    low, high = logp.min(0).values, logp.max(0).values
    assert bool((mixture[mask] >= low[mask] - 1e-12).all())
    assert bool((mixture[mask] <= high[mask] + 1e-12).all())
    if K == 1:
        torch.testing.assert_close(weighted, mixture, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call, error, message", [
    (lambda lp, m: teacher_target_logprobs(lp[0], m, "token_mixture"), ValueError,
     r"teacher_logp must have 3 dimensions, got shape \(2, 3\)"),
    (lambda lp, m: teacher_target_logprobs(lp, m[:, :2], "token_mixture"), ValueError,
     r"mask must have the shape of teacher_logp's \(B, T\) \(2, 3\), got \(2, 2\)"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "mixture"), ValueError,
     "kind must be one of routed, weighted_kl, token_mixture, sequence_mixture, got 'mixture'"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "routed"), ValueError,
     r"routed needs routes, a \(B,\) = \(2,\) integer tensor"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "routed", routes=torch.tensor([0, 2])),
     ValueError, r"routes must lie in \[0, K\) = \[0, 2\), got \[0, 2\]"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "routed", torch.tensor([0.5, 0.5]),
                                           torch.tensor([0, 1])),
     ValueError, "routed takes no weights"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "weighted_kl", routes=torch.tensor([0, 1])),
     ValueError, "routes is for kind='routed' only"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "weighted_kl", torch.tensor([0.5, 0.6])),
     ValueError, "each row of weights must sum to 1"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "weighted_kl", torch.tensor([1.5, -0.5])),
     ValueError, "weights must be finite and non-negative"),
    (lambda lp, m: teacher_target_logprobs(lp, m, "weighted_kl", torch.ones(3) / 3), ValueError,
     r"weights must have shape \(K,\) = \(2,\) or \(B, K\) = \(2, 2\), got \(3,\)"),
    (lambda lp, m: teacher_target_logprobs(lp.masked_fill(m.bool()[None], math.nan), m,
                                           "token_mixture"),
     ValueError, r"teacher_logp must be finite and at most 0 where mask is 1, got nan at"),
    (lambda lp, m: teacher_target_logprobs(lp + 1.0, m, "token_mixture"), ValueError,
     "teacher_logp must be finite and at most 0 where mask is 1"),
    (lambda lp, m: teacher_target_logprobs(lp.long(), m, "token_mixture"), TypeError,
     "teacher_logp must have a floating dtype"),
])
def test_bad_arguments_are_named(call, error, message):
    logp = torch.log(torch.full((2, 2, 3), 0.5, dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(error, match=message):
        call(logp, mask)


def test_weights_rounded_to_a_half_type_are_accepted_and_renormalised():
    """0.2, 0.3, 0.5 in bfloat16 sum to 1.001: within bfloat16's rounding, divided by the sum."""
    prompts = make_prompts(seed=9)
    logp, mask, _ = _batch(prompts, 0)
    rounded = torch.tensor([0.2, 0.3, 0.5], dtype=torch.bfloat16)
    assert abs(float(rounded.double().sum()) - 1) > 1e-4
    out = teacher_target_logprobs(logp, mask, "token_mixture", rounded)
    exact = rounded.double() / rounded.double().sum()
    torch.testing.assert_close(out, teacher_target_logprobs(logp, mask, "token_mixture", exact),
                               rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match=r"must sum to 1 \(within 1e-06\)"):
        teacher_target_logprobs(logp, mask, "token_mixture", rounded.double())


def test_the_sequence_mixture_of_a_long_float32_response_stays_within_1e_4():
    """The module docstring: 8,192 tokens with log-probabilities in [-4, 0], float32 within
    1e-4 of float64 at every token (the plain running sums of the whole log-probabilities were
    off by about 1.4e-3 on this batch: their rounding grows with the prefix's magnitude)."""
    g = torch.Generator().manual_seed(0)
    log_q = (-4.0 * torch.rand(3, 4, 8192, dtype=torch.float64, generator=g)).float()
    mask = torch.ones(4, 8192, dtype=torch.bool)
    exact = teacher_target_logprobs(log_q.double(), mask, "sequence_mixture")
    computed = teacher_target_logprobs(log_q, mask, "sequence_mixture")
    assert computed.dtype == torch.float32
    assert (computed.double() - exact).abs().max() < 1e-4
