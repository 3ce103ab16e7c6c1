r"""Rejected answers in a group baseline: GRPO and RLOO when rejection masks part of a group.

GRPO and RLOO draw $G$ answers $y_1, \dots, y_G$ for one prompt, i.i.d. from the sampler $\mu$,
and centre each answer's reward on the group's rewards. A sequence-level rejection of
[opd_literate.mismatch.estimators][] (``seq_mis``, ``geo_rs``, ``token_veto``, ``k3_seq_rs``)
then drops some answers from the gradient. Whether the dropped answers' rewards still enter the
group's mean and standard deviation is a choice, and frameworks make it differently. This module
computes, exactly on the enumerable toys of [opd_literate.mismatch.toy][], the mean, bias and
variance that each choice gives.

**The estimator.** Answer $i$ has the reward $R_i = R(y_i)$, the keep indicator $k_i = k(y_i)
\in \{0, 1\}$ of the rejection, the weight $w_i = w(y_i)$ (0 where rejected: $\rho$ for
``seq_mis``, 1 for the pure rejections) and the score $s(y_i) = \nabla_\theta \log \pi(y_i)$
(the ``(T, V)`` rows of ``toy["score"]``). With a group advantage $A_i$ the group's estimate of
$\nabla J = \nabla_\theta \mathbb{E}_\pi[R]$ is

$$
\hat g = \frac1G \sum_{i=1}^{G} k_i\, w_i\, A_i\, s(y_i) .
$$

The normaliser $1/G$ is a constant, so that $\hat g$ is on the scale of $\nabla J$ (the sum
over the group is $G \hat g$: its bias is $G$ times, its variance $G^2$ times, that of
$\hat g$). verl's ``token-mean`` loss divides by the number of kept tokens instead, a random
normaliser left out here.

**The six baselines** (``BASELINES``). Each is computed over the set $S$ of the group's answers
(``_all``: every answer, rejected ones included; ``_kept``: the kept ones only), with $n = |S|$,
$\bar R_S = \frac1n \sum_{j \in S} R_j$ and the sample standard deviation $\sigma_S$ (divisor
$n - 1$, as ``torch.std``), for a kept answer $i \in S$:

$$
\begin{aligned}
A^{\mathrm{grpo}}_i &= R_i - \bar R_S, \qquad
A^{\mathrm{grpo\_std}}_i = \frac{R_i - \bar R_S}{\sigma_S + \varepsilon}, \\
A^{\mathrm{rloo}}_i &= R_i - \frac{1}{n - 1} \sum_{j \in S,\, j \ne i} R_j
= \frac{n R_i - \sum_{j \in S} R_j}{n - 1} .
\end{aligned}
$$

A set of one answer gets the mean 0 and the standard deviation 1, as verl 0.9.1's
``compute_grpo_outcome_advantage`` and ``compute_rloo_outcome_advantage`` treat a prompt with one
answer: then $A_i = R_i$ (``grpo``, ``rloo``) or $R_i / (1 + \varepsilon)$ (``grpo_std``;
verl adds $\varepsilon$ to a float32 1, which makes it $1 + 2^{-20}$, a relative difference of
$5 \cdot 10^{-8}$).
So the ``_kept`` choices are verl's functions applied to the kept answers alone, and the
``_all`` choices are what verl computes (below). A rejected answer's advantage is 0.

**Exact sums over groups.** The group is a random element of $\mathcal{Y}^G$ with probability
$\prod_i \mu(y_i)$, so every moment of $\hat g$ is a sum over the $M^G$ ordered groups
(``method="ordered"``, the brute force). Each of the six advantages is permutation-equivariant
(the statistics of $S$ are symmetric functions of its rewards), so $\hat g$ is a symmetric
function of $(y_1, \dots, y_G)$: all orderings of one multiset of answers give the same
estimate. A multiset with counts $c_1, \dots, c_M$ ($\sum_m c_m = G$) is drawn with probability
$\frac{G!}{\prod_m c_m!} \prod_m \mu(y_m)^{c_m}$, so the same sums run over the
$\binom{M + G - 1}{G}$ multisets (``method="multisets"``, the default; 330 instead of 4096 for
$M = 8$, $G = 4$). Both are exact; the tests check that they agree.

**Means in closed form.** Write, for one answer $y \sim \mu$,

$$
p = \mathbb{E}_\mu[k], \quad
\bar r = \mathbb{E}_\mu[R], \quad
\bar r_K = \mathbb{E}_\mu[R \mid k = 1], \quad
g_K = \mathbb{E}_\mu[k\, w\, R\, s], \quad
h_K = \mathbb{E}_\mu[k\, w\, s] .
$$

$g_K$ is the mean of the single-answer rejection estimator with baseline 0 (``seq_mis(toy)``
and the others of the catalogue), and a constant baseline $b$ gives $g_K - b\, h_K$. With
$w = \rho$, $g_K = \sum_y \pi(y) k(y) R(y) s(y)$ and $h_K = \sum_y \pi(y) k(y) s(y)$: the
gradients of $\mathbb{E}_\pi[kR]$ and of $P_\pi(k = 1)$ with $k$ held fixed. $h_K$ is not 0 in
general: the kept answers' scores do not average to 0, and a baseline is no longer free.

*A leave-one-out baseline.* If $b_i$ is a function of the other answers $(y_j)_{j \ne i}$ only,
it is independent of $y_i$, and

$$
\mathbb{E}[k_i w_i (R_i - b_i) s(y_i)] = g_K - \mathbb{E}[b_i]\, h_K ,
$$

so the baseline acts as the constant $\mathbb{E}[b_i]$. Both RLOO choices have such a baseline:
``rloo_all`` averages the $G - 1$ other rewards, rejected ones included, with
$\mathbb{E}[b_i] = \bar r$; ``rloo_kept`` averages the other kept rewards, or is 0 when no
other answer is kept. The number $K_{-i}$ of the other answers kept is Binomial$(G - 1, p)$, and
given $K_{-i} = j \ge 1$ the kept ones are i.i.d. from $\mu$ conditioned on $k = 1$, so
$\mathbb{E}[b_i] = \bar r_K (1 - (1 - p)^{G - 1})$. With the **rejection-restricted target**

$$
C_K = g_K - \bar r_K\, h_K = p\, \mathrm{Cov}_{\mu}(R,\, w\, s \mid k = 1)
$$

(the single-answer estimator with the kept answers' mean reward as its baseline), this gives

$$
\begin{aligned}
\mathbb{E}[\hat g_{\mathrm{rloo\_kept}}] &= C_K + (1 - p)^{G - 1}\, \bar r_K\, h_K, \\
\mathbb{E}[\hat g_{\mathrm{rloo\_all}}] &= C_K + (\bar r_K - \bar r)\, h_K .
\end{aligned}
$$

So each kept answer's term of the kept-only RLOO is unbiased for $C_K$ given that another
answer of its group is kept, and the estimator's bias against $C_K$ vanishes as
$(1 - p)^{G - 1}$ with the group size. Including a rejected
answer's reward keeps the baseline independent of the answer, but centres it at the mean reward
of *all* the sampler's answers, $\bar r$, where the kept answers' gradient is centred at
$\bar r_K$: a bias of $(\bar r_K - \bar r)\, h_K$ that does not shrink with $G$. It is 0 only
if the rejection is uncorrelated with the reward ($\bar r_K = \bar r$, as when nothing is
rejected) or $h_K = 0$ (as when nothing is rejected and $w = \rho$: then $C_K = \nabla J$ and
both are unbiased for $\nabla J$).

*GRPO's mean includes the answer itself.* Over all $G$ answers,
$R_i - \bar R = \frac{G - 1}{G} (R_i - \frac{1}{G - 1} \sum_{j \ne i} R_j)$, so
$\hat g_{\mathrm{grpo\_all}} = \frac{G - 1}{G} \hat g_{\mathrm{rloo\_all}}$ group by group, and
its mean is $\frac{G - 1}{G} (g_K - \bar r h_K)$. Over the kept answers the factor is
$j / (j + 1)$ with $j = K_{-i}$ (and $A_i = R_i$ for $j = 0$), and for $X \sim$
Binomial$(n, p)$, $\mathbb{E}[\frac{1}{1 + X}] = \frac{1 - (1 - p)^{n + 1}}{(n + 1) p}$
(shift the sum's index: $\binom{n}{j} \frac{1}{j + 1} = \binom{n + 1}{j + 1}
\frac{1}{n + 1}$), so

$$
\begin{aligned}
\mathbb{E}[\hat g_{\mathrm{grpo\_kept}}]
&= (1 - p)^{G - 1} g_K + \sum_{j=1}^{G-1} \binom{G - 1}{j} p^j (1 - p)^{G - 1 - j}
\frac{j}{j + 1}\, C_K \\
&= (1 - p)^{G - 1} g_K + \Big(1 - \frac{1 - (1 - p)^G}{G p}\Big) C_K ,
\end{aligned}
$$

which approaches $C_K$ only as $1/G$: $G\, (\mathbb{E}[\hat g_{\mathrm{grpo\_kept}}] - C_K)
\to -C_K / p$.

[opd_literate.mismatch.groups.closed_form_mean][] computes these four; the tests check them
against the enumeration. Dividing by $\sigma_S$ makes the advantage a nonlinear function of the
whole group: the ``grpo_std`` choices have no such formula, only the enumeration (and a mean on
the scale of $\nabla J / \sigma$, not of $\nabla J$). With rewards in $\{0, 1\}$, though, every
``_all`` choice has $A_i = f_c\, (R_i - c / G)$ with $c$ the number of 1s in the group and
$f_c > 0$ ($1$, $G / (G - 1)$ or $1 / (\sigma_c + \varepsilon)$). Given $R_i$, $y_i$ is
independent of the others' rewards, and $\binom{G-1}{c-1}(G - c) = \binom{G-1}{c}\, c$ makes
the groups with $c$ ones contribute a non-negative multiple of the same vector, so each
``_all`` mean is a positive multiple of
$\mathbb{E}_\mu[k w s \mid R = 1] - \mathbb{E}_\mu[k w s \mid R = 0]$: on such rewards the
standard deviation rescales the mean of ``grpo_all`` but does not turn it.

**None of them is unbiased for $\nabla J$ under rejection.** $C_K$ is not $\nabla J$: with
$w = \rho$ it is

$$
C_K = P_\pi(k = 1)\, \nabla_\theta \mathbb{E}_\pi[R \mid k = 1]
      + (\mathbb{E}_\pi[R \mid k = 1] - \bar r_K)\, h_K
$$

($k$ held fixed), the gradient for the kept answers' distribution.
Which baseline is closer to $\nabla J$ depends on the toy: on one position with
$\pi = (0.5, 0.5)$, $\mu = (0.8, 0.2)$ and the band $\rho \le 2$, the rejected token is the one
with reward 0, every kept answer has reward 1, and the kept-only baselines cancel almost all of
the gradient (examples of [opd_literate.mismatch.groups.closed_form_mean][]).

**What verl 0.9.1 does: the ``_all`` choices.** In the decoupled mode the rejection of
``rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` writes its mask into
``response_mask`` (``verl/trainer/ppo/rollout_corr_helper.py`` line 1061) before the advantages
are computed (``verl/trainer/ppo/ray_trainer.py`` lines 1658 and 1667;
``verl/trainer/ppo/v1/trainer_base.py`` lines 1771 and 1775), but
``compute_grpo_outcome_advantage`` and ``compute_rloo_outcome_advantage`` group every row by its
``uid`` with its summed ``token_level_rewards``, whatever its mask
(``verl/trainer/ppo/core_algos.py`` lines 304 and 313, 612 and 620), and apply the mask only to
the result (lines 329 and 634). In the legacy trainer's bypass mode (``trainer.use_v1: false``)
the rejection is applied inside the policy loss (``core_algos.py`` line 2514), after the
advantages; the default trainer's bypass mode rejects nothing. So verl's ``grpo`` is
``grpo_std_all`` (``grpo_all`` with ``norm_adv_by_std_in_grpo=False``) and its ``rloo`` is
``rloo_all`` (``VERL_CHOICES``; ``tests/integration/test_verl_group_baseline.py`` runs verl's
functions on a batch with a rejected answer).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .._numerics import check_finite_number, check_real_array
from .estimators import estimator_weights, seq_mis  # noqa: F401 (the examples use seq_mis)
from .toy import check_toy, estimator_moments, toy_from_logits  # noqa: F401 (the examples)

__all__ = [
    "BASELINES",
    "REJECTIONS",
    "VERL_EPSILON",
    "VERL_CHOICES",
    "MAX_GROUP_ENTRIES",
    "group_advantages",
    "rejection_weights",
    "enumerate_groups",
    "kept_statistics",
    "group_estimates",
    "group_moments",
    "closed_form_mean",
    "group_table",
]

BASELINES = ("grpo_all", "grpo_kept", "grpo_std_all", "grpo_std_kept", "rloo_all", "rloo_kept")
"""The group baselines: GRPO's mean, GRPO's mean and standard deviation, RLOO's leave-one-out
mean, each over all the group's answers (``_all``) or over the kept ones (``_kept``)."""

