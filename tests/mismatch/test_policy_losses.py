"""verl's and TRL's other policy losses: numpy weights from scratch, torch gradients, exact means.

The registered ``sapo``, ``gmpo``, ``clip_cov``, ``luspo`` and ``vespo`` of
``opd_literate.mismatch.estimators`` are rebuilt here from the formulas of their docstrings, and
their torch losses in ``opd_literate.mismatch.correction`` are compared with them on the toys'
enumerated ``(M, T)`` batches (equal: the same zeros, the other values within 1e-12 relative), as
``test_correction.py`` does for the others. ``kl_cov``, whose estimate is not of the form
``w_t A s_t``, is compared as an estimate. The frameworks' own functions are run in
``tests/integration/test_verl_policy_losses.py`` and ``test_trl_policy_losses.py``.
"""

import math

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

DEFAULTS = {
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "gmpo": {"eps_low": 0.2, "eps_high": 0.2},
    "clip_cov": {"eps": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "luspo": {"eps_low": 0.2, "eps_high": 0.2},
    "vespo": {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
}

# Parameters at which every bound changes some weight of the toys (checked below).
OTHER = {
    "sapo": {"tau_pos": 3.0, "tau_neg": 0.5},
    "gmpo": {"eps_low": 0.1, "eps_high": 0.15},
    "clip_cov": {"eps": 0.4, "clip_cov_ratio": 0.05, "clip_cov_lb": 0.02, "clip_cov_ub": 0.5},
    "luspo": {"eps_low": 0.05, "eps_high": 0.1},
    "vespo": {"k_pos": 1.0, "lambda_pos": 2.0, "k_neg": 0.5, "lambda_neg": 1.0},
}

TOYS = {
    "toy": make_toy(T=3, V=3, mismatch=0.6, seed=1),
    "ar_toy": make_ar_toy(T=3, V=4, mismatch=0.8, seed=1),  # ragged responses with padding
    "m1": make_toy(T=3, V=3, mismatch=1.0, seed=0),
}
BASELINE = 0.5  # R - 0.5 = +-0.5: both signs, and dividing by it is exact


def _parts(toy):
    mask = response_mask(toy)
    log_rho_t = (toy["logp_train"] - toy["logp_sampler"]) * mask
    n = mask.sum(axis=1)
    return log_rho_t, mask, n


def reference(name, toy, baseline=0.0, statistics="population", **p):
    """The (M, T) or (M,) weights of the docstrings' formulas, written from scratch."""
    log_rho_t, mask, n = _parts(toy)
    rho_t = np.exp(log_rho_t)
    A = toy["R"] - baseline
    if name == "sapo":
        tau = np.where(A > 0, p["tau_pos"], p["tau_neg"])[:, None]
        with np.errstate(over="ignore"):  # cosh = inf for a large ratio: the weight is 0
            return rho_t / np.cosh(tau * (rho_t - 1) / 2) ** 2
    if name == "gmpo":
        up = (A[:, None] > 0) & (log_rho_t > p["eps_high"])
        down = (A[:, None] < 0) & (log_rho_t < -p["eps_low"])
        m = np.where(up, p["eps_high"], np.where(down, -p["eps_low"], log_rho_t))
        return np.exp(m.sum(axis=1) / n)[:, None] * ~(up | down)
    if name == "luspo":
        geo = np.exp(log_rho_t.sum(axis=1) / n)
        clipped = ((A > 0) & (geo > 1 + p["eps_high"])) | ((A < 0) & (geo < 1 - p["eps_low"]))
        return geo * ~clipped
    if name == "vespo":
        rho = np.exp(log_rho_t.sum(axis=1))
        k = np.where(A >= 0, p["k_pos"], p["k_neg"])
        lam = np.where(A >= 0, p["lambda_pos"], p["lambda_neg"])
        return rho ** k * np.exp(lam * (1 - rho))
    if name == "clip_cov":
        c = mask * (toy["p_sampler"][:, None] if statistics == "population" else 1.0)
        c = c / c.sum()
        log_pi = toy["logp_train"] * mask
        cov = (A[:, None] - (c * A[:, None]).sum()) * (log_pi - (c * log_pi).sum())
        clipped = (((A[:, None] > 0) & (rho_t > 1 + p["eps"]))
                   | ((A[:, None] < 0) & (rho_t < 1 - p["eps"])))
        eligible = (mask > 0) & ~clipped & (cov > p["clip_cov_lb"]) & (cov < p["clip_cov_ub"])
        if statistics == "population":
            q = min(1.0, p["clip_cov_ratio"] / c[eligible].sum()) if eligible.any() else 0.0
        else:
            k = max(int(p["clip_cov_ratio"] * mask.sum()), 1)
            q = min(k, eligible.sum()) / eligible.sum() if eligible.any() else 0.0
        return rho_t * ~clipped * (1 - q * eligible)
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# The registry and the weights
# ---------------------------------------------------------------------------------------------
def test_the_five_are_registered_with_these_defaults_and_kl_cov_is_not():
    assert len(E.REGISTRY) == 30 and set(DEFAULTS) <= set(E.REGISTRY)
    assert list(E.REGISTRY)[-5:] == list(DEFAULTS)
    for name, defaults in DEFAULTS.items():
        spec = E.REGISTRY[name]
        assert spec.defaults == defaults and spec.fn is getattr(E, name) and not spec.unbiased
        assert name in E.__all__
    # no weight: kl_cov's penalty does not scale with A; gpg's weight is naive's 1
    assert "kl_cov" not in E.REGISTRY and "gpg" not in E.REGISTRY and "kl_cov" in E.__all__


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("baseline", [0.0, BASELINE, 1.0])
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_weights_are_the_formula(name, toy_name, baseline):
    toy = TOYS[toy_name]
    fn = getattr(E, name)
    for params in (DEFAULTS[name], OTHER[name]):
        want = reference(name, toy, baseline, **params)
        got = fn(toy, **params, baseline=baseline, return_weights=True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
        w = want if want.ndim == 2 else want[:, None]
        extra = (1,) * (toy["score"].ndim - 2)
        est = (w * (toy["R"] - baseline)[:, None]).reshape(w.shape + extra) * toy["score"]
        np.testing.assert_allclose(fn(toy, **params, baseline=baseline), est, rtol=1e-12,
                                   atol=1e-300)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_the_other_parameters_bite(toy_name):
    """Each override changes some weight against the defaults (so the torch comparisons below
    see a bound in action), and clip_cov's selection removes something."""
    toy = TOYS[toy_name]
    for name in DEFAULTS:
        a = getattr(E, name)(toy, **DEFAULTS[name], baseline=BASELINE, return_weights=True)
        b = getattr(E, name)(toy, **OTHER[name], baseline=BASELINE, return_weights=True)
        assert not np.allclose(a, b), name
    p = OTHER["clip_cov"]
    for statistics in E.COV_STATISTICS:
        w = E.clip_cov(toy, **p, baseline=BASELINE, statistics=statistics, return_weights=True)
        ppo = E.ppo_clip_bypass(toy, eps=p["eps"], clip_ratio_c=math.inf, baseline=BASELINE,
                                return_weights=True)
        assert (w < ppo - 1e-9).any(), statistics


def test_luspo_is_gspo_with_trls_range_and_sapo_near_the_anchor_is_token_is():
    toy = TOYS["m1"]
    np.testing.assert_array_equal(
        E.luspo(toy, baseline=BASELINE, return_weights=True),
        E.gspo(toy, eps_low=0.2, eps_high=0.2, baseline=BASELINE, return_weights=True))
    near = make_toy(T=3, V=3, mismatch=1e-4, seed=0)
    np.testing.assert_allclose(E.sapo(near, return_weights=True),
                               E.token_is(near, return_weights=True), rtol=1e-7)
    # clip_cov with a ratio share that removes nothing is PPO's clip without the dual clip
    np.testing.assert_array_equal(
        E.clip_cov(toy, clip_cov_lb=10.0, clip_cov_ub=20.0, baseline=BASELINE,
                   return_weights=True),
        E.ppo_clip_bypass(toy, clip_ratio_c=math.inf, baseline=BASELINE, return_weights=True))


def test_vespo_is_bounded_where_seq_is_is_not():
    toy = make_toy(T=6, V=4, mismatch=1.0, seed=0)
    w = E.vespo(toy, baseline=BASELINE, return_weights=True)
    A = toy["R"] - BASELINE
    # phi <= (k / lambda)^k e^(lambda - k): 4/9 e for A >= 0, 1.5^3 e^-1 for A < 0
    bound = np.where(A >= 0, (2 / 3) ** 2 * math.e, 1.5 ** 3 / math.e)
    assert (w <= bound * (1 + 1e-12)).all() and np.isclose(w, bound, rtol=0.3).any()
    assert E.seq_is(toy, return_weights=True).max() > 10 * bound.max()


def test_the_penalised_and_population_ones_refuse_what_they_cannot_do():
    toy = TOYS["toy"]
    with pytest.raises(ValueError, match="kl_cov has no weights"):
        E.kl_cov(toy, return_weights=True)
    with pytest.raises(ValueError, match="statistics must be one of"):
        E.clip_cov(toy, statistics="batch")
    with pytest.raises(ValueError, match="clip_cov_lb must be < clip_cov_ub"):
        E.clip_cov(toy, clip_cov_lb=2.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        E.sapo(toy, tau_neg=0.0)
    with pytest.raises(ValueError, match="lambda_pos must be > 0"):
        E.vespo(toy, lambda_pos=0.0)
    with pytest.raises(ValueError, match="eps_low must be >= 0"):
        E.gmpo(toy, eps_low=-0.1)
    with pytest.raises(TypeError, match="kl_cov_ratio must be a real number"):
        E.kl_cov(toy, kl_cov_ratio="0.1")


# ---------------------------------------------------------------------------------------------
# The torch losses on the toys' enumerated batches
# ---------------------------------------------------------------------------------------------
def _gradient(loss_fn, toy, baseline=BASELINE, **options):
    trainer, sampler, mask = as_batch(toy)
    leaf = trainer.clone().requires_grad_()
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - baseline)
    loss, _ = loss_fn(leaf, sampler, A, mask, **options)
    loss.backward()
    return leaf.grad.numpy(), A.numpy()[:, None], mask.numpy()


def torch_weights(name, toy, p):
    """-grad / A of the torch loss, rescaled to the estimator's per-token weight."""
    if name == "sapo":
        g, A, _ = _gradient(C.sapo_loss, toy, reduction="sum", **p)
        return -g / A
    if name == "gmpo":  # verl's mean over B responses of a per-response 1 / n
        g, A, mask = _gradient(C.geo_mean_loss, toy, clip_ratio_low=p["eps_low"],
                               clip_ratio_high=p["eps_high"])
        return -g / A * mask.shape[0] * mask.sum(axis=1, keepdims=True)
    if name == "luspo":  # the mean over B responses
        g, A, mask = _gradient(C.luspo_loss, toy, epsilon=p["eps_low"],
                               epsilon_high=p["eps_high"])
        return -g / A * mask.shape[0]
    if name == "vespo":
        g, A, _ = _gradient(C.vespo_loss, toy, reduction="sum", **p)
        return -g / A
    if name == "clip_cov":
        g, A, _ = _gradient(C.clip_cov_loss, toy, reduction="sum", clip_ratio=p["eps"],
                            clip_cov_ratio=p["clip_cov_ratio"], clip_cov_lb=p["clip_cov_lb"],
                            clip_cov_ub=p["clip_cov_ub"])
        return -g / A
    raise KeyError(name)


def _assert_same_weights(name, got, want):
    """The same zeros, the other values within 1e-12 relative; for SAPO and VESPO within 1e-12
    absolute: autograd's sigma (1 - sigma) loses the digits of 1 - sigma where the gate
    saturates (a weight of 1e-6 to 1e-9 relative), and VESPO's weights reach the subnormals."""
    if name in ("sapo", "vespo"):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        return
    np.testing.assert_array_equal(got == 0, want == 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_torch_loss_is_the_estimator(name, toy_name):
    toy = TOYS[toy_name]
    mask = response_mask(toy) > 0
    for params in (DEFAULTS[name], OTHER[name]):
        options = {"statistics": "enumerated"} if name == "clip_cov" else {}
        want = getattr(E, name)(toy, **params, baseline=BASELINE, return_weights=True,
                                **options)
        want = np.broadcast_to(want if want.ndim == 2 else want[:, None], mask.shape)
        got = torch_weights(name, toy, params)
        _assert_same_weights(name, np.where(mask, got, 0.0), np.where(mask, want, 0.0))


def _boundary_shares(toy):
    """kl_cov_ratio values whose k = int(N r) ends at a change of the sorted covariances (the
    toys' covariances tie: R is 0 or 1, and log pi(y_t) takes V values a position), the first
    such k and one near a fifth of the N tokens."""
    mask = response_mask(toy) > 0
    A = (toy["R"] - 0.0)[:, None] * np.ones(mask.shape)
    log_pi = np.where(mask, toy["logp_train"], 0.0)
    cov = (A - A[mask].mean()) * (log_pi - log_pi[mask].mean())
    order = np.sort(cov[mask])[::-1]
    ends = [k for k in range(1, order.size) if order[k - 1] > order[k] * (1 + 1e-9) + 1e-12]
    N = order.size
    return [(ends[0] + 0.5) / N, (min(ends, key=lambda k: abs(k - N / 5)) + 0.5) / N]


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_kl_cov_loss_is_the_enumerated_estimate(toy_name):
    """The torch gradient -dL/d log pi(y_t) times the score is the numpy estimate, token by
    token; with the larger share several tokens are penalised, some of them with A = 0."""
    toy = TOYS[toy_name]
    extra = (1,) * (toy["score"].ndim - 2)
    for share, beta in zip(_boundary_shares(toy), (0.1, 0.3)):
        params = {"kl_cov_ratio": share, "ppo_kl_coef": beta}
        g, _, mask = _gradient(C.kl_cov_loss, toy, baseline=0.0, reduction="sum", **params)
        ours = (-g).reshape(g.shape + extra) * toy["score"]
        want = E.kl_cov(toy, **params, statistics="enumerated")
        np.testing.assert_allclose(ours, want, rtol=1e-12, atol=1e-15)
        penalty = want - E.token_is(toy)
        assert np.abs(penalty).max() > 0.01  # the penalty acts
    assert np.abs(penalty[toy["R"] == 0.0]).max() > 0  # where A = 0 too


def test_kl_cov_population_selects_the_top_share_of_the_token_mass():
    toy = TOYS["toy"]
    for share in (0.05, 0.3, 0.9):
        est = E.kl_cov(toy, kl_cov_ratio=share, ppo_kl_coef=1.0)
        base = E.token_is(toy)
        log_rho_t = toy["logp_train"] - toy["logp_sampler"]
        # the penalty is -sel * sign(log rho_t) s_t: recover sel from one score entry
        sel = -(est - base)[..., 0] / (np.sign(log_rho_t) * toy["score"][..., 0])
        masses = toy["p_sampler"][:, None] / toy["logp_train"].shape[1] * np.ones_like(sel)
        assert ((sel > -1e-12) & (sel < 1 + 1e-12)).all()
        assert float((masses * sel).sum()) == pytest.approx(share, rel=1e-12)
        # every selected cell's covariance is at least every unselected one's
        A = toy["R"][:, None] * np.ones_like(sel)
        c = masses / masses.sum()
        cov = (A - (c * A).sum()) * (toy["logp_train"] - (c * toy["logp_train"]).sum())
        assert cov[sel > 1e-12].min() >= cov[sel < 1 - 1e-12].max()


def test_kl_cov_enumerated_refuses_a_tie_at_the_boundary():
    # the trainer uniform: every log pi(y_t) is its mean, every covariance exactly 0
    toy = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    with pytest.raises(ValueError, match="verl's top-k would pick either"):
        E.kl_cov(toy, kl_cov_ratio=0.5, statistics="enumerated")


def _expected_gradient(toy, loss_fn, baseline, **options):
    """-d/d theta of E_mu[L(y)], by autograd: every response a batch of its own (reduction
    "sum"), weighted by its probability under the sampler; log pi recomputed from theta."""
    theta = torch.tensor(toy["theta"], dtype=torch.float64, requires_grad=True)
    log_pi = torch.log_softmax(theta, dim=-1)
    Y = torch.from_numpy(toy["Y"])
    positions = torch.arange(Y.shape[1])
    trainer = (log_pi[positions, torch.from_numpy(toy["prev"]), Y] if "prev" in toy
               else log_pi[positions, Y])
    sampler = torch.from_numpy(np.array(toy["logp_sampler"]))
    mask = torch.from_numpy(response_mask(toy))
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - baseline)
    total = 0.0
    for m, mu in enumerate(toy["p_sampler"]):
        loss, _ = loss_fn(trainer[m:m + 1], sampler[m:m + 1], A[m:m + 1], mask[m:m + 1],
                          **options)
        total = total + float(mu) * loss
    total.backward()
    return -theta.grad.numpy()


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("baseline", [0.0, BASELINE])
def test_the_estimators_mean_is_the_expected_gradient_of_the_loss(toy_name, baseline):
    """The exact mean on the toy against autograd of the torch loss over the responses,
    weighted by mu: SAPO and VESPO (per-response losses), and GMPO times its length."""
    toy = TOYS[toy_name]
    for name, loss_fn, options in [
            ("sapo", C.sapo_loss, {"reduction": "sum"}),
            ("vespo", C.vespo_loss, {"reduction": "sum"})]:
        for params in (DEFAULTS[name], OTHER[name]):
            mean = estimator_moments(toy, getattr(E, name)(toy, **params,
                                                           baseline=baseline))["mean"]
            grad = _expected_gradient(toy, loss_fn, baseline, **options, **params)
            np.testing.assert_allclose(mean, grad, rtol=1e-12, atol=1e-15 * np.abs(mean).max())


# ---------------------------------------------------------------------------------------------
# The conventions of the torch module
# ---------------------------------------------------------------------------------------------
LOSSES = {
    "sapo_loss": lambda t, s, A, m: C.sapo_loss(t, s, A, m),
    "geo_mean_loss": lambda t, s, A, m: C.geo_mean_loss(t, s, A, m),
    "luspo_loss": lambda t, s, A, m: C.luspo_loss(t, s, A, m),
    "vespo_loss": lambda t, s, A, m: C.vespo_loss(t, s, A, m),
    "clip_cov_loss": lambda t, s, A, m: C.clip_cov_loss(t, s, A, m, clip_cov_lb=0.0),
    "kl_cov_loss": lambda t, s, A, m: C.kl_cov_loss(t, s, A, m, kl_cov_ratio=0.3),
}


def _small_batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    trainer = torch.log(torch.rand(3, 4, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    sampler = trainer - 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    A = torch.tensor([0.7, -0.4, 1.1], dtype=torch.float64)
    return trainer.to(dtype), sampler.to(dtype), A.to(dtype), mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_padding_holding_nan_and_inf_is_selected_away(name):
    trainer, sampler, A, mask = _small_batch()
    clean = trainer.clone().requires_grad_()
    LOSSES[name](clean, sampler, A, mask)[0].backward()
    dirty_t = torch.where(mask > 0, trainer, torch.tensor(math.nan, dtype=torch.float64))
    dirty_s = torch.where(mask > 0, sampler, torch.tensor(-math.inf, dtype=torch.float64))
    dirty = dirty_t.clone().requires_grad_()
    loss, _ = LOSSES[name](dirty, dirty_s, A, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.equal(dirty.grad, clean.grad)
    assert (dirty.grad[mask == 0] == 0).all()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_half_precision_is_computed_in_float32(name):
    trainer, sampler, A, mask = _small_batch()
    want, _ = LOSSES[name](trainer.float(), sampler.float(), A.float(), mask)
    for half in (torch.float16, torch.bfloat16):
        got, _ = LOSSES[name](trainer.to(half), sampler.to(half), A.to(half), mask)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(want.item(), rel=0.05, abs=0.05)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bad_input_is_a_named_error(name):
    trainer, sampler, A, mask = _small_batch()
    bad = trainer.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match=r"trainer_logp must be finite where mask is 1"):
        LOSSES[name](bad, sampler, A, mask)
    with pytest.raises(ValueError, match=r"advantages must have shape"):
        LOSSES[name](trainer, sampler, A[:2], mask)


def test_the_options_are_checked_by_name():
    trainer, sampler, A, mask = _small_batch()
    with pytest.raises(ValueError, match="tau_pos must be > 0"):
        C.sapo_loss(trainer, sampler, A, mask, tau_pos=-1.0)
    with pytest.raises(ValueError, match="clip_cov_lb must be < clip_cov_ub"):
        C.clip_cov_loss(trainer, sampler, A, mask, clip_cov_lb=5.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be > 0"):
        C.kl_cov_loss(trainer, sampler, A, mask, kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="lambda_neg must be > 0"):
        C.vespo_loss(trainer, sampler, A, mask, lambda_neg=0.0)
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        C.luspo_loss(trainer, sampler, A, mask, epsilon=-0.1)
    with pytest.raises(ValueError, match="reduction must be one of"):
        C.sapo_loss(trainer, sampler, A, mask, reduction="mean")


def test_clip_cov_loss_is_the_mean_over_verls_draws():
    """Zeroing each possible set of k eligible tokens, the mean of the losses is this loss."""
    import itertools

    trainer, sampler, A, mask = _small_batch()
    options = dict(clip_ratio=0.5, clip_cov_ratio=0.2, clip_cov_lb=-1.0, clip_cov_ub=1.0,
                   reduction="sum")
    ours, _ = C.clip_cov_loss(trainer, sampler, A, mask, **options)
    # every valid token is eligible here unless PPO clips it
    ratio = torch.exp(trainer - sampler)
    A_t = A[:, None].expand_as(trainer)
    per_token = torch.maximum(-A_t * ratio, -A_t * ratio.clamp(0.5, 1.5))
    clipped = (-A_t * ratio.clamp(0.5, 1.5)) > (-A_t * ratio)
    eligible = [tuple(i) for i in ((mask > 0) & ~clipped).nonzero().tolist()]
    k = max(int(0.2 * int(mask.sum())), 1)
    assert 0 < k < len(eligible)
    draws = []
    for chosen in itertools.combinations(eligible, k):
        keep = torch.ones_like(per_token)
        for b, t in chosen:
            keep[b, t] = 0.0
        draws.append(float((per_token * keep * mask).sum()))
    assert ours.item() == pytest.approx(float(np.mean(draws)), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# The mismatch chapter's sentences on the policy losses, read back against the exact tables
# ---------------------------------------------------------------------------------------------
def test_the_chapters_sentences_on_the_policy_losses():
    import pathlib
    import re

    from tests.helpers.committed import assert_matches_committed

    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "mismatch.md").read_text()
                    .split())
    n = r"([0-9.]+)"
    pattern = (r"`sapo`'s soft gate halves `token_is`'s bias near the anchor \(N against N\) and "
               r"damps the ratios that correct a large mismatch \(N against N\)\. `gmpo` is the "
               r"most biased of them at \$\\epsilon = 0.3\$ \(N\)\. `clip_cov` is "
               r"`ppo_clip_bypass` at \$\\epsilon = 0.3\$, where its band selects no token, and "
               r"without the dual clip it is further off at \$\\epsilon = 1\$ \(N against N\)\. "
               r"`luspo` keeps GSPO's one sequence weight with a clip of 0.2 \(N at "
               r"\$\\epsilon = 0.3\$, against `gspo`'s N\)\. `vespo` bounds its weight: the least "
               r"error of the five at \$\\epsilon = 0.3\$ \(N\) and the least variance of the "
               r"five at \$\\epsilon = 1\$ \(N\), for a bias near 1 there \(N\)")
    found = re.search(pattern.replace("N", n), page)
    assert found, "the sentence on the policy losses is not on the page"
    mild = {r["name"]: r for r in E.comparison_table(make_toy(), N=64)}
    far = {r["name"]: r for r in E.comparison_table(make_toy(mismatch=1.0), N=64, baseline=0.5)}
    computed = [mild["sapo"]["rel_bias"], mild["token_is"]["rel_bias"], far["sapo"]["rel_bias"],
                far["token_is"]["rel_bias"], mild["gmpo"]["rel_bias"], far["clip_cov"]["rel_bias"],
                far["ppo_clip_bypass"]["rel_bias"], mild["luspo"]["rel_bias"],
                mild["gspo"]["rel_bias"], mild["vespo"]["rel_rmse"], far["vespo"]["var"],
                far["vespo"]["rel_bias"]]
    assert_matches_committed(computed, [float(x) for x in found.groups()], rtol=0, atol=5e-4,
                             why="three decimals on the page: half a unit of the last")
    five = ("sapo", "gmpo", "clip_cov", "luspo", "vespo")
    assert max(five, key=lambda k: mild[k]["rel_bias"]) == "gmpo"
    assert min(five, key=lambda k: mild[k]["rel_rmse"]) == "vespo"
    assert min(five, key=lambda k: far[k]["var"]) == "vespo"
    assert mild["clip_cov"]["rel_bias"] == mild["ppo_clip_bypass"]["rel_bias"]  # nothing selected
