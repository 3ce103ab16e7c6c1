r"""The two labs meet: sampled-token OPD when the tokens come from a mismatched sampler.

Sampled-token OPD ([opd_literate.opd.opd_pg_loss][]) is a policy gradient, so it inherits the
training-inference mismatch: the student's tokens are written by the inference engine $\mu$,
while the gradient is wanted for the trainer's $\pi_\theta$. This module gives the toy of
[opd_literate.mismatch.toy.make_toy][] a teacher and computes, exactly, the bias of the OPD gradient
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
the toy are independent (one of the results listed in [opd_literate.mismatch.toy][] that need it):
the estimate of row $t$ depends on $y_t$ alone, and under $\mu$ the marginal of $y_t$ is $\mu_t$,
so $\mathbb{E}_\mu[\rho_t f(y_t)] = \mathbb{E}_{\pi_t}[f(y_t)]$, while the objective is a sum
of per-position KLs. In an autoregressive model $\pi_t$ and $\mu_t$ depend on the prefix, which
the sampler also chose: the token ratio then corrects the last token only, and the recipe is
biased.

**The autoregressive toy.** Everything here also runs on [opd_literate.mismatch.toy.make_ar_toy][],
with a teacher of the same kind, $\pi_T(y_t \mid y_{t-1}) = \mathrm{softmax}(\phi_{t, p})$. Two
gradients then differ, and ``add_teacher`` returns both:

* ``kl_grad``: the gradient of the **sequence** reverse KL
  $\mathcal{K} = \mathrm{KL}(\pi(y) \,\|\, \pi_T(y)) = \mathbb{E}_\pi\big[\sum_t d_t\big]$
  (with $d_t$ computed from the trainer), which counts how a token changes the states after it:
  $\nabla \mathcal{K} = \mathbb{E}_\pi\big[\sum_t d_t \sum_t s_t\big]$;
* ``kl_grad_per_state``: $\mathbb{E}_\pi\big[\sum_t d_t s_t\big]$, the sum over the visited
  states of the per-state KL gradients with the state distribution held fixed. This is what
  sampled-token OPD with discount 0 estimates on-policy (the lab's loss, and the full-vocabulary
  Task 3 loss, in expectation), and what ``opd_mismatch_table`` measures the recipes against by
  default: the bias it reports is the mismatch's alone.

For ``make_toy`` they are equal. Under mismatch on the autoregressive toy, the token ratio
leaves the prefix distributed as $\mu$, so ``trainer`` + ``token_is`` is biased; the prefix
ratio $\rho_{\le t} = \prod_{k \le t} \rho_k$ (``weight="prefix_is"``) makes the prefix and
the token distributed as $\pi$ and is exact, as is the sequence ratio (``"seq_is"``), with
more variance. [opd_literate.mismatch.opd_mismatch.expected_reduced_gradient][] computes, exactly,
the expected gradient of each loss reduction of [opd_literate.opd.aggregate_loss][] with a discount
$\gamma$, against $\nabla \mathcal{K}$.
"""

from __future__ import annotations

import math

import numpy as np

from .._numerics import REDUCTIONS, check_finite_number, check_reduction, exp_ratio
from .estimators import seq_is, token_ratios, token_tis
from .toy import (
    check_toy,
    estimator_moments,
    log_softmax,
    make_ar_toy,
    make_toy,
    response_mask,
)

__all__ = ["add_teacher", "opd_estimate", "OPD_RECIPES", "PREFIX_RECIPES", "opd_mismatch_table",
           "REDUCTIONS", "expected_reduced_gradient", "reduction_table", "angle_degrees"]

WEIGHTS = ("none", "token_tis", "token_is", "prefix_is", "seq_is")

OPD_RECIPES = (
    ("trainer", "none"),
    ("sampler", "none"),
    ("trainer", "token_tis"),
    ("sampler", "token_tis"),
    ("trainer", "token_is"),
)
"""(logp, weight) pairs compared by [opd_literate.mismatch.opd_mismatch.opd_mismatch_table][]."""

PREFIX_RECIPES = (
    ("trainer", "prefix_is"),
    ("trainer", "seq_is"),
)
"""Two more recipes, exact at every mismatch on both toys: the prefix ratio and the sequence
ratio."""