REJECTIONS = ("seq_mis", "geo_rs", "token_veto", "k3_seq_rs")
"""The sequence-level rejections of [opd_literate.mismatch.estimators.REGISTRY][]: one weight a
response, 0 where it is rejected, whatever the advantage."""

VERL_EPSILON = 1e-6
r"""$\varepsilon$ of ``grpo_std``: the default ``epsilon`` of verl 0.9.1's
``compute_grpo_outcome_advantage``."""

VERL_CHOICES = {"grpo": "grpo_std_all", "grpo_no_std": "grpo_all", "rloo": "rloo_all"}
"""What verl 0.9.1 computes when rejection masks answers: ``adv_estimator: grpo`` (with
``norm_adv_by_std_in_grpo: false``: ``grpo_no_std``) and ``adv_estimator: rloo``."""

MAX_GROUP_ENTRIES = 2**22
"""The most values (groups times parameters) an enumeration builds: 32 MiB of float64."""

_METHODS = ("multisets", "ordered")


# ---------------------------------------------------------------------------------------------
# Advantages of one group
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards, kept, baseline, eps=VERL_EPSILON):
    r"""The advantages $A_i$ of the answers of groups, 0 for the rejected ones.

    Parameters
    ----------
    rewards : array_like
        ``(..., G)`` finite rewards; the last axis is the group.
    kept : array_like of bool
        ``(..., G)``, the shape of ``rewards``: True where the answer is kept.
    baseline : str
        One of ``BASELINES`` (module docstring for the formulas).
    eps : float
        $\varepsilon > 0$ of the ``grpo_std`` choices.

    Returns
    -------
    numpy.ndarray
        ``(..., G)`` float64.

    Examples
    --------
    Four answers with rewards $(1, 0, 1, 0)$, the last rejected. Over all four, RLOO's
    baseline for answer 1 is $(0 + 1 + 0) / 3$; over the three kept, $(0 + 1) / 2$:

    >>> r, kept = [1.0, 0.0, 1.0, 0.0], [True, True, True, False]
    >>> group_advantages(r, kept, "rloo_all").round(4).tolist()
    [0.6667, -0.6667, 0.6667, 0.0]
    >>> group_advantages(r, kept, "rloo_kept").round(4).tolist()
    [0.5, -1.0, 0.5, 0.0]

    GRPO's mean is 1/2 over all four, 2/3 over the kept; the sample standard deviation of
    $(1, 0, 1, 0)$ is $\sqrt{1/3}$, so $0.5 / \sqrt{1/3} = 0.866$:

    >>> group_advantages(r, kept, "grpo_all").round(4).tolist()
    [0.5, -0.5, 0.5, 0.0]
    >>> group_advantages(r, kept, "grpo_kept").round(4).tolist()
    [0.3333, -0.6667, 0.3333, 0.0]
    >>> group_advantages(r, kept, "grpo_std_all").round(4).tolist()
    [0.866, -0.866, 0.866, 0.0]

    A kept answer alone in its set gets the baseline 0, as verl's one-answer prompt:

    >>> group_advantages([1.0, 0.0], [True, False], "rloo_kept").tolist()
    [1.0, 0.0]
    """
    r = check_real_array("rewards", rewards, ndim=None, min_size=1)
    if r.ndim < 1:
        raise ValueError(f"rewards must have shape (..., G), got a scalar {r.tolist()!r}")
    k = np.asarray(kept)
    if k.dtype != bool:
        raise TypeError(f"kept must be a bool array, got dtype {k.dtype}")
    if k.shape != r.shape:
        raise ValueError(f"kept must have the shape of rewards {r.shape}, got {k.shape}")
    _check_baseline(baseline)
    eps = check_finite_number("eps", eps, positive=True)
    with np.errstate(over="ignore", invalid="ignore"):
        advantages = _advantages(r, k, baseline, eps)
    if not np.isfinite(advantages).all():
        raise ValueError(f"the advantages overflow float64: rewards up to "
                         f"{float(np.abs(r).max()):.3g} are too large for the group's sums")
    return advantages


