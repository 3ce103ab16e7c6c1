"""mismatch.correction against the numpy estimators, analytic gradients and verl's names.

Every numpy estimator of ``opd_literate.mismatch.estimators`` is reproduced on the enumerable toys
turned into a ``(M, T)`` batch of all M responses: the weights of the torch module (``weights *
keep``, or the gradient of a bypass loss divided by ``-A``) equal the estimator's weights. Equal
means: the same tokens at 0, and the other values within 1e-13 relative, because torch's ``exp`` and
``sum`` round differently from numpy's (on float64 they differ in the last bit for about 5% of
inputs; the weights here pass through one exp of a sum of at most 6 terms).
"""

import json
import math
import pathlib

import mpmath
import numpy as np
import pytest
import torch

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.toy import estimator_moments, make_ar_toy, make_toy, response_mask
from opd_literate.opd import REDUCTIONS, kl_estimator
from tests.helpers.batches import as_batch

FIXTURE = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" /
                      "verl_rollout_correction.json").read_text())

TOYS = {
    "toy": make_toy(T=3, V=3, mismatch=0.6, seed=1),
    "ar_toy": make_ar_toy(T=3, V=4, mismatch=0.8, seed=1),  # ragged responses with padding
}
BASELINE = 0.5  # R - 0.5 = +-0.5: nonzero, and a power of two (dividing by it is exact)


def advantages(toy):
    return torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)


def loss_weights(loss_fn, toy, **options):
    """-grad / A of a bypass loss with reduction 'sum': the per-token weight it applies."""
    trainer, sampler, mask = as_batch(toy)
    trainer = trainer.clone().requires_grad_()
    A = advantages(toy)
    loss, _ = loss_fn(trainer, sampler, A, mask, reduction="sum", **options)
    loss.backward()
    return -trainer.grad / A[:, None]


def torch_weights(name, toy, p):
    """The torch module's weights for a registered estimator with parameters p."""
    batch = as_batch(toy)
    inf = math.inf

    def iw(level, **kw):
        return C.importance_weights(*batch, level, **kw)[0]

    def rc(**kw):
        c = C.rollout_correction(*batch, **kw)
        return c.weights * c.keep

    if name == "naive":
        return rc()
    if name == "token_is":
        return iw("token", rollout_is_threshold=inf)
    if name == "seq_is":
        return iw("sequence", rollout_is_threshold=inf)
    if name == "token_tis":
        return iw("token", rollout_is_threshold=p["cap"])
    if name == "seq_tis":
        return iw("sequence", rollout_is_threshold=p["cap"])
    if name in ("token_mis", "icepop"):
        return iw("token", mode="mask", lower=p["low"], rollout_is_threshold=p["high"])
    if name == "seq_mis":
        return iw("sequence", mode="mask", lower=p["low"], rollout_is_threshold=p["high"])
    if name == "token_clamp":
        return iw("token", mode="clamp", lower=p["low"], rollout_is_threshold=p["high"])
    if name == "geo_rs":  # verl's band on -log rho_geo: "a_b" keeps 1/b <= rho_geo <= 1/a
        return rc(rollout_rs="seq_mean_k1",
                  rollout_rs_threshold=f"{1 / p['high']!r}_{1 / p['low']!r}")
    if name == "k3_seq_rs":
        return rc(rollout_rs="seq_mean_k3", rollout_rs_threshold=p["threshold"])
    if name == "token_veto":
        return rc(veto_threshold=p["threshold"])
    if name == "geo_rs_token_tis":
        return rc(rollout_is="token", rollout_is_threshold=p["cap"], rollout_rs="seq_mean_k1",
                  rollout_rs_threshold=f"{1 / p['high']!r}_{1 / p['low']!r}")
    if name == "cispo":
        return loss_weights(C.cispo_loss, toy, clip_ratio_low=p["eps_low"],
                            clip_ratio_high=p["eps_high"])
    if name == "ppo_clip_bypass":
        return loss_weights(C.ppo_clip_loss, toy, clip_ratio=p["eps"],
                            clip_ratio_c=p["clip_ratio_c"])
    if name == "gspo":
        return loss_weights(C.gspo_loss, toy, clip_ratio_low=p["eps_low"],
                            clip_ratio_high=p["eps_high"])
    if name in ("dppo_tv", "dppo_kl"):
        return loss_weights(getattr(C, f"{name}_loss"), toy, clip_ratio_low=p["delta_low"],
                            clip_ratio_high=p["delta_high"], clip_ratio_c=p["clip_ratio_c"])
    raise KeyError(name)


# Parameters at which every threshold changes some weight of both toys (checked below), so that
# a wrong comparison or band cannot pass unnoticed.
OVERRIDES = {
    "token_tis": {"cap": 1.5},
    "seq_tis": {"cap": 1.5},
    "token_mis": {"low": 0.5, "high": 1.5},
    "seq_mis": {"low": 0.5, "high": 1.5},
    "geo_rs": {"low": 0.8, "high": 1.25},
    "icepop": {"low": 0.7, "high": 1.5},
    "token_clamp": {"low": 0.7, "high": 1.5},
    "cispo": {"eps_low": 0.3, "eps_high": 0.5},
    "ppo_clip_bypass": {"eps": 0.2, "clip_ratio_c": 1.5},
    "token_veto": {"threshold": 0.6},
    "k3_seq_rs": {"threshold": 0.05},
    "geo_rs_token_tis": {"low": 0.8, "high": 1.25, "cap": 1.5},
    "gspo": {"eps_low": 0.05, "eps_high": 0.05},
    "dppo_tv": {"delta_low": 0.1, "delta_high": 0.15, "clip_ratio_c": 1.5},
    "dppo_kl": {"delta_low": 0.02, "delta_high": 0.05, "clip_ratio_c": 1.5},
}


# The other frameworks' seven: their torch forms are compared in test_peer_switches.py.
PEER_SWITCHES = {"trl_token_truncate", "trl_token_mask", "trl_sequence_truncate",
                 "trl_sequence_mask", "off_policy_mask", "seq_mask_tis", "kpop"}
# verl's and TRL's other policy losses: their torch forms are compared in test_policy_losses.py.
POLICY_LOSSES = {"sapo", "gmpo", "clip_cov", "luspo", "vespo"}


def test_every_estimator_is_covered():
    assert (set(OVERRIDES) | {"naive", "token_is", "seq_is"} | PEER_SWITCHES | POLICY_LOSSES
            == set(E.REGISTRY))