def add_teacher(toy, teacher_seed=1, scale=1.0, phi=None):
    r"""A copy of ``toy`` with a teacher and the exact reverse-KL gradients.

    Adds ``phi`` $\sim \mathcal{N}(0, \text{scale}^2)$ drawn from ``default_rng(teacher_seed)``,
    of the shape of ``toy["theta"]`` (``(T, V)``, or ``(T, V + 1, V)`` for
    [opd_literate.mismatch.toy.make_ar_toy][], read like ``theta``), ``logp_teacher`` (M, T)
    $\log \pi_T(y_t \mid y_{t-1})$ (0 on the padding), ``kl`` (the sequence reverse KL
    $\mathcal{K}$), ``kl_grad`` $\nabla_\theta \mathcal{K}$ and ``kl_grad_per_state``
    $\mathbb{E}_\pi[\sum_t d_t s_t]$ (equal to ``kl_grad`` for ``make_toy``; see the module
    docstring).

    ``phi`` given by hand (finite, the shape of ``toy["theta"]``) replaces the random draw;
    ``teacher_seed`` and ``scale`` are then unused.

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

    On the autoregressive toy the sequence KL is the expected sum of the per-state KLs
    (the chain rule), but its gradient is not the per-state one:

    >>> ar = add_teacher(make_ar_toy(T=3, V=3))
    >>> bool(np.abs(ar["kl_grad"] - ar["kl_grad_per_state"]).max() > 0.01)
    True
    """
    check_toy(toy, keys=("Y", "theta", "T", "V", "logp_train", "p_train"))
    scale = check_finite_number("scale", scale)
    theta = np.asarray(toy["theta"])
    if phi is None:
        with np.errstate(over="ignore"):
            phi = np.random.default_rng(teacher_seed).normal(0.0, 1.0, size=theta.shape) * scale
    else:
        phi = np.asarray(phi, dtype=float)
        if phi.shape != theta.shape or not np.isfinite(phi).all():
            raise ValueError(f"phi must be finite with the shape of toy['theta'] {theta.shape}, "
                             f"got shape {phi.shape}")
    # phi itself may overflow to +-inf at a huge scale (inf - inf inside the softmax is NaN):
    # both are the same refusal below, not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        log_q = log_softmax(phi)
    if not (np.isfinite(phi).all() and np.isfinite(log_q).all()):
        # A teacher probability of 0 makes the reverse KL infinite and its gradient NaN.
        raise ValueError(f"scale={scale!r} gives the teacher a token of probability 0 (its "
                         "logits overflow float64 or differ by more than it can represent); "
                         "use a smaller scale")
    if theta.ndim == 3:
        return _add_ar_teacher(toy, phi, log_q)
    T = toy["T"]
    log_pi = log_softmax(theta)
    pi = np.exp(log_pi)
    kl_t = (pi * (log_pi - log_q)).sum(axis=1)  # (T,)
    # d KL_t / d theta_t = pi_t * (log pi_t - log q_t - KL_t)
    kl_grad = pi * (log_pi - log_q - kl_t[:, None])
    logp_teacher = log_q[np.arange(T), toy["Y"]]  # (M, T)
    # Independent positions: the state distribution does not depend on theta.
    return dict(toy, phi=phi, logp_teacher=logp_teacher, kl=float(kl_t.sum()), kl_grad=kl_grad,
                kl_grad_per_state=kl_grad)


def _add_ar_teacher(toy, phi, log_q):
    """add_teacher for make_ar_toy: every gradient as an exact sum over the responses."""
    check_toy(toy, keys=("mask", "prev", "score"))
    mask = response_mask(toy) > 0
    positions = np.arange(toy["T"])[None, :]
    logp_teacher = np.where(mask, log_q[positions, toy["prev"], toy["Y"]], 0.0)  # (M, T)
    d = toy["logp_train"] - logp_teacher  # (M, T): log pi - log pi_T, 0 on the padding
    pi = toy["p_train"]
    # K = E_pi[log pi(y) - log pi_T(y)]; grad K = E_pi[(log pi(y) - log pi_T(y)) grad log pi(y)]
    # (the term E_pi[grad log pi(y)] is 0)
    log_ratio = d.sum(axis=1)  # (M,)
    kl_grad = np.einsum("m,m,mtpv->tpv", pi, log_ratio, toy["score"])
    # E_pi[sum_t d_t s_t]: each token's own gap times its own score
    kl_grad_per_state = np.einsum("m,mt,mtpv->tpv", pi, d, toy["score"])
    return dict(toy, phi=phi, logp_teacher=logp_teacher, kl=float(pi @ log_ratio),
                kl_grad=kl_grad, kl_grad_per_state=kl_grad_per_state)