def _advantages(r, k, baseline, eps):
    """The advantages of checked (..., G) rewards and bool keep flags."""
    family, over = baseline.rsplit("_", 1)  # "grpo" | "grpo_std" | "rloo", "all" | "kept"
    member = k if over == "kept" else np.ones_like(k)  # the set S of the statistics
    n = member.sum(axis=-1, keepdims=True)  # (..., 1): |S|
    total = np.where(member, r, 0.0).sum(axis=-1, keepdims=True)
    alone = n <= 1  # verl's one-answer prompt: mean 0, std 1
    many = np.maximum(n, 2)  # a divisor that is never 0 or 1 where it is used
    if family == "rloo":
        # R_i - mean of the others in S = (n R_i - sum_S R) / (n - 1)
        advantage = np.where(alone, r, (n * r - total) / (many - 1))
    else:
        mean = np.where(alone, 0.0, total / many)
        advantage = r - mean
        if family == "grpo_std":
            # the sample standard deviation (divisor n - 1, as torch.std) over S
            squares = np.where(member, (r - mean) ** 2, 0.0).sum(axis=-1, keepdims=True)
            std = np.where(alone, 1.0, np.sqrt(squares / (many - 1)))
            if not np.isfinite(std).all():  # A / inf would be a silent 0
                raise ValueError(f"the advantages overflow float64: rewards up to "
                                 f"{float(np.abs(r).max()):.3g} are too large for the group's "
                                 "squared deviations")
            advantage = advantage / (std + eps)
    return np.where(k, advantage, 0.0)  # a rejected answer trains nothing