def _check_estimator(name, toy_name):
    toy = TOYS[toy_name]
    p = {**E.REGISTRY[name].defaults, **OVERRIDES.get(name, {})}
    expected = E.estimator_weights(toy, name, baseline=BASELINE, **OVERRIDES.get(name, {}))
    expected = expected * response_mask(toy)  # the padding has no weight here
    got = torch_weights(name, toy, p).detach().numpy()
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got == 0, expected == 0)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)
    if name in OVERRIDES:  # the thresholds bite: some weight differs from the plain ratio
        reference = E._reference_weights(toy, E.REGISTRY[name].reference) * response_mask(toy)
        assert not np.allclose(expected, reference)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_naive(toy_name):
    _check_estimator("naive", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_token_is(toy_name):
    _check_estimator("token_is", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_seq_is(toy_name):
    _check_estimator("seq_is", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_token_tis(toy_name):
    _check_estimator("token_tis", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_seq_tis(toy_name):
    _check_estimator("seq_tis", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_token_mis(toy_name):
    _check_estimator("token_mis", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_token_mis_is_verl_token_k1_with_token_is(toy_name):
    # verl's route: rollout_is=token, no cap, rollout_rs=token_k1 at "1/high_1/low"
    toy = TOYS[toy_name]
    c = C.rollout_correction(*as_batch(toy), rollout_is="token", rollout_is_threshold=math.inf,
                             rollout_rs="token_k1", rollout_rs_threshold=f"{1 / 1.5!r}_{1 / 0.5!r}")
    expected = E.token_mis(toy, low=0.5, high=1.5, return_weights=True) * response_mask(toy)
    np.testing.assert_allclose((c.weights * c.keep).numpy(), expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_seq_mis(toy_name):
    _check_estimator("seq_mis", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_geo_rs(toy_name):
    _check_estimator("geo_rs", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_icepop(toy_name):
    _check_estimator("icepop", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_token_clamp(toy_name):
    _check_estimator("token_clamp", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_cispo(toy_name):
    _check_estimator("cispo", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_ppo_clip_bypass(toy_name):
    _check_estimator("ppo_clip_bypass", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_token_veto(toy_name):
    _check_estimator("token_veto", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_k3_seq_rs(toy_name):
    _check_estimator("k3_seq_rs", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_geo_rs_token_tis(toy_name):
    _check_estimator("geo_rs_token_tis", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_gspo(toy_name):
    _check_estimator("gspo", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_dppo_tv(toy_name):
    _check_estimator("dppo_tv", toy_name)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_dppo_kl(toy_name):
    _check_estimator("dppo_kl", toy_name)


def _expected_gradient_of_the_loss(toy, loss_fn, baseline, **options):
    """-d/d theta of E_mu[L(y)], by autograd: every enumerated response a batch of its own,
    its loss (reduction "sum") weighted by its probability under the sampler. The trainer's
    log-probabilities are recomputed from the logits theta in torch, not read from the toy."""
    theta = torch.tensor(toy["theta"], dtype=torch.float64, requires_grad=True)
    log_pi = torch.log_softmax(theta, dim=-1)  # (T, V), or (T, V + 1, V) for the AR toy
    Y = torch.from_numpy(toy["Y"])
    positions = torch.arange(Y.shape[1])
    trainer = (log_pi[positions, torch.from_numpy(toy["prev"]), Y] if "prev" in toy
               else log_pi[positions, Y])  # (M, T): log pi(y_t), the padding masked below
    sampler = torch.from_numpy(np.array(toy["logp_sampler"]))
    mask = torch.from_numpy(response_mask(toy))
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - baseline)
    total = 0.0
    for m, mu in enumerate(toy["p_sampler"]):
        loss, _ = loss_fn(trainer[m:m + 1], sampler[m:m + 1], A[m:m + 1], mask[m:m + 1],
                          reduction="sum", **options)
        total = total + float(mu) * loss
    total.backward()
    return -theta.grad.numpy()


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("baseline", [0.0, BASELINE])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_estimator_mean_is_the_expected_gradient_of_the_loss(name, baseline, toy_name):
    """The exact mean of the numpy estimator on the toy (a sum over its responses) against
    autograd of the torch loss over the same responses, weighted by mu, in float64."""
    toy = TOYS[toy_name]
    for params in (E.REGISTRY[name].defaults, OVERRIDES[name]):
        mean = estimator_moments(toy, getattr(E, name)(toy, **params, baseline=baseline))["mean"]
        grad = _expected_gradient_of_the_loss(
            toy, getattr(C, f"{name}_loss"), baseline, clip_ratio_low=params["delta_low"],
            clip_ratio_high=params["delta_high"], clip_ratio_c=params["clip_ratio_c"])
        np.testing.assert_allclose(mean, grad, rtol=1e-12, atol=1e-15 * np.abs(mean).max())


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_dro_mean_on_the_toy_is_naive_less_the_penalty(toy_name):
    """dro_loss's expected gradient is E_mu[sum_t (A - beta log rho_t) s_t]: naive's mean less
    beta E_mu[sum_t log rho_t s_t] (written out in numpy); at beta -> 0, naive."""
    toy = TOYS[toy_name]
    beta = 0.3
    log_rho_t = (toy["logp_train"] - toy["logp_sampler"]) * response_mask(toy)
    extra = (1,) * (toy["score"].ndim - 2)
    penalty = log_rho_t.reshape(log_rho_t.shape + extra) * toy["score"]
    naive = estimator_moments(toy, E.naive(toy, baseline=BASELINE))["mean"]
    expected = naive - beta * np.einsum("m,m...->...", toy["p_sampler"], penalty)
    grad = _expected_gradient_of_the_loss(toy, C.dro_loss, BASELINE, dro_beta=beta)
    np.testing.assert_allclose(grad, expected, rtol=1e-12, atol=1e-15 * np.abs(expected).max())
    assert not np.allclose(grad, naive)


# ---------------------------------------------------------------------------------------------
# Losses: autograd against analytic gradients, for every reduction
# ---------------------------------------------------------------------------------------------
def _random_batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    sampler = trainer + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    lengths = torch.tensor([7, 1, 4, 0, 6])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    return trainer, sampler, mask, A


def _normaliser(mask, reduction):
    """d loss / d per_token_loss[b, t] for each reduction (independent of aggregate_loss)."""
    B, T = mask.shape
    n_b = mask.sum(1, keepdim=True).clamp_min(1)
    return {
        "token-mean": torch.full_like(mask, 1.0 / max(float(mask.sum()), 1.0)),
        "seq-mean-token-sum": torch.full_like(mask, 1.0 / B),
        "seq-mean-token-mean": (1.0 / (B * n_b)).expand(B, T),
        "seq-mean-token-sum-norm": torch.full_like(mask, 1.0 / (B * T)),
        "sum": torch.ones_like(mask),
        "token-sum": torch.ones_like(mask),
        "token-sum-norm": torch.full_like(mask, 1.0 / T),
    }[reduction] * mask


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ppo_clip_loss_gradient_is_the_analytic_one(reduction):
    trainer, sampler, mask, A = _random_batch()
    x = trainer.clone().requires_grad_()
    eps_low, eps_high, c = 0.15, 0.25, 1.8
    loss, _ = C.ppo_clip_loss(x, sampler, A, mask, clip_ratio_low=eps_low,
                              clip_ratio_high=eps_high, clip_ratio_c=c, reduction=reduction)
    loss.backward()
    r = torch.exp(trainer - sampler)
    inactive = (((A > 0) & (r > 1 + eps_high)) | ((A < 0) & (r < 1 - eps_low))
                | ((A < 0) & (r > c)))
    expected = torch.where(inactive, 0.0, -A * r) * _normaliser(mask, reduction)
    assert inactive[mask > 0].any() and (~inactive[mask > 0]).any()
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-15)
    # and the value: PPO's min with the dual clip, written out per case
    value = torch.where(A > 0, -A * torch.clamp(r, max=1 + eps_high),
                        torch.minimum(-A * torch.clamp(r, min=1 - eps_low), -A * c))
    torch.testing.assert_close(loss, (value * _normaliser(mask, reduction)).sum(), rtol=1e-12,
                               atol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cispo_loss_gradient_is_the_analytic_one(reduction):
    trainer, sampler, mask, A = _random_batch(1)
    x = trainer.clone().requires_grad_()
    loss, _ = C.cispo_loss(x, sampler, A, mask, clip_ratio_low=0.2, clip_ratio_high=0.3,
                           reduction=reduction)
    loss.backward()
    w = torch.clamp(torch.exp(trainer - sampler), 0.8, 1.3)
    torch.testing.assert_close(x.grad, -w * A * _normaliser(mask, reduction), rtol=1e-12,
                               atol=1e-15)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gspo_loss_gradient_is_the_analytic_one(reduction):
    trainer, sampler, mask, _ = _random_batch(2)
    A = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0], dtype=torch.float64)  # one per response
    x = trainer.clone().requires_grad_()
    eps = 0.1
    loss, _ = C.gspo_loss(x, sampler, A, mask, clip_ratio_low=eps, clip_ratio_high=eps,
                          reduction=reduction)
    loss.backward()
    n = mask.sum(1).clamp_min(1)
    s = torch.exp(((trainer - sampler) * mask).sum(1) / n)[:, None]  # (B, 1)
    clipped = ((A[:, None] > 0) & (s > 1 + eps)) | ((A[:, None] < 0) & (s < 1 - eps))
    expected = torch.where(clipped, 0.0, -A[:, None] * s) * _normaliser(mask, reduction)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reinforce_loss_gradient_is_minus_weight_times_advantage(reduction):
    trainer, sampler, mask, A = _random_batch(3)
    weights = torch.exp(trainer - sampler).clamp(max=2.0)
    x = trainer.clone().requires_grad_()
    C.reinforce_loss(x, A, mask, weights, reduction=reduction).backward()
    torch.testing.assert_close(x.grad, -weights * A * _normaliser(mask, reduction), rtol=1e-12,
                               atol=1e-15)


def _dppo_region(trainer, sampler, A, divergence, low, high):
    """DPPO's trust region m_t read from the docstrings (float64, verl's 1 - exp(log p))."""
    p, q = trainer.exp(), sampler.exp()
    if divergence == "tv":
        up, down = p - q <= high, p - q >= -low
    else:
        kl = q * (sampler - trainer) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        up, down = (kl <= high) | (p <= q), (kl <= low) | (p >= q)
    return torch.where(A > 0, up, down)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("divergence, low, high", [("tv", 0.1, 0.15), ("kl", 0.02, 0.05)])
def test_dppo_loss_gradient_and_value_are_the_analytic_ones(divergence, low, high, reduction):
    trainer, sampler, mask, A = _random_batch(18)
    sampler = -sampler.abs()  # log-probabilities (the KL needs them <= 0)
    c = 1.5
    x = trainer.clone().requires_grad_()
    loss_fn = getattr(C, f"dppo_{divergence}_loss")
    loss, metrics = loss_fn(x, sampler, A, mask, clip_ratio_low=low, clip_ratio_high=high,
                            clip_ratio_c=c, reduction=reduction)
    loss.backward()
    r = torch.exp(trainer - sampler)
    inside = _dppo_region(trainer, sampler, A, divergence, low, high)
    valid = mask > 0
    assert (~inside)[valid].any() and inside[valid].any() and (inside & (r > c))[valid].any()
    w = torch.where(inside, torch.clamp(r, max=c), 0.0)
    torch.testing.assert_close(x.grad, -w * A * _normaliser(mask, reduction), rtol=1e-12,
                               atol=1e-15)
    value = (-w * A * trainer * _normaliser(mask, reduction)).sum()
    torch.testing.assert_close(loss, value, rtol=1e-12, atol=1e-15)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(
        float((~inside)[valid].double().mean()), rel=1e-12)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(
        float((inside & (r > c))[valid].double().mean()), rel=1e-12)
    assert metrics["actor/ppo_kl"] == pytest.approx(float((sampler - trainer)[valid].mean()),
                                                    rel=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dro_loss_gradient_and_value_are_the_analytic_ones(reduction):
    trainer, sampler, mask, A = _random_batch(14)
    beta = 0.7
    x = trainer.clone().requires_grad_()
    loss, metrics = C.dro_loss(x, sampler, A, mask, dro_beta=beta, reduction=reduction)
    loss.backward()
    log_rho = trainer - sampler
    torch.testing.assert_close(x.grad, (-A + beta * log_rho) * _normaliser(mask, reduction),
                               rtol=1e-12, atol=1e-15)
    value = (-(A * trainer - 0.5 * beta * log_rho ** 2) * _normaliser(mask, reduction)).sum()
    torch.testing.assert_close(loss, value, rtol=1e-12, atol=1e-15)
    assert set(metrics) == {"actor/ppo_kl"}


def test_dppo_with_an_open_region_and_no_cap_is_reinforce_with_the_token_ratio():
    """delta = inf and c = inf: no token leaves the region, the weight is the plain ratio."""
    trainer, sampler, mask, A = _random_batch(15)
    sampler = -sampler.abs()
    weights, _ = C.importance_weights(trainer, sampler, mask, rollout_is_threshold=math.inf)
    for loss_fn in (C.dppo_tv_loss, C.dppo_kl_loss):
        x, y = trainer.clone().requires_grad_(), trainer.clone().requires_grad_()
        loss_fn(x, sampler, A, mask, clip_ratio=math.inf, clip_ratio_c=math.inf)[0].backward()
        C.reinforce_loss(y, A, mask, weights=weights).backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-13, atol=0)


def test_dppo_defaults_are_verls_actor_config():
    """clip_ratio 0.2 on both sides and clip_ratio_c 3.0 (ActorConfig), token-mean."""
    trainer, sampler, mask, A = _random_batch(16)
    sampler = -sampler.abs()
    for loss_fn in (C.dppo_tv_loss, C.dppo_kl_loss):
        default, m = loss_fn(trainer, sampler, A, mask)
        explicit, m2 = loss_fn(trainer, sampler, A, mask, clip_ratio_low=0.2,
                               clip_ratio_high=0.2, clip_ratio_c=3.0, reduction="token-mean")
        assert torch.equal(default, explicit) and m == m2
        other, _ = loss_fn(trainer, sampler, A, mask, clip_ratio=0.0)
        assert not torch.equal(default, other)  # clip_ratio is read when low/high are None


def test_dppo_kl_is_finite_where_the_trainer_probability_is_one():
    """log p = 0: 1 - p = 0, and verl's 1e-8 keeps the logarithm finite."""
    trainer = torch.tensor([[0.0, math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    sampler = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    loss, metrics = C.dppo_kl_loss(trainer, sampler, torch.tensor([1.0, 1.0]).double()[:1],
                                   torch.ones(1, 2), reduction="sum")
    loss.backward()
    # token 0: D = 0.5 log 0.5 + 0.5 log(0.5 / 1e-8) = 8.52 > 0.2, moved up: out; token 1 in
    assert trainer.grad.tolist() == [[0.0, -1.0]] and metrics["actor/pg_clipfrac"] == 0.5


@pytest.mark.parametrize("kind", ["k1+", "k3+"])
def test_straight_through_kl_has_the_value_of_k_and_the_gradient_of_k2(kind):
    trainer, ref, mask, _ = _random_batch(4)
    x = trainer.clone().requires_grad_()
    k = C.kl_penalty(x, ref, mask, kind)
    k.sum().backward()
    value = kl_estimator(trainer, ref, kind[:2]) * mask
    torch.testing.assert_close(k.detach(), value, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, (trainer - ref) * mask, rtol=1e-14, atol=0)
    # without the "+", k3's gradient is 1 - exp(-d), not d
    y = trainer.clone().requires_grad_()
    C.kl_penalty(y, ref, mask, kind[:2]).sum().backward()
    assert not torch.allclose(y.grad, x.grad)


# ---------------------------------------------------------------------------------------------
# Rejection semantics, against an independent float64 numpy reading of verl's rules
# ---------------------------------------------------------------------------------------------
def _numpy_rs(log_rho, mask, option, lower, upper):
    x = np.clip(log_rho, -20, 20)
    k = {"k1": -x, "k2": 0.5 * x ** 2, "k3": np.exp(x) - 1 - x}[option[-2:]] * mask
    level = option[:-3]
    n = np.maximum(mask.sum(1, keepdims=True), 1)
    stat = {"token": k, "seq_sum": k.sum(1, keepdims=True), "seq_mean": k.sum(1, keepdims=True) / n,
            "seq_max": np.where(mask > 0, k, -np.inf).max(1, keepdims=True)}[level]
    if option.endswith("k1"):
        passes = (stat >= np.log(lower)) & (stat <= np.log(upper))
    else:
        passes = stat <= upper
    return np.broadcast_to(passes, mask.shape) & (mask > 0)


@pytest.mark.parametrize("option", C.RS_OPTIONS)
def test_each_rejection_criterion_matches_an_independent_reading(option):
    trainer, sampler, mask, _ = _random_batch(5)
    log_rho, m = (trainer - sampler).numpy(), mask.numpy()
    # thresholds at which each criterion keeps some tokens and rejects others on this batch
    spec, (lower, upper) = {
        "token_k1": ("0.7_1.3", (0.7, 1.3)), "seq_sum_k1": ("0.5_0.75", (0.5, 0.75)),
        "seq_mean_k1": ("0.8_0.95", (0.8, 0.95)),
    }.get(option, ("0.8", (None, 0.8)) if option.startswith("seq_sum") else ("0.15", (None, 0.15)))
    keep, metrics = C.rejection_mask(trainer, sampler, mask, option, spec)
    expected = _numpy_rs(log_rho, m, option, lower, upper)
    np.testing.assert_array_equal(keep.numpy(), expected)
    assert 0 < expected.sum() < m.sum()  # the criterion bites
    rejected = (m > 0) & ~expected
    assert metrics[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(
        rejected.sum() / m.sum())
    has_token = m.sum(1) > 0
    assert metrics[f"rollout_rs_{option}_seq_masked_fraction"] == pytest.approx(
        rejected.any(1).sum() / has_token.sum())


def test_rejection_criteria_chain_as_and_with_one_threshold_each():
    trainer, sampler, mask, _ = _random_batch(6)
    both, metrics = C.rejection_mask(trainer, sampler, mask, "token_k1, seq_mean_k3",
                                     "0.6_1.5,0.05")
    one, _ = C.rejection_mask(trainer, sampler, mask, "token_k1", "0.6_1.5")
    two, _ = C.rejection_mask(trainer, sampler, mask, "seq_mean_k3", 0.05)
    assert torch.equal(both, one & two) and not torch.equal(both, one)
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(
        float((mask.bool() & ~both).sum() / mask.sum()))


def test_k1_single_threshold_is_the_symmetric_band():
    trainer, sampler, mask, _ = _random_batch(7)
    single, _ = C.rejection_mask(trainer, sampler, mask, "token_k1", 1.4)
    band, _ = C.rejection_mask(trainer, sampler, mask, "token_k1", f"{1 / 1.4!r}_1.4")
    assert torch.equal(single, band)
    r = torch.exp(trainer - sampler)
    assert torch.equal(single, mask.bool() & (r >= 1 / 1.4) & (r <= 1.4))


@pytest.mark.parametrize("rs, threshold, message", [
    ("token_k4", 1.0, "not verl's"),
    ("token_k2", "0.1_0.2", "one upper bound"),
    ("token_k1,token_k2", "1,2,3", "one per option"),
    ("seq_mean_k3", -0.1, "positive"),
    ("token_k1", "a_b", "not a number"),
    ("", 1.0, "at least one"),
    ("token_k1", None, "rollout_rs_threshold"),
])
def test_rejection_errors_name_the_problem(rs, threshold, message):
    trainer, sampler, mask, _ = _random_batch()
    with pytest.raises((ValueError, TypeError), match=message):
        C.rejection_mask(trainer, sampler, mask, rs, threshold)


# ---------------------------------------------------------------------------------------------
# Masking, precision, overflow and bad input
# ---------------------------------------------------------------------------------------------
def _all_outputs(trainer, sampler, mask, A):
    """Every value and gradient of the module on one batch."""
    out = {}
    for level in C.IS_LEVELS:
        for mode in C.IS_MODES:
            lower = None if mode == "truncate" else 0.6
            out[f"w_{level}_{mode}"] = C.importance_weights(
                trainer, sampler, mask, level, mode=mode, lower=lower,
                rollout_is_batch_normalize=True)[0]
    c = C.rollout_correction(trainer, sampler, mask, rollout_is="sequence",
                             rollout_rs="seq_max_k2,token_k1", rollout_rs_threshold="0.3,1.5",
                             veto_threshold=0.1)
    out["keep"] = c.keep.to(torch.float64)
    losses = [("ppo", C.ppo_clip_loss), ("cispo", C.cispo_loss), ("gspo", C.gspo_loss),
              ("dppo_tv", C.dppo_tv_loss), ("dppo_kl", C.dppo_kl_loss),
              ("dro", lambda *args: C.dro_loss(*args, dro_beta=0.5))]
    for name, fn in losses:
        x = trainer.detach().clone().requires_grad_()
        # log-probabilities (dppo_kl needs them <= 0); the padding keeps its garbage
        loss, _ = fn(x, sampler.clamp_max(0.0), A, mask)
        loss.backward()
        out[name], out[f"{name}_grad"] = loss.detach(), x.grad
    x = trainer.detach().clone().requires_grad_()
    C.kl_penalty(x, sampler, mask, "k3+").sum().backward()
    out["k3+_grad"] = x.grad
    return out


def test_masked_positions_reach_neither_value_nor_gradient():
    trainer, sampler, mask, A = _random_batch(8)
    clean = _all_outputs(trainer, sampler, mask, A)
    padding = mask == 0
    dirty = _all_outputs(trainer.masked_fill(padding, float("nan")),
                         sampler.masked_fill(padding, -math.inf),
                         mask, A.masked_fill(padding, float("nan")))
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), name
        if name.endswith("_grad") or name.startswith("w_"):
            assert torch.all(dirty[name][padding] == 0), name


def test_half_precision_is_computed_in_float32():
    trainer, sampler, mask, A = _random_batch(9)
    for dtype in (torch.bfloat16, torch.float16):
        t, s = trainer.to(dtype), sampler.to(dtype)
        w, _ = C.importance_weights(t, s, mask, "sequence")
        w32, _ = C.importance_weights(t.float(), s.float(), mask, "sequence")
        assert w.dtype == torch.float32 and torch.equal(w, w32)
        x = t.clone().requires_grad_()
        loss, _ = C.ppo_clip_loss(x, s, A, mask)
        loss32, _ = C.ppo_clip_loss(t.float(), s.float(), A, mask)
        loss.backward()
        assert loss.dtype == torch.float32 and torch.equal(loss, loss32)
        assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
        s_logp = s.clamp_max(0.0)
        for fn in (C.dppo_tv_loss, C.dppo_kl_loss,
                   lambda *args: C.dro_loss(*args, dro_beta=0.5)):
            half, m = fn(t, s_logp, A, mask)
            full, m32 = fn(t.float(), s_logp.float(), A, mask)
            assert half.dtype == torch.float32 and torch.equal(half, full) and m == m32


def test_huge_log_ratios_are_clamped_not_overflowed():
    # log rho = +-1000 in float32: exp would be inf or 0; verl's bound gives e^20 and e^-20
    trainer = torch.tensor([[0.0, -1000.0, 0.0]])
    sampler = torch.tensor([[-1000.0, 0.0, -1000.0]])
    mask = torch.ones(1, 3)
    w, metrics = C.importance_weights(trainer, sampler, mask, "token",
                                      rollout_is_threshold=math.inf)
    assert torch.allclose(w, torch.exp(torch.tensor([[20.0, -20.0, 20.0]])))
    ws, _ = C.importance_weights(trainer, sampler, mask, "sequence", rollout_is_threshold=math.inf)
    assert torch.allclose(ws, torch.full((1, 3), math.exp(20.0)))
    assert all(math.isfinite(v) for v in metrics.values())
    x = trainer.clone().requires_grad_()
    loss, _ = C.ppo_clip_loss(x, sampler, torch.tensor([-1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert x.grad[0, 0] == 0  # clamped log-ratio: no gradient (verl's clamp does the same)


@pytest.mark.parametrize("call, error, message", [
    (lambda t, s, m, a: C.importance_weights(t, s[:, :3], m), ValueError, "same shape"),
    (lambda t, s, m, a: C.importance_weights(t, s, m * 2), ValueError, "mask values"),
    (lambda t, s, m, a: C.importance_weights(t.masked_fill(m > 0, float("nan")), s, m),
     ValueError, "trainer_logp must be finite where mask is 1"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, "seq"), ValueError, "rollout_is"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="cap"), ValueError, "mode"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, lower=0.5), ValueError, "lower"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="mask", lower=3.0), ValueError,
     "lower must be <="),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold=0), ValueError,
     "rollout_is_threshold"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a, m, clip_ratio_c=1.0), ValueError,
     "clip_ratio_c"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a[:, :2], m), ValueError, "advantages"),
    (lambda t, s, m, a: C.cispo_loss(t, s, a, m, reduction="mean"), ValueError, "reduction"),
    (lambda t, s, m, a: C.rollout_correction(t, s, m, rollout_rs_threshold=0.1), ValueError,
     "needs rollout_rs"),
    (lambda t, s, m, a: C.veto_mask(t, s, m, veto_threshold=0), ValueError, "veto_threshold"),
    (lambda t, s, m, a: C.kl_penalty(t, s, m, "k2+"), ValueError, "kind"),
    (lambda t, s, m, a: C.importance_weights(t.long(), s, m), TypeError, "floating"),
    (lambda t, s, m, a: C.dppo_tv_loss(t, s, a, m, clip_ratio_low=-0.1), ValueError,
     "clip_ratio_low must be >= 0"),
    (lambda t, s, m, a: C.dppo_tv_loss(t, s, a, m, clip_ratio=math.nan), ValueError,
     "clip_ratio must be a finite number"),
    (lambda t, s, m, a: C.dppo_tv_loss(t, s, a, m, clip_ratio_c=0.0), ValueError,
     "clip_ratio_c must be > 0"),
    (lambda t, s, m, a: C.dppo_kl_loss(t, s, a, m, reduction="mean"), ValueError, "reduction"),
    (lambda t, s, m, a: C.dppo_kl_loss(t, s.abs() + 0.1, a, m), ValueError,
     r"sampler_logp must be <= 0 where mask is 1"),
    (lambda t, s, m, a: C.dppo_kl_loss(t, s, a[:, :2], m), ValueError, "advantages"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m, dro_beta=0.0), ValueError, "dro_beta must be > 0"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m, dro_beta=None), TypeError, "dro_beta"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m), TypeError, "dro_beta"),
    (lambda t, s, m, a: C.dro_loss(t.float() - 100.0, s.float(), a, m, dro_beta=1e35),
     ValueError, "dro_loss overflows torch.float32"),
])
def test_bad_input_gets_a_clear_error(call, error, message):
    trainer, sampler, mask, A = _random_batch()
    with pytest.raises(error, match=message):
        call(trainer, sampler, mask, A)


def test_only_dppo_and_dro_refuse_a_log_probability_above_0():
    """The module docstring's conventions: DPPO and DRO refuse log pi > 0 inside the mask; the
    other functions take any finite pair, and those that read only log pi - log mu give the
    same result for log-ratios passed as trainer_logp with sampler_logp = 0. Multiples of 1/8
    below 8 and the shift 8 are exact in float64, so the two calls compute the same floats."""
    g = torch.Generator().manual_seed(30)
    trainer = -torch.randint(0, 64, (3, 4), generator=g).double() / 8
    sampler = -torch.randint(0, 64, (3, 4), generator=g).double() / 8
    mask, A = torch.ones(3, 4), torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    shifted = trainer - sampler, torch.zeros_like(sampler)  # log rho in [-8, 8], mu = 1
    assert (shifted[0] > 0).any()
    same = {
        "log_ratios": lambda t, s: C.log_ratios(t, s, mask, "sequence"),
        "importance_weights": lambda t, s: C.importance_weights(t, s, mask, "token")[0],
        "rejection_mask": lambda t, s: C.rejection_mask(t, s, mask, "token_k1,seq_mean_k3",
                                                        "0.5_2,0.5")[0],
        "veto_mask": lambda t, s: C.veto_mask(t, s, mask, veto_threshold=0.1),
        "ppo_clip_loss": lambda t, s: C.ppo_clip_loss(t, s, A, mask)[0],
        "gspo_loss": lambda t, s: C.gspo_loss(t, s, A, mask, clip_ratio_low=0.5,
                                              clip_ratio_high=0.5)[0],
        "kl_penalty": lambda t, s: C.kl_penalty(t, s, mask, "k3"),
    }
    for name, fn in same.items():
        assert torch.equal(fn(trainer, sampler), fn(*shifted)), name
    # the others read log pi itself, and take it above 0 all the same
    for out in (C.cispo_loss(*shifted, A, mask)[0], C.reinforce_loss(shifted[0], A, mask),
                C.rollout_correction(*shifted, mask, rollout_is="token").weights):
        assert torch.isfinite(out).all()
    assert all(math.isfinite(v) for v in C.offpolicy_metrics(*shifted, mask).values())
    for fn, options in ((C.dppo_tv_loss, {}), (C.dppo_kl_loss, {}),
                        (C.dro_loss, {"dro_beta": 0.5})):
        fn(trainer, sampler, A, mask, **options)  # log-probabilities: accepted
        with pytest.raises(ValueError, match=r"^trainer_logp must be <= 0 where mask is 1"):
            fn(*shifted, A, mask, **options)


def test_batch_normalised_weights_average_one():
    trainer, sampler, mask, _ = _random_batch(10)
    w, metrics = C.importance_weights(trainer, sampler, mask, "token",
                                      rollout_is_batch_normalize=True)
    assert float(w[mask > 0].mean()) == pytest.approx(1.0, rel=1e-12)
    raw, _ = C.importance_weights(trainer, sampler, mask, "token")
    assert torch.allclose(w * metrics["rollout_is_batch_norm_factor"], raw)
    ws, _ = C.importance_weights(trainer, sampler, mask, "sequence",
                                 rollout_is_batch_normalize=True)
    per_response = ws.max(1).values[mask.sum(1) > 0]  # one weight per response with a token
    assert float(per_response.mean()) == pytest.approx(1.0, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Metrics: verl's names, independent values
# ---------------------------------------------------------------------------------------------
def _verl_metric_names(options):
    names = set(FIXTURE["metrics"]) | set(FIXTURE["actor_metrics"])
    for option in options:
        names |= {t.format(option=option) for t in FIXTURE["metrics_per_rs_option"]}
    return names


def test_metric_names_are_verls():
    trainer, sampler, mask, A = _random_batch(11)
    options = "token_k1,seq_sum_k2,seq_mean_k3,seq_max_k3"
    c = C.rollout_correction(trainer, sampler, mask, rollout_is="token",
                             rollout_is_batch_normalize=True, rollout_rs=options,
                             rollout_rs_threshold=1.5)
    names = {n.removeprefix(FIXTURE["metric_prefix"]) for n in c.metrics}
    assert all(n.startswith(FIXTURE["metric_prefix"]) for n in c.metrics)
    assert names <= _verl_metric_names(options.split(","))
    for fn in (C.ppo_clip_loss, C.cispo_loss, C.gspo_loss):
        assert set(fn(trainer, sampler, A, mask)[1]) <= set(FIXTURE["actor_metrics"])
    logp = sampler.clamp_max(0.0)  # DPPO and DRO take log-probabilities (<= 0)
    for fn in (C.dppo_tv_loss, C.dppo_kl_loss):
        assert set(fn(trainer, logp, A, mask)[1]) <= set(FIXTURE["actor_metrics"])
    assert set(C.dro_loss(trainer, logp, A, mask, dro_beta=0.1)[1]) <= set(
        FIXTURE["actor_metrics"])


def test_metric_values_against_float64_formulas():
    """verl 0.9.1's compute_is_metrics and compute_offpolicy_metrics, written out in numpy:
    the IS statistics are of the applied (truncated) weights, the fractions of the ratios."""
    trainer, sampler, mask, _ = _random_batch(12)
    m = mask.numpy() > 0
    x = (trainer - sampler).numpy()
    r = np.exp(x)
    c = C.rollout_correction(trainer, sampler, mask, rollout_is="token", rollout_is_threshold=1.5)
    got = {k.removeprefix("rollout_corr/"): v for k, v in c.metrics.items()}
    w = np.minimum(r, 1.5)
    assert got["rollout_is_mean"] == pytest.approx(w[m].mean(), rel=1e-12)
    assert got["rollout_is_max"] == pytest.approx(w[m].max(), rel=1e-12)
    assert got["rollout_is_min"] == pytest.approx(w[m].min(), rel=1e-12)
    assert got["rollout_is_ratio_fraction_high"] == pytest.approx((r[m] > 1.5).mean())
    assert got["rollout_is_ratio_fraction_low"] == pytest.approx((r[m] < 1 / 1.5).mean())
    assert got["rollout_is_std"] == pytest.approx(w[m].std(), rel=1e-10)
    assert got["rollout_is_eff_sample_size"] == pytest.approx(
        w[m].mean() ** 2 / (w[m] ** 2).mean(), rel=1e-12)
    rows = m.any(1)
    seq_w = ((w * m).sum(1) / np.maximum(m.sum(1), 1))[rows]
    seq_r = ((r * m).sum(1) / np.maximum(m.sum(1), 1))[rows]
    assert got["rollout_is_seq_mean"] == pytest.approx(seq_w.mean(), rel=1e-12)
    assert got["rollout_is_seq_std"] == pytest.approx(seq_w.std(ddof=1), rel=1e-10)
    assert got["rollout_is_seq_max_deviation"] == pytest.approx(np.abs(seq_w - 1).max(),
                                                                rel=1e-12)
    assert got["rollout_is_seq_fraction_high"] == pytest.approx((seq_r > 1.5).mean())
    assert got["kl"] == pytest.approx((-x[m]).mean(), rel=1e-12)
    assert got["k3_kl"] == pytest.approx((r[m] - 1 - x[m]).mean(), rel=1e-12)
    assert got["chi2_token"] == pytest.approx((r[m] ** 2).mean() - 1, rel=1e-12)
    seq = (x * m).sum(1)[rows]
    assert got["chi2_seq"] == pytest.approx(np.exp(2 * seq).mean() - 1, rel=1e-12)
    mean_logp = ((trainer.numpy() * m).sum(1) / np.maximum(m.sum(1), 1))[rows]
    mean_logq = ((sampler.numpy() * m).sum(1) / np.maximum(m.sum(1), 1))[rows]
    assert got["training_ppl"] == pytest.approx(np.exp(-mean_logp).mean(), rel=1e-12)
    assert got["rollout_log_ppl"] == pytest.approx((-mean_logq).mean(), rel=1e-12)
    assert got["ppl_ratio"] == pytest.approx(np.exp(mean_logq - mean_logp).mean(), rel=1e-12)


def test_the_dppo_and_dro_losses_are_named_after_verls_loss_modes():
    """dppo_tv_loss, dppo_kl_loss, dro_loss: the loss_mode names of verl's registry (the
    fixture read from the installed release), with its actor metrics."""
    for mode in ("dppo_tv", "dppo_kl", "dro"):
        assert mode in FIXTURE["policy_loss_modes"] and f"{mode}_loss" in C.__all__
    assert "bypass_mode" in FIXTURE["policy_loss_modes"]


def test_the_module_cites_the_verl_version_of_the_fixture():
    assert C.VERL_VERSION == FIXTURE["version"]
    assert C.VERL_COMMIT is E.VERL_COMMIT  # one definition, in _numerics, re-exported by both
    assert C.SAFETY_BOUND == FIXTURE["safety_bound"]
    assert C.RS_OPTIONS == tuple(FIXTURE["rollout_rs_options"])
    assert {k.rstrip("+") for k in C.KL_PENALTIES} <= set(FIXTURE["kl_penalty_names"])


@pytest.mark.parametrize("loss, expected", [("ppo_clip_loss", 0.0), ("gspo_loss", 0.0),
                                            ("cispo_loss", -1.2), ("reinforce_loss", -2.0)])
def test_a_clamped_log_ratio_stops_the_gradient_only_where_it_flows_through_the_ratio(loss,
                                                                                    expected):
    """The module docstring's Overflow paragraph, at log rho = 25 > SAFETY_BOUND and A = 1.
    PPO: the clipped branch, a constant; GSPO: exp of a clamped log-ratio; CISPO: the detached
    weight min(rho, 1 + 0.2) = 1.2 times the score; REINFORCE: the truncated weight min(rho, 2)."""
    f64 = torch.float64
    trainer = torch.tensor([[25.0]], dtype=f64, requires_grad=True)
    sampler, ones, advantage = (torch.zeros(1, 1, dtype=f64), torch.ones(1, 1, dtype=f64),
                                torch.tensor([1.0], dtype=f64))
    if loss == "reinforce_loss":
        weights, _ = C.importance_weights(trainer.detach(), sampler, ones)
        value = C.reinforce_loss(trainer, advantage, ones, weights=weights)
    else:
        value, _ = getattr(C, loss)(trainer, sampler, advantage, ones)
    value.backward()
    assert trainer.grad.item() == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# verl 0.9.1's threshold forms, band checks and presets (without verl: tests/integration has it)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_an_icepop_threshold_is_the_mask_mode_with_its_lower_bound(level):
    trainer, sampler, mask, _ = _random_batch(21)
    icepop, m = C.importance_weights(trainer, sampler, mask, level, rollout_is_threshold="0.6_1.7")
    masked, _ = C.importance_weights(trainer, sampler, mask, level, rollout_is_threshold=1.7,
                                     mode="mask", lower=0.6)
    assert torch.equal(icepop, masked)
    ratio = C.log_ratios(trainer, sampler, mask, level).exp()
    outside = ((ratio < 0.6) | (ratio > 1.7))[mask > 0]
    assert m["rollout_is_oob_ratio"] == pytest.approx(outside.double().mean().item(), rel=1e-12)
    # a number in a string is the cap, as a number is
    assert torch.equal(C.importance_weights(trainer, sampler, mask, level,
                                            rollout_is_threshold="1.7")[0],
                       C.importance_weights(trainer, sampler, mask, level,
                                            rollout_is_threshold=1.7)[0])


@pytest.mark.parametrize("threshold, match", [
    ("2.0_0.5", "lower must be <= rollout_is_threshold"),
    ("0_2", "rollout_is_threshold's lower bound must be > 0"),
    ("a_2", "rollout_is_threshold must be a number or a string"),
    ("", "rollout_is_threshold must be a number or a string"),
])
def test_a_bad_icepop_threshold_names_the_argument(threshold, match):
    trainer, sampler, mask, _ = _random_batch(22)
    with pytest.raises(ValueError, match=match):
        C.importance_weights(trainer, sampler, mask, rollout_is_threshold=threshold)


def test_an_icepop_threshold_refuses_a_second_band():
    trainer, sampler, mask, _ = _random_batch(22)
    with pytest.raises(ValueError, match="sets the band itself"):
        C.importance_weights(trainer, sampler, mask, rollout_is_threshold="0.5_2", mode="clamp")


@pytest.mark.parametrize("option, threshold", [("token_k1", "2.0_0.5"), ("seq_mean_k1", 0.5),
                                               ("seq_sum_k1", "1.5_1.2")])
def test_an_empty_rejection_band_is_an_error_not_a_rejection_of_everything(option, threshold):
    """verl refuses lower > upper; this module accepted "2.0_0.5" and rejected every token."""
    trainer, sampler, mask, _ = _random_batch(23)
    with pytest.raises(ValueError, match=r"rollout_rs_threshold .* is the empty band"):
        C.rejection_mask(trainer, sampler, mask, option, threshold)


def test_every_weight_rejected_gives_this_librarys_ess_of_0():
    """IcePop with every ratio outside its band: ESS = 0 / 0, reported as 0 here (verl 0.9.1
    raises ZeroDivisionError: tests/integration/test_verl.py)."""
    trainer, sampler, mask, _ = _random_batch(24)
    _, m = C.importance_weights(trainer, sampler, mask, rollout_is_threshold="100_200")
    assert m["rollout_is_eff_sample_size"] == 0.0 and m["rollout_is_mean"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_ess_is_scale_free_and_at_most_1(dtype):
    """Equal weights have an ESS of exactly 1, whatever their size: at the cap 1e-30 (whose
    square underflows to 0 in float32) and at 0.1, where mean(u)^2 / mean(u^2) computed on u
    itself rounds above 1 (on 11 tokens in float32, 3 in float64)."""
    for n in (1, 3, 11, 48):
        x = torch.zeros(1, n, dtype=dtype)
        for cap in (1e-30, 0.1):
            _, m = C.importance_weights(x, x, torch.ones(1, n), rollout_is_threshold=cap)
            assert m["rollout_is_eff_sample_size"] == 1.0, (n, cap)
    n = 11 if dtype == torch.float32 else 3
    u = torch.full((n,), 0.1, dtype=dtype)
    assert float(u.mean().square() / u.square().mean()) > 1.0  # the reason for u / max u
    # two weights 1 and 2: (3 / 2)^2 / (5 / 2) = 0.9
    trainer = torch.tensor([[0.0, math.log(2.0)]], dtype=dtype)
    _, m = C.importance_weights(trainer, torch.zeros_like(trainer), torch.ones(1, 2),
                                rollout_is_threshold=math.inf)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(0.9, rel=1e-6)


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_every_preset_runs_and_its_bypass_loss_is_the_named_one(name):
    trainer, sampler, mask, A = _random_batch(25)
    fields = dict(C.PRESETS[name])
    bypass, loss_type = fields.pop("bypass_mode", False), fields.pop("loss_type", "ppo_clip")
    assert set(fields) <= {"rollout_is", "rollout_is_threshold", "rollout_rs",
                           "rollout_rs_threshold"}
    c = C.rollout_correction(trainer, sampler, mask, **fields)
    assert all(math.isfinite(v) for v in c.metrics.values())
    assert bypass == name.startswith("bypass_")
    assert (loss_type == "reinforce") == name.startswith("bypass_pg_")


def test_the_perplexity_metrics_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.0]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.25, 0.25], [1.0, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    m = C.offpolicy_metrics(trainer, sampler, mask)
    # response 1: mean log pi = log(0.5 * 0.25) / 2, ppl = 1 / sqrt(0.125); response 2: 2
    assert m["training_ppl"] == pytest.approx((0.125 ** -0.5 + 2.0) / 2, rel=1e-12)
    assert m["rollout_ppl"] == pytest.approx((4.0 + 1.0) / 2, rel=1e-12)
    # d_b = mean log mu - mean log pi: log(0.25 / 0.125 ** 0.5) and log(1 / 0.5)
    d = [math.log(0.25 / 0.125 ** 0.5), math.log(2.0)]
    assert m["log_ppl_diff"] == pytest.approx(sum(d) / 2, rel=1e-12)
    assert m["ppl_ratio"] == pytest.approx((math.exp(d[0]) + math.exp(d[1])) / 2, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# DPPO's binary divergences against the full-vocabulary ones (the docstrings of dppo_tv_loss and
# dppo_kl_loss): the exact statements in 50-digit arithmetic (mpmath, a dependency of torch's
# sympy), on distributions whose float64 probabilities are read as exact numbers
# ---------------------------------------------------------------------------------------------
VERL_EPS = 1e-8  # verl's literal in compute_policy_loss_dppo_kl (tests/integration/test_verl.py)


def _distributions(seed, V):
    """(mu, pi) over V tokens: Dirichlet draws, some peaked (a probability near 1)."""
    g = np.random.default_rng(seed)
    alpha = 0.3 if seed % 2 else 2.0
    mu, pi = (0.95 * g.dirichlet(np.full(V, alpha)) + 0.05 / V for _ in range(2))
    return mu / mu.sum(), pi / pi.sum()


def _binary_kl_mp(q, p, eps):
    q, p = mpmath.mpf(q), mpmath.mpf(p)
    return q * mpmath.log(q / p) + (1 - q) * mpmath.log((1 - q + eps) / (1 - p + eps))


CASES = [(seed, V) for V in (2, 3, 10, 100) for seed in range(6)]


@pytest.mark.parametrize("seed, V", CASES)
def test_the_binary_divergences_are_at_most_the_full_vocabulary_ones_without_epsilon(seed, V):
    """Data processing: |p - q| <= TV(mu, pi) and D^0 <= KL(mu || pi) for every token, with
    equality for two tokens (and for TV wherever every other token moved the same way): to the
    1e-45 of the 50-digit arithmetic."""
    mu, pi = _distributions(seed, V)
    with mpmath.workdps(50):
        tol = mpmath.mpf(10) ** -45
        m, p = [mpmath.mpf(x) for x in mu], [mpmath.mpf(x) for x in pi]
        total = sum(m), sum(p)
        m, p = [x / total[0] for x in m], [x / total[1] for x in p]  # exact distributions
        kl = sum(a * mpmath.log(a / b) for a, b in zip(m, p))
        tv = sum(abs(a - b) for a, b in zip(m, p)) / 2
        for q_y, p_y in zip(m, p):
            d0 = _binary_kl_mp(q_y, p_y, 0)
            assert d0 <= kl + tol and abs(p_y - q_y) <= tv + tol
            if V == 2:
                assert abs(d0 - kl) < tol and abs(abs(p_y - q_y) - tv) < tol
            else:  # a third token carries mass, and the merge loses some KL
                assert d0 < kl


@pytest.mark.parametrize("seed, V", CASES)
def test_verls_epsilon_exceeds_the_full_kl_only_where_p_is_below_q_and_by_at_most_the_bound(
        seed, V):
    """D_t - D^0_t <= 0 where p >= q; 0 < D_t - D^0_t <= eps (q - p + eps) / (1 - p + eps) < eps
    where p < q (exactly, in mpmath); the module's float64 D_t is that number to rounding."""
    mu, pi = _distributions(seed, V)
    computed = C._binary_kl(torch.from_numpy(np.log(mu)), torch.from_numpy(np.log(pi)))
    with mpmath.workdps(50):
        eps = mpmath.mpf(VERL_EPS)
        for q, p, got in zip(np.exp(np.log(mu)), np.exp(np.log(pi)), computed.tolist()):
            # q, p: the probabilities the module reads (exp of the float64 log-probabilities)
            d, d0 = _binary_kl_mp(q, p, eps), _binary_kl_mp(q, p, 0)
            excess = d - d0
            if p >= q:
                assert excess <= 0
            else:
                bound = eps * (mpmath.mpf(q) - p + eps) / (1 - mpmath.mpf(p) + eps)
                assert 0 < excess <= bound < eps
            assert abs(got - d) <= 1e-15 * max(1.0, float(d))


def test_the_docstrings_excess_of_2e_9():
    """Two tokens, (q, p) = (0.6, 0.5): D_t exceeds KL(mu || pi) = D^0_t by 2.0e-9."""
    assert r"$2.0 \cdot 10^{-9}$" in C.dppo_kl_loss.__doc__
    d = C._binary_kl(torch.tensor(0.6, dtype=torch.float64).log(),
                     torch.tensor(0.5, dtype=torch.float64).log()).item()
    with mpmath.workdps(50):
        q, p = mpmath.mpf("0.6"), mpmath.mpf("0.5")
        kl = q * mpmath.log(q / p) + (1 - q) * mpmath.log((1 - q) / (1 - p))
        assert float(mpmath.mpf(d) - kl) == pytest.approx(2.0e-9, rel=1e-6)


@pytest.mark.parametrize("loss_fn", [C.dppo_tv_loss, C.dppo_kl_loss])
def test_a_token_on_its_full_divergence_is_inside_except_a_fallen_one_under_the_kl(loss_fn):
    """Two tokens, so the binary divergence is the full one. A fell from q = 0.6 to p = 0.5
    (A = -1): at delta_l = its full divergence TV keeps it and verl's KL removes it (its D_t is
    2e-9 above); at delta_l + 1e-8 both keep it. A rose from 0.5 to 0.6 (A = 1): at delta_h =
    its full divergence both keep it (D_t is below D^0_t there)."""
    f64 = torch.float64
    tv = 0.1
    kl_down = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    kl_up = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    divergence = "kl" if loss_fn is C.dppo_kl_loss else "tv"
    for q, p, A, delta, side in ((0.6, 0.5, -1.0, kl_down, "clip_ratio_low"),
                                 (0.5, 0.6, 1.0, kl_up, "clip_ratio_high")):
        delta = delta if divergence == "kl" else tv
        trainer = torch.tensor([[math.log(p)]], dtype=f64)
        sampler = torch.tensor([[math.log(q)]], dtype=f64)
        for slack, outside in ((0.0, divergence == "kl" and A < 0), (VERL_EPS, False)):
            # the TV case at slack 0 is |0.5 - 0.6| = 0.1 read in floats: keep a margin of 1e-12
            d = delta + (slack if divergence == "kl" else 1e-12)
            _, m = loss_fn(trainer, sampler, torch.tensor([A], dtype=f64), torch.ones(1, 1),
                           **{side: d})
            assert m["actor/pg_clipfrac"] == (1.0 if outside else 0.0), (q, p, slack)