def opd_estimate(toy, logp="trainer", weight="none", cap=2.0, gamma=0.0):
    r"""Per-sequence sampled-token OPD gradient estimate, the shape of ``toy["score"]``.

    $\hat g_{m,t} = w_{m,t}\, G_{m,t}\, s_{m,t}$ with $G_t = \sum_{k \ge t} \gamma^{k - t} d_k$
    and $d_k = \log \pi^{\mathrm{used}}(y_k) - \log \pi_T(y_k)$ (over the response's tokens),
    so $G_t = d_t$ at the default $\gamma = 0$. $-G_t$ is the discounted reward-to-go of
    [opd_literate.opd.sampled_token_opd_loss][], and $\hat g$ the gradient of its loss
    summed over the tokens.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.opd_mismatch.add_teacher][].
    logp : {"trainer", "sampler"}
        Which student log-probability enters the reward.
    weight : {"none", "token_tis", "token_is", "prefix_is", "seq_is"}
        $w_t = 1$, $\min(\rho_t, C)$, $\rho_t$, $\rho_{\le t} = \prod_{k \le t} \rho_k$ or
        $\rho$.
    cap : float
        $C$ for ``token_tis``.
    gamma : float
        Discount $\gamma \in [0, 1]$.

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
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {WEIGHTS}, got {weight!r}")
    cap = check_finite_number("cap", cap, positive=True, allow_inf=True)
    gamma = check_finite_number("gamma", gamma, low=0.0, high=1.0)
    student_logp = toy["logp_train"] if logp == "trainer" else toy["logp_sampler"]
    # d_t = log pi_student(y_t) - log pi_T(y_t) = -r_t, the OPD reward with its sign flipped
    d = student_logp - toy["logp_teacher"]
    if gamma > 0:
        d = _discounted_sum(d, response_mask(toy), gamma)  # G_t = d_t + gamma G_{t+1}
    if weight == "none":
        w = 1.0
    elif weight == "token_tis":
        w = token_tis(toy, cap, return_weights=True)  # min(rho_t, C)
    elif weight == "token_is":
        w = token_ratios(toy)  # rho_t
    elif weight == "prefix_is":
        # rho_{<=t} = exp(sum_{k <= t} log rho_k): the prefix and the token, summed in log space
        log_rho_t = toy["logp_train"] - toy["logp_sampler"]
        w = exp_ratio(np.cumsum(log_rho_t, axis=1), "prefix", toy)
    else:
        w = seq_is(toy, return_weights=True)[:, None]  # rho, the same for every token
    with np.errstate(over="ignore"):
        weighted = w * d  # (M, T)
    if not np.isfinite(weighted).all():
        raise ValueError(f"the weights times the log-probability gaps overflow float64 "
                         f"(weight={weight!r}, largest gap {float(np.abs(d).max()):.3g}); use a "
                         "smaller teacher scale or mismatch")
    # |s_t| <= 1, so this product cannot overflow; (M, T, 1) or (M, T, 1, 1) times the score
    extra = (1,) * (np.ndim(toy["score"]) - 2)
    return weighted.reshape(weighted.shape + extra) * toy["score"]


def _discounted_sum(d, mask, gamma):
    """G_t = sum_{k >= t} gamma^(k - t) d_k m_k, backwards over the positions; 0 where m = 0."""
    d = np.where(mask > 0, d, 0.0)
    returns = np.zeros_like(d)
    running = np.zeros(d.shape[0])
    for t in reversed(range(d.shape[1])):
        running = d[:, t] + gamma * running
        returns[:, t] = running
    return np.where(mask > 0, returns, 0.0)


def opd_mismatch_table(mismatches, T=6, V=4, seed=0, teacher_seed=1, cap=2.0, N=64, *,
                       autoregressive=False, eos=True, recipes=OPD_RECIPES, target="per_state"):
    r"""Exact relative bias and RMSE of every recipe in ``recipes``, per mismatch.

    Returns a list of rows ``{"mismatch", "logp", "weight", "rel_bias", "rel_rmse"}``, the
    error measured against ``kl_grad_per_state`` (``target="per_state"``, what the recipe
    estimates without mismatch) or ``kl_grad`` (``"sequence"``); the two are equal for
    ``make_toy``.

    Parameters
    ----------
    autoregressive : bool
        Build the toys with [opd_literate.mismatch.toy.make_ar_toy][] (with ``eos``) instead of
        [opd_literate.mismatch.toy.make_toy][].
    recipes : sequence of (logp, weight)
        ``OPD_RECIPES`` by default; ``PREFIX_RECIPES`` adds the prefix and sequence ratios.

    Examples
    --------
    >>> rows = opd_mismatch_table([0.0, 0.5])
    >>> [(r["logp"], r["weight"]) for r in rows if r["mismatch"] == 0.5 and r["rel_bias"] < 1e-12]
    [('trainer', 'token_is')]

    With the prefix, the token ratio is no longer exact; the prefix ratio is:

    >>> rows = opd_mismatch_table([0.5], T=3, V=3, autoregressive=True,
    ...                           recipes=[("trainer", "token_is"), ("trainer", "prefix_is")])
    >>> [(r["weight"], r["rel_bias"] < 1e-12) for r in rows]
    [('token_is', False), ('prefix_is', True)]
    """
    if target not in ("per_state", "sequence"):
        raise ValueError(f"target must be 'per_state' or 'sequence', got {target!r}")
    if not isinstance(autoregressive, bool):
        raise TypeError(f"autoregressive must be True or False, got {autoregressive!r}")
    recipes = list(recipes)
    for recipe in recipes:
        if not (isinstance(recipe, tuple) and len(recipe) == 2):
            raise ValueError(f"each recipe must be a (logp, weight) pair, got {recipe!r}")
    rows = []
    for mismatch in mismatches:
        if autoregressive:
            toy = make_ar_toy(T=T, V=V, mismatch=mismatch, seed=seed, eos=eos)
        else:
            toy = make_toy(T=T, V=V, mismatch=mismatch, seed=seed)
        toy = add_teacher(toy, teacher_seed)
        goal = toy["kl_grad_per_state"] if target == "per_state" else toy["kl_grad"]
        target_toy = dict(toy, true_grad=goal)
        for logp, weight in recipes:
            moments = estimator_moments(target_toy, opd_estimate(toy, logp, weight, cap))
            rows.append(dict(mismatch=float(mismatch), logp=logp, weight=weight,
                             rel_bias=moments["rel_bias"], rel_rmse=moments["rel_rmse"](N)))
    return rows


# ---------------------------------------------------------------------------------------------
# Loss reductions with variable lengths: the exact expected gradient of each
# ---------------------------------------------------------------------------------------------
def expected_reduced_gradient(toy, gamma=0.0, reduction="token-mean", batch_size=1):
    r"""Exact expected gradient of sampled-token OPD reduced by ``reduction``, on-policy.

    A batch holds $B$ responses drawn independently from the trainer $\pi$ (no mismatch, so
    that only the discount and the reduction matter). Response $b$ contributes
    $g_b = \sum_t G_{b,t}\, s_{b,t}$ (the gradient of $-\sum_t \mathrm{sg}(A_t) \log
    \pi(y_t)$, see [opd_literate.mismatch.opd_mismatch.opd_estimate][]), and the reduction divides:

    * ``"sum"`` and ``"token-sum"``: $\mathbb{E}[\sum_b g_b] = B\, \mathbb{E}[g]$;
    * ``"seq-mean-token-sum"``: $\mathbb{E}[g]$; ``"seq-mean-token-sum-norm"``:
      $\tfrac{1}{T} \mathbb{E}[g]$ ($T$ the padded length); ``"token-sum-norm"``:
      $\tfrac{B}{T} \mathbb{E}[g]$;
    * ``"seq-mean-token-mean"``: $\mathbb{E}[g / n]$ ($n$ the response's length), whatever $B$;
    * ``"token-mean"``: $\mathbb{E}[\sum_b g_b / \sum_b n_b] = B\,
      \mathbb{E}\big[g_1\, \mathbb{E}[1 / (n_1 + N')]\big]$, with $N'$ the total length of the
      other $B - 1$ responses, whose distribution is the $(B-1)$-fold convolution of the
      length distribution under $\pi$. So no sum over the $M^B$ batches is needed.

    With $\gamma = 1$, $\mathbb{E}[g] = \nabla \mathcal{K}$ (``kl_grad``), so the first five
    are exact up to a constant; the two means are not when the lengths vary. With
    $\gamma = 0$, $\mathbb{E}[g]$ is ``kl_grad_per_state``, which is not $\nabla \mathcal{K}$
    on the autoregressive toy.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.opd_mismatch.add_teacher][].
    gamma : float
        Discount in $[0, 1]$.
    reduction : str
        One of ``REDUCTIONS``.
    batch_size : int
        $B \ge 1$.

    Returns
    -------
    numpy.ndarray
        The shape of ``toy["kl_grad"]``.

    Examples
    --------
    $T = 2$, $V = 2$ with ``<eos>``: with $\gamma = 1$ and ``"sum"`` over $B = 3$ responses
    the expectation is exactly $3 \nabla \mathcal{K}$:

    >>> toy = add_teacher(make_ar_toy(T=2, V=2))
    >>> g = expected_reduced_gradient(toy, gamma=1.0, reduction="sum", batch_size=3)
    >>> bool(np.allclose(g, 3 * toy["kl_grad"], rtol=1e-12, atol=1e-15))
    True
    """
    check_toy(toy, keys=("logp_train", "logp_teacher", "score", "p_train", "kl_grad"))
    check_reduction(reduction)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    per_seq = opd_estimate(toy, "trainer", "none", gamma=gamma)  # g(y), on-policy
    pi = toy["p_train"]
    lengths = response_mask(toy).sum(axis=1)  # (M,) n(y)
    T = per_seq.shape[1]
    if reduction in ("sum", "token-sum"):
        weight = np.full(len(pi), float(batch_size))
    elif reduction == "seq-mean-token-sum":
        weight = np.ones(len(pi))
    elif reduction == "seq-mean-token-sum-norm":
        weight = np.full(len(pi), 1.0 / T)
    elif reduction == "token-sum-norm":
        weight = np.full(len(pi), batch_size / T)
    elif reduction == "seq-mean-token-mean":
        weight = 1.0 / lengths
    else:  # token-mean: B * E[1 / (n + N')], N' the length of the other B - 1 responses
        length_dist = np.bincount(lengths.astype(np.int64), weights=pi, minlength=T + 1)
        others = np.array([1.0])  # the distribution of N' (N' = 0 for B = 1)
        for _ in range(batch_size - 1):
            others = np.convolve(others, length_dist)
        totals = lengths[:, None] + np.arange(len(others))[None, :]  # (M, values of N')
        weight = batch_size * (others[None, :] / totals).sum(axis=1)
    return np.einsum("m,m,m...->...", pi, weight, per_seq)


def angle_degrees(a, b):
    r"""The angle between two gradients, in degrees: 0 when one is a positive multiple of the
    other, so a bias measure that ignores the scale.

    Examples
    --------
    >>> angle_degrees([1.0, 0.0], [3.0, 0.0]), round(angle_degrees([1.0, 0.0], [1.0, 1.0]), 6)
    (0.0, 45.0)
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:  # no broadcasting: two gradients of one parameter
        raise ValueError(f"b must have the shape of a {a.shape}, got {b.shape}")
    a, b = np.ravel(a), np.ravel(b)
    norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if norm_a == 0 or norm_b == 0:
        raise ValueError("angle_degrees needs two non-zero gradients")
    u, v = a / norm_a, b / norm_b
    # 2 atan2(|u - v|, |u + v|): accurate near 0, where acos(cos) loses half the digits
    angle = 2.0 * math.atan2(float(np.linalg.norm(u - v)), float(np.linalg.norm(u + v)))
    return math.degrees(angle)


def reduction_table(toy, gammas=(0.0, 1.0), reductions=REDUCTIONS, batch_sizes=(1, 8)):
    r"""The bias of every (discount, reduction, batch size) against $\nabla \mathcal{K}$.

    Each row holds ``gamma``, ``reduction``, ``batch_size``, ``angle`` (degrees between the
    expected gradient $\bar g$ of [opd_literate.mismatch.opd_mismatch.expected_reduced_gradient][]
    and $\nabla \mathcal{K}$), ``scale`` $c = \langle \bar g, \nabla \mathcal{K} \rangle /
    \lVert \nabla \mathcal{K} \rVert^2$ and ``rel_bias`` $= \min_c \lVert \bar g / c -
    \nabla \mathcal{K} \rVert / \lVert \nabla \mathcal{K} \rVert = \sin(\text{angle})$: the
    relative bias that no learning rate can remove.

    Examples
    --------
    Fixed length (no ``<eos>``): with $\gamma = 1$ every reduction is a multiple of
    ``"sum"``, so none is biased:

    >>> toy = add_teacher(make_ar_toy(T=3, V=3, eos=False))
    >>> rows = reduction_table(toy, gammas=[1.0], batch_sizes=[2])
    >>> max(r["rel_bias"] for r in rows) < 1e-12
    True
    """
    target = toy["kl_grad"]
    norm2 = float(np.sum(target * target))
    rows = []
    for gamma in gammas:
        for reduction in reductions:
            for B in batch_sizes:
                g = expected_reduced_gradient(toy, gamma, reduction, B)
                angle = angle_degrees(g, target)
                rows.append(dict(gamma=float(gamma), reduction=reduction, batch_size=int(B),
                                 angle=angle, scale=float(np.sum(g * target)) / norm2,
                                 rel_bias=math.sin(math.radians(angle))))
    return rows