def _check_baseline(baseline):
    if not isinstance(baseline, str) or baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")


# ---------------------------------------------------------------------------------------------
# The rejection's weights and the statistics of one answer
# ---------------------------------------------------------------------------------------------
def rejection_weights(toy, name, **params):
    r"""The ``(M,)`` weights $w(y)$ of a sequence-level rejection of the catalogue.

    ``name`` is one of ``REJECTIONS``; ``params`` override its defaults
    ([opd_literate.mismatch.estimators.estimator_weights][]). The answer is kept where the
    weight is not 0.

    Examples
    --------
    Two positions, $\pi_t = (0.5, 0.5)$, $\mu_t = (0.8, 0.2)$: $\rho = (0.390625, 1.5625,
    1.5625, 6.25)$, and the band $[0.5, 2]$ rejects the first and the last:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> rejection_weights(two, "seq_mis", low=0.5, high=2.0).tolist()
    [0.0, 1.5625, 1.5625, 0.0]
    >>> rejection_weights(two, "geo_rs", low=0.8, high=1.3).tolist()
    [0.0, 1.0, 1.0, 0.0]
    """
    if name not in REJECTIONS:
        raise ValueError(f"name must be a sequence-level rejection, one of {REJECTIONS}, got "
                         f"{name!r}")
    # one weight a response: estimator_weights repeats it over the positions
    return np.array(estimator_weights(toy, name, **params)[:, 0], dtype=float)


