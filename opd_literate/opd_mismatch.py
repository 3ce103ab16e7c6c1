r"""The two labs meet: sampled-token OPD when the tokens come from a mismatched sampler.

Sampled-token OPD ([opd_literate.opd.opd_pg_loss][]) is a policy gradient, so it inherits the
training-inference mismatch: the student's tokens are written by the inference engine $\mu$,
while the gradient is wanted for the trainer's $\pi_\theta$. This module gives the toy of
[opd_literate.toy.make_toy][] a teacher and computes, exactly, the bias of the OPD gradient
under each recipe.

The teacher draws each position independently, $\pi_T(y_t = v) = \mathrm{softmax}(\phi_t)_v$.
The objective is the sequence reverse KL, which for independent positions is a sum of
per-position KLs, with the exact gradient (see [opd_literate.opd.full_vocab_reverse_kl][])

$$
\mathcal{K}(\theta) = \sum_t \mathrm{KL}(\pi_t \,\|\, \pi_{T,t}), \qquad
\frac{\partial \mathcal{K}}{\partial \theta_{t,v}}
= \pi_t(v) \big(\log \pi_t(v) - \log \pi_{T,t}(v) - \mathrm{KL}_t\big).
$$

Sampled-token OPD with discount 0 estimates it from one sampled sequence by
$\hat g_t = w_t\, d_t\, s_t$ with $d_t = \log \pi^{\mathrm{used}}(y_t) - \log \pi_T(y_t)$ (minus
the OPD reward) and the score $s_t = e_{y_t} - \pi_t$. The recipes differ in two choices:

* **which student log-probability enters the reward**: the sampler's $\log \mu(y_t)$, which the
  inference engine returns for free (``logp="sampler"``), or the trainer's recomputed
  $\log \pi_\theta(y_t)$ (``logp="trainer"``);
* **which weight**: none ($w_t = 1$), token-level truncated IS ($w_t = \min(\rho_t, C)$) or the
  plain token ratio ($w_t = \rho_t$).

Why ``logp="trainer", weight="token_is"`` is unbiased here, and only because the positions of
the toy are independent (one of the results listed in [opd_literate.toy][] that need it): the
estimate of row $t$ depends on $y_t$ alone, and under $\mu$ the marginal of $y_t$ is $\mu_t$,
so $\mathbb{E}_\mu[\rho_t f(y_t)] = \mathbb{E}_{\pi_t}[f(y_t)]$, while the objective is a sum
of per-position KLs. In an autoregressive model $\pi_t$ and $\mu_t$ depend on the prefix, which
the sampler also chose: the token ratio then corrects the last token only, and the recipe is
biased.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_finite_number
from .estimators import token_ratios, token_tis
from .toy import check_toy, estimator_moments, log_softmax, make_toy

__all__ = ["add_teacher", "opd_estimate", "OPD_RECIPES", "opd_mismatch_table"]

OPD_RECIPES = (
    ("trainer", "none"),
    ("sampler", "none"),
    ("trainer", "token_tis"),
    ("sampler", "token_tis"),
    ("trainer", "token_is"),
)
"""(logp, weight) pairs compared by [opd_literate.opd_mismatch.opd_mismatch_table][]."""


def add_teacher(toy, teacher_seed=1, scale=1.0):
    r"""A copy of ``toy`` with a teacher and the exact reverse-KL gradient.

    Adds ``phi`` (T, V) $\sim \mathcal{N}(0, \text{scale}^2)$ drawn from
    ``default_rng(teacher_seed)``, ``logp_teacher`` (M, T) $\log \pi_T(y_t)$, ``kl`` (the
    sequence reverse KL $\mathcal{K}$) and ``kl_grad`` (T, V) $\nabla_\theta \mathcal{K}$.

    Examples
    --------
    The gradient of a KL vanishes when the student is the teacher:

    >>> toy = make_toy(T=2, V=3)
    >>> same = add_teacher(toy, scale=0.0)  # phi = 0: a uniform teacher
    >>> same["kl"] > 0
    True
    >>> toy2 = dict(toy, theta=np.zeros((2, 3)))
    >>> round(float(np.abs(add_teacher(toy2, scale=0.0)["kl_grad"]).max()), 12)
    0.0
    """
    check_toy(toy, keys=("Y", "theta", "T", "V"))
    scale = check_finite_number("scale", scale)
    T, V = toy["T"], toy["V"]
    with np.errstate(over="ignore"):
        phi = np.random.default_rng(teacher_seed).normal(0.0, 1.0, size=(T, V)) * scale
        log_q = log_softmax(phi)
    if not np.isfinite(log_q).all():
        # A teacher probability of 0 makes the reverse KL infinite and its gradient NaN.
        raise ValueError(f"scale={scale!r} gives the teacher a token of probability 0 (its "
                         "logits overflow float64 or differ by more than it can represent); "
                         "use a smaller scale")
    log_pi = log_softmax(toy["theta"])
    pi = np.exp(log_pi)
    kl_t = (pi * (log_pi - log_q)).sum(axis=1)  # (T,)
    # d KL_t / d theta_t = pi_t * (log pi_t - log q_t - KL_t)
    kl_grad = pi * (log_pi - log_q - kl_t[:, None])
    logp_teacher = log_q[np.arange(T), toy["Y"]]  # (M, T)
    return dict(toy, phi=phi, logp_teacher=logp_teacher, kl=float(kl_t.sum()), kl_grad=kl_grad)


def opd_estimate(toy, logp="trainer", weight="none", cap=2.0):
    r"""Per-sequence sampled-token OPD gradient estimate, ``(M, T, V)``.

    $\hat g_{m,t} = w_{m,t}\, (\log \pi^{\mathrm{used}}(y_t) - \log \pi_T(y_t))\, s_{m,t}$.

    Parameters
    ----------
    toy : dict
        From [opd_literate.opd_mismatch.add_teacher][].
    logp : {"trainer", "sampler"}
        Which student log-probability enters the reward.
    weight : {"none", "token_tis", "token_is"}
    cap : float
        $C$ for ``token_tis``.

    Examples
    --------
    Without mismatch the recipes agree and are unbiased:

    >>> toy = add_teacher(make_toy(mismatch=0.0))
    >>> target = dict(toy, true_grad=toy["kl_grad"])
    >>> estimator_moments(target, opd_estimate(toy, "sampler"))["rel_bias"] < 1e-12
    True
    """
    check_toy(toy, keys=("logp_train", "logp_sampler", "logp_teacher", "score"))
    if logp not in ("trainer", "sampler"):
        raise ValueError(f"logp must be 'trainer' or 'sampler', got {logp!r}")
    if weight not in ("none", "token_tis", "token_is"):
        raise ValueError(f"weight must be 'none', 'token_tis' or 'token_is', got {weight!r}")
    cap = check_finite_number("cap", cap, positive=True, allow_inf=True)
    student_logp = toy["logp_train"] if logp == "trainer" else toy["logp_sampler"]
    # d_t = log pi_student(y_t) - log pi_T(y_t) = -r_t, the OPD reward with its sign flipped
    d = student_logp - toy["logp_teacher"]
    if weight == "none":
        w = 1.0
    elif weight == "token_tis":
        w = token_tis(toy, cap, return_weights=True)  # min(rho_t, C)
    else:
        w = token_ratios(toy)  # rho_t
    with np.errstate(over="ignore"):
        weighted = w * d  # (M, T)
    if not np.isfinite(weighted).all():
        raise ValueError(f"the weights times the log-probability gaps overflow float64 "
                         f"(weight={weight!r}, largest gap {float(np.abs(d).max()):.3g}); use a "
                         "smaller teacher scale or mismatch")
    # |s_t| <= 1, so this product cannot overflow
    return weighted[:, :, None] * toy["score"]


def opd_mismatch_table(mismatches, T=6, V=4, seed=0, teacher_seed=1, cap=2.0, N=64):
    r"""Exact relative bias and RMSE of every recipe in ``OPD_RECIPES``, per mismatch.

    Returns a list of rows ``{"mismatch", "logp", "weight", "rel_bias", "rel_rmse"}``, the
    error measured against $\nabla_\theta \mathcal{K}$.

    Examples
    --------
    >>> rows = opd_mismatch_table([0.0, 0.5])
    >>> [(r["logp"], r["weight"]) for r in rows if r["mismatch"] == 0.5 and r["rel_bias"] < 1e-12]
    [('trainer', 'token_is')]
    """
    rows = []
    for mismatch in mismatches:
        toy = add_teacher(make_toy(T=T, V=V, mismatch=mismatch, seed=seed), teacher_seed)
        target = dict(toy, true_grad=toy["kl_grad"])
        for logp, weight in OPD_RECIPES:
            moments = estimator_moments(target, opd_estimate(toy, logp, weight, cap))
            rows.append(dict(mismatch=float(mismatch), logp=logp, weight=weight,
                             rel_bias=moments["rel_bias"], rel_rmse=moments["rel_rmse"](N)))
    return rows