def _check_weights(toy, weights):
    M = toy["p_sampler"].shape[0]
    w = check_real_array("weights", weights, ndim=1)
    if w.shape != (M,):
        raise ValueError(f"weights must have shape (M,) = ({M},), one a response, got {w.shape}")
    if (w < 0).any():
        raise ValueError(f"weights must be >= 0, got {float(w[w < 0][0])!r} at index "
                         f"{int(np.argmax(w < 0))}")
    return w


def _check_group_inputs(toy, weights, G, baseline):
    """The checks every group function starts with: ``(weights, G)`` as checked."""
    check_toy(toy, keys=("p_sampler", "R", "score", "true_grad"))
    w = _check_weights(toy, weights)
    G = _check_group_size(G)
    _check_baseline(baseline)
    return w, G


def _check_group_size(G):
    if isinstance(G, bool) or not isinstance(G, (int, np.integer)):
        raise TypeError(f"G must be an integer, got {G!r}")
    if G < 2:
        raise ValueError(f"G must be >= 2 (a group), got {G}")
    return int(G)


def kept_statistics(toy, weights):
    r"""The single-answer quantities of the closed forms: $p$, $\bar r$, $\bar r_K$, $g_K$,
    $h_K$ and the rejection-restricted target $C_K = g_K - \bar r_K h_K$.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.toy.make_toy][] or ``make_ar_toy``.
    weights : array_like
        ``(M,)`` weights $w(y) \ge 0$; the answer is kept where $w > 0$.

    Returns
    -------
    dict
        ``p``, ``reward_mean`` ($\bar r$), ``kept_reward_mean`` ($\bar r_K$, 0 if nothing is
        kept), floats; ``kept_gradient`` ($g_K$), ``kept_score_mean`` ($h_K$) and ``target``
        ($C_K$), each of the shape of ``toy["true_grad"]``.

    Examples
    --------
    One position, $\pi = (0.5, 0.5)$, $\mu = (0.8, 0.2)$, $R = (1, 0)$; ``seq_mis`` with the
    band $[0, 2]$ keeps token 0 only ($\rho = 0.625$). Every kept answer has reward 1, so the
    target $C_K$ is 0, and $h_K = 0.8 \cdot 0.625 \cdot (0.5, -0.5)$:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    >>> stats = kept_statistics(one, seq_mis(one, high=2.0, return_weights=True))
    >>> round(stats["p"], 12), round(stats["reward_mean"], 12), stats["kept_reward_mean"]
    (0.8, 0.8, 1.0)
    >>> stats["kept_score_mean"].round(12).tolist(), stats["target"].round(12).tolist()
    ([[0.25, -0.25]], [[0.0, 0.0]])
    """
    check_toy(toy, keys=("p_sampler", "R", "score", "true_grad"))
    w = _check_weights(toy, weights)
    return _kept_statistics(toy, w)


def _kept_statistics(toy, w):
    mu, R = toy["p_sampler"], toy["R"]
    kept = w > 0
    shape = toy["score"].shape[1:]
    S = toy["score"].reshape(len(mu), -1)  # (M, parameters)
    p = float(mu @ kept)
    kept_reward_mean = float((mu * kept) @ R / p) if p > 0 else 0.0
    g = ((mu * w * R) @ S).reshape(shape)  # E_mu[k w R s]
    h = ((mu * w) @ S).reshape(shape)      # E_mu[k w s]
    return dict(p=p, reward_mean=float(mu @ R), kept_reward_mean=kept_reward_mean,
                kept_gradient=g, kept_score_mean=h, target=g - kept_reward_mean * h)


# ---------------------------------------------------------------------------------------------
# Exact sums over the groups
# ---------------------------------------------------------------------------------------------
def enumerate_groups(p_sampler, G, method="multisets"):
    r"""Every group of $G$ answers with its probability: ``(groups, probability)``.

    ``method="ordered"``: the $M^G$ ordered groups, probability $\prod_i \mu(y_i)$
    (``itertools.product`` order). ``method="multisets"``: the $\binom{M + G - 1}{G}$ multisets
    (sorted indices), probability $\frac{G!}{\prod_m c_m!} \prod_i \mu(y_i)$, which is the
    total probability of its orderings.

    Parameters
    ----------
    p_sampler : array_like
        ``(M,)`` probabilities $\mu(y)$.
    G : int
        The group size, >= 2.
    method : str
        ``"multisets"`` or ``"ordered"``.

    Returns
    -------
    groups : numpy.ndarray
        ``(N, G)`` int64 indices of the answers.
    probability : numpy.ndarray
        ``(N,)``.

    Examples
    --------
    Two answers, $\mu = (0.8, 0.2)$: the multiset $\{0, 1\}$ holds both orderings,
    $2 \cdot 0.8 \cdot 0.2$:

    >>> groups, prob = enumerate_groups([0.8, 0.2], 2)
    >>> groups.tolist(), prob.round(12).tolist()
    ([[0, 0], [0, 1], [1, 1]], [0.64, 0.32, 0.04])
    >>> enumerate_groups([0.8, 0.2], 2, method="ordered")[1].round(12).tolist()
    [0.64, 0.16, 0.16, 0.04]
    """
    mu = check_real_array("p_sampler", p_sampler, ndim=1, min_size=1)
    if (mu < 0).any():
        raise ValueError("p_sampler must be >= 0")
    G = _check_group_size(G)
    _check_method(method)
    _check_count(_group_count(len(mu), G, method), 1, len(mu), G, method)
    return _enumerate(mu, G, method)


def _enumerate(mu, G, method):
    M = len(mu)
    if method == "ordered":
        groups = np.array(list(itertools.product(range(M), repeat=G)), dtype=np.int64)
        return groups, np.prod(mu[groups], axis=1)
    groups = np.array(list(itertools.combinations_with_replacement(range(M), G)),
                      dtype=np.int64)
    # G! / prod_m c_m!: the orderings of the multiset
    counts = np.stack([np.bincount(g, minlength=M) for g in groups])  # (N, M)
    log_fact = np.array([math.lgamma(c + 1) for c in range(G + 1)])
    orderings = np.rint(np.exp(math.lgamma(G + 1) - log_fact[counts].sum(axis=1)))
    return groups, orderings * np.prod(mu[groups], axis=1)


def _group_count(M, G, method):
    return M**G if method == "ordered" else math.comb(M + G - 1, G)


def _check_count(N, parameters, M, G, method):
    """Refuse, before building anything, an enumeration above MAX_GROUP_ENTRIES values."""
    if N * parameters > MAX_GROUP_ENTRIES:
        raise ValueError(
            f"G={G} answers of M={M} responses give {N:,} groups ({method}) times {parameters} "
            f"parameters, above MAX_GROUP_ENTRIES = {MAX_GROUP_ENTRIES:,}; use a smaller toy, "
            "a smaller G or method='multisets'"
        )


def _check_method(method):
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def group_estimates(toy, weights, G, baseline, eps=VERL_EPSILON, method="multisets"):
    r"""The estimate $\hat g$ of every group and the group's probability.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.toy.make_toy][] or ``make_ar_toy``.
    weights : array_like
        ``(M,)`` weights $w(y) \ge 0$, 0 where rejected (``rejection_weights``).
    G : int
        The group size, >= 2.
    baseline : str
        One of ``BASELINES``.
    eps : float
        $\varepsilon$ of ``grpo_std``.
    method : str
        ``"multisets"`` (default) or ``"ordered"`` (``enumerate_groups``).

    Returns
    -------
    probability : numpy.ndarray
        ``(N,)``.
    estimates : numpy.ndarray
        ``(N,) + toy["true_grad"].shape``.

    Examples
    --------
    One position, $\mu = (0.8, 0.2)$, nothing rejected ($w = \rho = (0.625, 2.5)$), $G = 2$.
    The group $\{0, 1\}$ has RLOO advantages $\pm 1$; both scores are $\pm (0.5, -0.5)$, so
    $\hat g = \frac12 (0.625 + 2.5) (0.5, -0.5)$:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    >>> prob, est = group_estimates(one, [0.625, 2.5], 2, "rloo_all")
    >>> prob.round(12).tolist(), est[1].round(6).tolist()
    ([0.64, 0.32, 0.04], [[0.78125, -0.78125]])
    """
    w, G = _check_group_inputs(toy, weights, G, baseline)
    eps = check_finite_number("eps", eps, positive=True)
    _check_method(method)
    return _group_estimates(toy, w, G, baseline, eps, method)


def _group_estimates(toy, w, G, baseline, eps, method):
    mu = toy["p_sampler"]
    S = toy["score"].reshape(len(mu), -1)  # (M, parameters)
    _check_count(_group_count(len(mu), G, method), S.shape[1], len(mu), G, method)
    groups, probability = _enumerate(mu, G, method)  # (N, G), (N,)
    advantage = _advantages(toy["R"][groups], w[groups] > 0, baseline, eps)  # (N, G)
    # g = (1/G) sum_i k_i w_i A_i s(y_i); w_i = 0 where rejected
    coefficient = w[groups] * advantage / G  # (N, G)
    estimates = np.zeros((len(groups), S.shape[1]))
    for i in range(G):
        estimates += coefficient[:, i, None] * S[groups[:, i]]
    return probability, estimates.reshape((len(groups),) + toy["score"].shape[1:])


def group_moments(toy, weights, G, baseline, eps=VERL_EPSILON, method="multisets"):
    r"""Exact mean, bias and variance of the group estimate $\hat g$ of one baseline.

    The moments of [opd_literate.mismatch.toy.estimator_moments][] over the groups: ``mean``,
    ``bias`` $= \lVert \mathbb{E}\hat g - \nabla J \rVert$, ``var`` (total variance of one
    group's estimate), ``rel_bias``, ``rel_rmse`` (a function of the number of groups $N$);
    and ``target_bias`` $= \lVert \mathbb{E}\hat g - C_K \rVert$, against the
    rejection-restricted target, and ``cosine``, that of $\mathbb{E}\hat g$ with $\nabla J$
    (scale-free: the ``grpo_std`` means are on the scale of $\nabla J / \sigma$).

    Parameters
    ----------
    toy, weights, G, baseline, eps, method
        As for [opd_literate.mismatch.groups.group_estimates][].

    Returns
    -------
    dict

    Examples
    --------
    Nothing rejected and $w = \rho$: RLOO is unbiased for $\nabla J$ (here
    $0.5 \cdot (0.5, -0.5)$); GRPO's mean shrinks it by $(G - 1) / G$:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    >>> rho = [0.625, 2.5]
    >>> group_moments(one, rho, 4, "rloo_all")["mean"].round(12).tolist()
    [[0.25, -0.25]]
    >>> group_moments(one, rho, 4, "grpo_all")["mean"].round(12).tolist()
    [[0.1875, -0.1875]]
    """
    w, G = _check_group_inputs(toy, weights, G, baseline)
    eps = check_finite_number("eps", eps, positive=True)
    _check_method(method)
    probability, estimates = _group_estimates(toy, w, G, baseline, eps, method)
    over_groups = {"p_sampler": probability, "true_grad": toy["true_grad"]}
    moments = estimator_moments(over_groups, estimates)
    target = _kept_statistics(toy, w)["target"]
    mean, true = moments["mean"].ravel(), np.asarray(toy["true_grad"]).ravel()
    norms = float(np.linalg.norm(mean) * np.linalg.norm(true))
    return dict(moments, target_bias=float(np.linalg.norm(moments["mean"] - target)),
                cosine=float(mean @ true / norms) if norms > 0 else 0.0)


def closed_form_mean(toy, weights, G, baseline):
    r"""$\mathbb{E}[\hat g]$ of ``grpo_all``, ``grpo_kept``, ``rloo_all`` or ``rloo_kept`` from
    the single-answer statistics, without enumerating the groups (module docstring).

    Raises
    ------
    ValueError
        For ``grpo_std_all`` and ``grpo_std_kept``, which have no closed form here.

    Examples
    --------
    The one-position toy of ``kept_statistics``: the band $\rho \le 2$ rejects the answer with
    reward 0, $p = 0.8$, $\bar r = 0.8$, $\bar r_K = 1$, $C_K = 0$ and
    $h_K = (0.25, -0.25) = \nabla J$. RLOO over all answers keeps $(\bar r_K - \bar r) h_K
    = 0.2\, h_K$ at every $G$; over the kept answers $(1 - p)^{G - 1} h_K$, $0.04\, h_K$
    at $G = 3$:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    >>> w = seq_mis(one, high=2.0, return_weights=True)
    >>> closed_form_mean(one, w, 3, "rloo_all").round(12).tolist()
    [[0.05, -0.05]]
    >>> closed_form_mean(one, w, 3, "rloo_kept").round(12).tolist()
    [[0.01, -0.01]]
    >>> group_moments(one, w, 3, "rloo_kept")["mean"].round(12).tolist()
    [[0.01, -0.01]]
    """
    w, G = _check_group_inputs(toy, weights, G, baseline)
    if baseline.startswith("grpo_std"):
        raise ValueError(f"{baseline} has no closed form (the standard deviation of the group "
                         "is nonlinear in its rewards); use group_moments")
    stats = _kept_statistics(toy, w)
    p, g, h, target = stats["p"], stats["kept_gradient"], stats["kept_score_mean"], stats["target"]
    alone = (1 - p) ** (G - 1)  # no other answer of the group is kept
    if baseline == "rloo_all":
        return g - stats["reward_mean"] * h
    if baseline == "grpo_all":
        return (G - 1) / G * (g - stats["reward_mean"] * h)
    if baseline == "rloo_kept":
        return alone * g + (1 - alone) * target
    if p == 0:  # nothing is ever kept: the estimate is 0
        return np.zeros_like(g)
    # grpo_kept: E[j / (j + 1)] over j ~ Binomial(G - 1, p) is 1 - (1 - (1 - p)^G) / (G p)
    return alone * g + (1 - (1 - (1 - p) ** G) / (G * p)) * target


def group_table(toy, weights, G, baselines=BASELINES, eps=VERL_EPSILON, N=64):
    r"""One row of ``group_moments`` a baseline, for the chapter's table.

    Each row: ``baseline``, ``bias``, ``rel_bias``, ``target_bias``, ``cosine``, ``var``,
    ``rel_rmse`` (for ``N`` groups) and ``verl`` (True for the choices in ``VERL_CHOICES``).

    Examples
    --------
    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    >>> rows = group_table(one, [0.625, 2.5], 3, baselines=["rloo_all", "rloo_kept"])
    >>> [(r["baseline"], round(r["bias"], 12), r["verl"]) for r in rows]
    [('rloo_all', 0.0, True), ('rloo_kept', 0.0, False)]
    """
    baselines = list(baselines) if not isinstance(baselines, str) else [baselines]
    for baseline in baselines:
        _check_baseline(baseline)
    rows = []
    for baseline in baselines:
        moments = group_moments(toy, weights, G, baseline, eps)
        rows.append(dict(baseline=baseline, bias=moments["bias"], rel_bias=moments["rel_bias"],
                         target_bias=moments["target_bias"], cosine=moments["cosine"],
                         var=moments["var"], rel_rmse=moments["rel_rmse"](N),
                         verl=baseline in VERL_CHOICES.values()))
    return rows
