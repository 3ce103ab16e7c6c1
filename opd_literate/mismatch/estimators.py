r"""Rollout-correction estimators for a sampler that is not the trainer, with exact moments.

The rollouts come from the sampler $\mu$ (the inference engine), the gradient is wanted for the
trainer $\pi = \pi_\theta$. Every estimator here returns, for each of the $M$ sequences of the
toy of [opd_literate.mismatch.toy.make_toy][], the ``(T, V)`` gradient estimate it would produce if
the sampler had drawn that sequence: an ``(M, T, V)`` array that
[opd_literate.mismatch.toy.estimator_moments][] turns into an exact mean, bias and variance. They
work unchanged on the autoregressive toy of [opd_literate.mismatch.toy.make_ar_toy][], whose
estimates are ``(M, T, V + 1, V)`` (the parameters of token $t$ are the row of the token before it)
and whose responses can end at ``<eos>``: there $T$ below is the length $n$ of the response, padded
positions have $\rho_t = 1$ and a score of 0, and the product $\rho = \prod_t \rho_t$ of
conditional ratios $\pi(y_t \mid y_{<t}) / \mu(y_t \mid y_{<t})$ is still $\pi(y) / \mu(y)$.

Notation (per sequence $y \sim \mu$):

$$
\rho_t = \frac{\pi(y_t)}{\mu(y_t)}, \qquad
\rho = \prod_{t=1}^{T} \rho_t = \frac{\pi(y)}{\mu(y)}, \qquad
\rho_{\mathrm{geo}} = \rho^{1/T}, \qquad
A = R(y) - b, \qquad s_t = e_{y_t} - \pi_t .
$$

Every estimator has the form $\hat g_t = w_t\, A\, s_t$ (row $t$ of the ``(T, V)`` estimate):
it differs from the others only in the weight $w_t$ that it puts on token $t$.

**Why the sequence ratio is the unbiased one.** The true gradient is
$\nabla J = \mathbb{E}_{\pi}[A \sum_t s_t]$ (the baseline $b$ drops out because
$\mathbb{E}_\pi[s_t] = 0$). For any function $f$,
$\mathbb{E}_\mu[\rho f(y)] = \sum_y \mu(y) \tfrac{\pi(y)}{\mu(y)} f(y) = \mathbb{E}_\pi[f(y)]$,
so $w_t = \rho$ is unbiased, whatever the mismatch (for any sequence model, as long as $\mu > 0$
wherever $\pi > 0$). Its variance is the price: $\rho$ is a product of $T$ ratios, and when the
positions are independent, as in this toy (see [opd_literate.mismatch.toy][] for what relies on
that), its second moment is $\mathbb{E}_\mu[\rho^2] = \prod_t (1 + \chi^2(\pi_t \,\|\, \mu_t))$,
which grows exponentially with the length. Every other estimator in this module gives up
unbiasedness to get less variance: per-token ratios (the right ratio for the last token but
not for the prefix that led to it), truncation (cap the weight), masking and rejection (drop
the sample), and geometric means (length-normalized ratios). The trade usually pays on this
toy, but not always: at mismatch 0.05 the variance of ``token_is`` is above that of ``seq_is``.

**Bypass mode.** Several estimators come from PPO-style losses. They are evaluated here at the
point where the gradient is taken, $\theta_{\mathrm{old}} = \theta$, with the rollout policy as
the PPO anchor ("bypass mode" in verl's ``rollout_correction``), so the PPO ratio *is* $\rho_t$.
The gradient of a clipped term is then $\rho_t A s_t$ where the clip is inactive and 0 where it
is active.
DPPO (``dppo_tv``, ``dppo_kl``) replaces the clip on $\rho_t$ by a trust region on the
probabilities $\pi(y_t)$ and $\mu(y_t)$, evaluated the same way.

**Not here: DRO.** verl's ``dro`` loss, $-(A \log \pi_\theta(y_t) - \frac{\beta}{2}
(\log \rho_t)^2)$, gives the estimate (minus its gradient) $(A - \beta \log \rho_t)\, s_t$:
its penalty does not scale with $A$ (it acts where $A = 0$), so it has no weight $w_t$ in the
form above, and it estimates the gradient of an objective regularised towards its anchor
($\mu$ in bypass mode), not $\nabla J$. Its torch form is
[opd_literate.mismatch.correction.dro_loss][].

**Not here: GPG and KL-Cov.** verl's ``gpg`` loss, $-A \log \pi_\theta(y_t)$, has no anchor:
its weight is $w_t = 1$, ``naive``'s (its torch form is
[opd_literate.mismatch.correction.reinforce_loss][] without weights). verl's ``kl_cov`` adds
$\beta |\log \rho_t|$ on some tokens, a term that does not scale with $A$: ``kl_cov`` below
returns its estimate, which has no weight, and is not in ``REGISTRY``.

**The hand-made examples.** Each estimator's example uses a toy of one or two positions built
with [opd_literate.mismatch.toy.toy_from_logits][], where the ratios are round numbers: with the
trainer uniform, $\pi_t = (0.5, 0.5)$, and the sampler at $\mu_t = (0.8, 0.2)$, the token ratios are
$\rho_t(0) = 0.625$ and $\rho_t(1) = 2.5$. Token 0 earns the reward, so with one position
$R = (1, 0)$ for the two sequences; with two positions the sequences are
$(0,0), (0,1), (1,0), (1,1)$ with $R = (1, 1, 1, 0)$ and $\rho = (0.390625, 1.5625, 1.5625,
6.25)$. The examples print weights (``return_weights=True``), which a reader can check by hand
against the formula, and each shows a threshold, cap or clip that changes a weight.

Each public estimator is ``name(toy, <thresholds>, baseline=0.0, *, return_weights=False)``;
``return_weights=True`` returns the ``(M, T)`` weights $w_t$ instead of the estimate, which is
how the comparison counts truncated and masked tokens. [opd_literate.mismatch.estimators.REGISTRY][]
lists them all with their defaults and sources, and
[opd_literate.mismatch.estimators.comparison_table][] and
[opd_literate.mismatch.estimators.mismatch_sweep][] build the exact comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._numerics import (
    BINARY_KL_EPS,
    VERL_COMMIT,
    check_band,
    check_finite_number,
    check_sequence,
    exp_ratio,
)
from .toy import (
    ar_toy_from_logits,
    check_toy,
    estimator_moments,
    make_ar_toy,
    make_toy,
    toy_from_logits,
)

__all__ = [
    "token_ratios",
    "geometric_ratio",
    "weighted_score",
    "naive",
    "token_is",
    "seq_is",
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "geo_rs",
    "icepop",
    "token_clamp",
    "cispo",
    "ppo_clip_bypass",
    "token_veto",
    "k3_seq_rs",
    "geo_rs_token_tis",
    "gspo",
    "dppo_tv",
    "dppo_kl",
    "trl_token_truncate",
    "trl_token_mask",
    "trl_sequence_truncate",
    "trl_sequence_mask",
    "off_policy_mask",
    "seq_mask_tis",
    "kpop",
    "sapo",
    "gmpo",
    "clip_cov",
    "luspo",
    "vespo",
    "kl_cov",
    "COV_STATISTICS",
    "VERL_COMMIT",
    "EstimatorSpec",
    "REGISTRY",
    "estimator_weights",
    "comparison_table",
    "mismatch_sweep",
    "length_sweep",
    "format_table",
    "least_error",
]


# ---------------------------------------------------------------------------------------------
# Shared pieces: ratios, the score product, argument checks
# ---------------------------------------------------------------------------------------------
def token_ratios(toy):
    r"""Per-token ratios $\rho_t = \pi(y_t) / \mu(y_t)$, shape ``(M, T)``.

    Examples
    --------
    >>> toy = make_toy(T=2, V=2, mismatch=0.0)
    >>> token_ratios(toy).tolist()
    [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    check_toy(toy, keys=("logp_train", "logp_sampler"))
    return exp_ratio(toy["logp_train"] - toy["logp_sampler"], "per-token", toy)


def _response_lengths(toy):
    """Tokens per response of a toy: the int T for make_toy, the (M,) mask sums for make_ar_toy.

    Not clamped at 1, unlike ``_numerics.lengths`` of a (B, T) torch batch: every response of
    a toy has at least one token.
    """
    if "mask" in toy:
        return np.asarray(toy["mask"]).sum(axis=1)
    return toy["logp_train"].shape[1]


def _log_seq_ratio(toy):
    """log rho = sum_t log rho_t, shape (M,): summed in log space, never as a product."""
    return (toy["logp_train"] - toy["logp_sampler"]).sum(axis=1)


def geometric_ratio(toy):
    r"""Length-normalized sequence ratios $\rho_{\mathrm{geo}} = \rho^{1/T}$, shape ``(M,)``.

    $T$ is the length of the response ($n$, the tokens of its mask, for
    [opd_literate.mismatch.toy.make_ar_toy][]): the mean of $\log \rho_t$ over its tokens, as verl's
    ``seq_mean`` criteria take it. ``inf`` where $\rho_{\mathrm{geo}}$ overflows float64 (then
    outside every finite band).

    Examples
    --------
    >>> toy = make_toy(T=3, V=2)
    >>> rho = np.exp((toy["logp_train"] - toy["logp_sampler"]).sum(axis=1))
    >>> bool(np.allclose(geometric_ratio(toy) ** 3, rho))
    True
    """
    check_toy(toy, keys=("logp_train", "logp_sampler"))
    with np.errstate(over="ignore"):
        return np.exp(_log_seq_ratio(toy) / _response_lengths(toy))


def weighted_score(toy, weights, baseline=0.0):
    r"""The estimate $\hat g_{m,t} = w_{m,t}\, (R_m - b)\, s_{m,t}$, the shape of the score.

    ``(M, T, V)`` for [opd_literate.mismatch.toy.make_toy][], ``(M, T, V + 1, V)`` for
    [opd_literate.mismatch.toy.make_ar_toy][]: the weight of token $t$ multiplies its score.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.toy.make_toy][].
    weights : numpy.ndarray
        ``(M, T)`` per-token weights, or ``(M,)`` for one weight per sequence.
    baseline : float
        $b$, finite.

    Examples
    --------
    >>> toy = make_toy(T=2, V=2)
    >>> est = weighted_score(toy, np.ones(4))
    >>> bool(np.allclose(est, toy["R"][:, None, None] * toy["score"]))
    True
    """
    check_toy(toy, keys=("R", "score"))
    baseline = check_finite_number("baseline", baseline)
    M, T = toy["score"].shape[:2]
    weights = np.asarray(weights, dtype=float)
    if weights.shape == (M,):
        weights = weights[:, None]
    elif weights.shape != (M, T):
        raise ValueError(f"weights must have shape (M,) or (M, T) = {(M, T)}, got {weights.shape}")
    if not np.isfinite(weights).all():
        raise ValueError(
            f"weights hold {int((~np.isfinite(weights)).sum())} non-finite values (an "
            f"importance ratio overflowed at mismatch={toy.get('mismatch')!r}?); an estimate "
            "from them would be NaN"
        )
    advantage = toy["R"] - baseline  # (M,)
    with np.errstate(over="ignore"):
        weighted_advantage = weights * advantage[:, None]  # (M, T)
    if not np.isfinite(weighted_advantage).all():
        raise ValueError(
            f"the weights times the advantage R - baseline overflow float64 (baseline="
            f"{baseline!r}, largest weight {float(np.max(np.abs(weights))):.3g}); use a smaller "
            "baseline or mismatch"
        )
    # w_t * A * s_t: (M, T, 1) * (M, T, V), or (M, T, 1, 1) * (M, T, V + 1, V);
    # |s_t| <= 1, so this product cannot overflow
    extra = (1,) * (np.ndim(toy["score"]) - 2)
    return weighted_advantage.reshape(weighted_advantage.shape + extra) * toy["score"]


def _finish(toy, weights, baseline, return_weights):
    if return_weights:
        check_finite_number("baseline", baseline)
        return weights
    return weighted_score(toy, weights, baseline)


# ---------------------------------------------------------------------------------------------
# The estimators
# ---------------------------------------------------------------------------------------------
def naive(toy, baseline=0.0, *, return_weights=False):
    r"""No correction: $w_t = 1$, the on-policy REINFORCE estimate applied to sampler data.

    $$
    \hat g_t = A\, s_t .
    $$

    What a trainer computes when it ignores the mismatch. Its mean is
    $\mathbb{E}_\mu[A \sum_t s_t]$, the gradient for the wrong distribution: biased in general
    when $\mu \ne \pi$, unbiased at ``mismatch = 0``. Not biased for *every* $\mu \ne \pi$,
    though: the bias depends on the baseline, and with one position, two tokens and
    $b = \pi(1)$ the estimate $A s$ is the same for both tokens, so it is exact whatever $\mu$.

    Examples
    --------
    One position, $\pi = (0.5, 0.5)$, $\mu = (0.8, 0.2)$. Token 0 ($R = 1$) gives
    $A s = (0.5, -0.5)$, token 1 gives 0, so the mean is $0.8 \cdot (0.5, -0.5)$ where
    $\nabla J = 0.5 \cdot (0.5, -0.5)$:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> estimator_moments(one, naive(one))["mean"].round(6).tolist()
    [[0.4, -0.4]]

    With the baseline $b = \pi(1) = 0.5$ both tokens give $(0.25, -0.25) = \nabla J$:

    >>> estimator_moments(one, naive(one, baseline=0.5))["mean"].round(6).tolist()
    [[0.25, -0.25]]
    """
    check_toy(toy)
    ### BEGIN SOLUTION Task 1: every token's weight is 1
    weights = np.ones(toy["logp_train"].shape)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def token_is(toy, baseline=0.0, *, return_weights=False):
    r"""Per-token importance ratio, no clipping: $w_t = \rho_t$.

    $$
    \hat g_t = \rho_t\, A\, s_t .
    $$

    The ratio of PPO's surrogate, $\pi_\theta(y_t \mid s_t) / \pi_{\mathrm{old}}(y_t \mid s_t)$,
    with the rollout policy as the anchor (verl ``rollout_is: token`` without truncation). It
    corrects the distribution of the token $y_t$ but not of the other tokens, on which the
    reward also depends: with $T \ge 2$ it is **biased**, and the bias is *first* order in the
    mismatch (doubling a small mismatch doubles it; on the default toy the ratio
    $\text{bias}(2\epsilon) / \text{bias}(\epsilon)$ is 2.003 at $\epsilon = 0.0125$). In this
    toy, $\mathbb{E}_\mu[\rho_t A s_t]$ draws $y_t$ from $\pi_t$ but the other positions from
    $\mu$, which differ from $\pi$ by $O(\epsilon)$. With one position it is ``seq_is``.

    Examples
    --------
    One position: the weights are the two ratios, and the mean is $0.8 \cdot 0.625 \cdot
    (0.5, -0.5) = \nabla J$:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> token_is(one, return_weights=True).round(6).tolist()
    [[0.625], [2.5]]
    >>> estimator_moments(one, token_is(one))["mean"].round(6).tolist()
    [[0.25, -0.25]]
    """
    ### BEGIN SOLUTION Task 2: the per-token ratio pi(y_t) / mu(y_t) (see token_ratios)
    weights = token_ratios(toy)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def seq_is(toy, baseline=0.0, *, return_weights=False):
    r"""Sequence importance sampling: $w_t = \rho = \pi(y) / \mu(y)$. Unbiased.

    $$
    \hat g_t = \rho\, A\, s_t, \qquad
    \mathbb{E}_\mu\Big[\rho A \sum_t s_t\Big] = \mathbb{E}_\pi\Big[A \sum_t s_t\Big] = \nabla J .
    $$

    The textbook correction (verl ``rollout_is: sequence`` without truncation). The ratio is
    summed in log space, $\rho = \exp \sum_t (\log \pi(y_t) - \log \mu(y_t))$, so it does not
    underflow for long sequences. With independent positions (this toy) the second moment of
    its weight is $\mathbb{E}_\mu[\rho^2] = \prod_t (1 + \chi^2(\pi_t \| \mu_t))$: exponential
    in the length.

    Examples
    --------
    Two positions: $\rho$ is the product of the token ratios $0.625$ and $2.5$:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> seq_is(two, return_weights=True).round(6).tolist()
    [0.390625, 1.5625, 1.5625, 6.25]
    """
    ### BEGIN SOLUTION Task 3: the sequence ratio pi(y) / mu(y), summed in log space
    weights = exp_ratio(_log_seq_ratio(toy), "sequence", toy)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def token_tis(toy, cap=2.0, baseline=0.0, *, return_weights=False):
    r"""Truncated importance sampling per token (TIS): $w_t = \min(\rho_t, C)$.

    $$
    \hat g_t = \min(\rho_t, C)\, A\, s_t .
    $$

    From F. Yao et al., *Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training* (2025); verl ``rollout_is: token`` with ``rollout_is_threshold`` (default 2.0).
    Upper truncation only: tokens the sampler under-samples ($\rho_t$ large) are capped, the
    others keep their ratio. Biased twice: the token ratio of
    [token_is][opd_literate.mismatch.estimators.token_is] and the truncation.

    Parameters
    ----------
    cap : float
        $C > 0$; ``inf`` gives ``token_is``.

    Examples
    --------
    The cap 2 truncates the ratio 2.5 of token 1:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> token_tis(one, cap=2.0, return_weights=True).round(6).tolist()
    [[0.625], [2.0]]
    """
    cap = check_finite_number("cap", cap, positive=True, allow_inf=True)
    ### BEGIN SOLUTION Task 4: the per-token ratio, truncated from above at cap
    weights = np.minimum(token_ratios(toy), cap)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def seq_tis(toy, cap=2.0, baseline=0.0, *, return_weights=False):
    r"""Truncated sequence importance sampling: $w_t = \min(\rho, C)$.

    $$
    \hat g_t = \min(\rho, C)\, A\, s_t .
    $$

    verl ``rollout_is: sequence`` with ``rollout_is_threshold`` (default 2.0). Since
    $\min(\rho, C)^2 \le C^2$, the *second moment* $\mathbb{E}_\mu \lVert \hat g \rVert^2$ is at
    most $C^2$ times that of ``naive``. The *variance* has no such bound: with one position,
    two tokens, mismatch 0.5 and the baseline $\pi(1)$, ``naive`` has variance 0 (its estimate
    is the same for both tokens) and ``seq_tis`` does not. Since $\min(\rho, C) = \rho - (\rho
    - C)_+$, its bias is exactly the mass above the cap, with a minus sign:

    $$
    \mathbb{E}_\mu[\hat g] - \nabla J = -\mathbb{E}_\mu\Big[(\rho - C)_+\, A \sum_t s_t\Big].
    $$

    Parameters
    ----------
    cap : float
        $C > 0$; ``inf`` gives ``seq_is``.

    Examples
    --------
    The cap 2 truncates the ratio 6.25 of the sequence $(1, 1)$:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> seq_tis(two, cap=2.0, return_weights=True).round(6).tolist()
    [0.390625, 1.5625, 1.5625, 2.0]
    """
    cap = check_finite_number("cap", cap, positive=True, allow_inf=True)
    ### BEGIN SOLUTION Task 5: the sequence ratio, truncated from above at cap
    # min(rho, C) = exp(min(log rho, log C)): finite even where rho itself overflows
    with np.errstate(divide="ignore"):  # log(inf) = inf for an infinite cap is fine
        weights = exp_ratio(np.minimum(_log_seq_ratio(toy), np.log(cap)), "sequence", toy)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def token_mis(toy, low=0.0, high=2.0, baseline=0.0, *, return_weights=False):
    r"""Masked importance sampling per token (MIS): $w_t = \rho_t\, \mathbb{1}[l \le \rho_t \le h]$.

    $$
    \hat g_t = \rho_t\, \mathbb{1}[l \le \rho_t \le h]\, A\, s_t .
    $$

    From J. Liu, Y. Li et al., *When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch* (2025). Where truncation keeps an outlier token at weight $C$,
    masking drops it: an outlier ratio is taken as a sign that the sample is broken, not as
    information. $l = 0$ (the default here) is upper-only; $l > 0$ the two-sided band.

    In verl today: ``rollout_is: token`` with ``rollout_rs: token_k1``, whose band is read on
    $-\log \rho_t$: the threshold ``"a_b"`` keeps $\log a \le -\log \rho_t \le \log b$, i.e.
    $1/b \le \rho_t \le 1/a$, and a single number $h$ keeps $[1/h, h]$. verl requires
    $a > 0$ and reads $b = \infty$ as no lower bound on the ratio, so the upper-only band, the
    default here, is ``rollout_rs_threshold: "0.5_inf"``, and ``token_mis(low=0.5, high=2.0)``
    is ``rollout_rs_threshold: 2.0``, each with ``rollout_is_threshold`` $\ge 2$ (a cap the
    kept ratios never reach). ``rollout_rs`` without ``rollout_is`` keeps the tokens at weight
    1, not $\rho_t$. (Until
    December 2025 the option was ``rollout_rs: token`` with ``rollout_rs_threshold`` and
    ``rollout_rs_threshold_lower``.)

    Examples
    --------
    The band $[0, 2]$ masks the ratio 2.5 of token 1 (``token_tis`` would keep it at 2):

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> token_mis(one, low=0.0, high=2.0, return_weights=True).round(6).tolist()
    [[0.625], [0.0]]
    """
    low, high = check_band(low, high)
    ### BEGIN SOLUTION Task 6: the per-token ratio where low <= rho_t <= high, else 0
    rho_t = token_ratios(toy)
    weights = np.where((rho_t >= low) & (rho_t <= high), rho_t, 0.0)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def seq_mis(toy, low=0.0, high=2.0, baseline=0.0, *, return_weights=False):
    r"""Masked sequence importance sampling: $w_t = \rho\, \mathbb{1}[l \le \rho \le h]$.

    $$
    \hat g_t = \rho\, \mathbb{1}[l \le \rho \le h]\, A\, s_t .
    $$

    Liu, Li et al. (2025), the sequence-level MIS. In verl today: ``rollout_is: sequence``
    with ``rollout_rs: seq_sum_k1`` (the band read on $-\log \rho$ as for ``token_mis``; the
    preset ``decoupled_seq_is_rs`` sets ``"0.5_2.0"``, i.e. ``seq_mis(low=0.5, high=2.0)``;
    until December 2025, ``rollout_rs: sequence``), with ``rollout_is_threshold`` $\ge$ the
    upper bound. The lower bound defaults to 0 here: verl's ``"0.5_inf"``. The kept
    sequences keep their exact weight, so the bias is exactly the dropped mass, with a minus
    sign:

    $$
    \mathbb{E}_\mu[\hat g] - \nabla J
    = -\mathbb{E}_\mu\Big[\rho\,\mathbb{1}[\rho \notin [l, h]]\, A \sum_t s_t\Big].
    $$

    Examples
    --------
    The band $[0.5, 2]$ drops the sequences $(0, 0)$ ($\rho = 0.390625$) and $(1, 1)$
    ($\rho = 6.25$):

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> seq_mis(two, low=0.5, high=2.0, return_weights=True).round(6).tolist()
    [0.0, 1.5625, 1.5625, 0.0]
    """
    low, high = check_band(low, high)
    ### BEGIN SOLUTION Task 7: the sequence ratio where low <= rho <= high, else 0
    log_rho = _log_seq_ratio(toy)
    with np.errstate(divide="ignore"):  # log 0 = -inf: a lower bound of 0 keeps everything
        kept = (log_rho >= np.log(low)) & (log_rho <= np.log(high))
    # exp only where kept (a finite high bounds it); elsewhere the weight is 0
    weights = np.where(kept, exp_ratio(np.where(kept, log_rho, 0.0), "sequence", toy), 0.0)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def geo_rs(toy, low=1 / 1.001, high=1 / 0.999, baseline=0.0, *, return_weights=False):
    r"""Geometric-mean rejection sampling: $w_t = \mathbb{1}[l \le \rho_{\mathrm{geo}} \le h]$.

    $$
    \rho_{\mathrm{geo}} = \rho^{1/T} = \exp\Big(\tfrac1T \sum_t \log \rho_t\Big), \qquad
    \hat g_t = \mathbb{1}[l \le \rho_{\mathrm{geo}} \le h]\, A\, s_t .
    $$

    Liu, Li et al. (2025), part 3. In verl today: ``rollout_rs: seq_mean_k1`` with the
    threshold ``"0.999_1.001"`` (the presets ``decoupled_geo_rs``, ``bypass_pg_geo_rs``,
    ``bypass_ppo_clip_geo_rs``). verl reads that band on the mean of $-\log \rho_t$, which is
    $-\log \rho_{\mathrm{geo}}$, so it keeps $1/1.001 \le \rho_{\mathrm{geo}} \le 1/0.999$: the
    defaults here. (Until December 2025: ``rollout_rs: geometric`` with
    ``rollout_rs_threshold: 1.001``, read on $\rho_{\mathrm{geo}}$ itself with the lower bound
    $1/1.001$, and a token veto, ``token_veto``.)
    Rejection only: kept sequences get weight 1, no ratio. The geometric mean is
    length-normalized, so long sequences are not rejected just for being long. Biased in
    general: the kept samples are still distributed as $\mu$, not $\pi$.

    Examples
    --------
    The geometric ratios of the two-position toy are $0.625, 1.25, 1.25, 2.5$; the band
    $[0.8, 1.3]$ rejects the first and the last:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> geo_rs(two, low=0.8, high=1.3, return_weights=True).tolist()
    [0.0, 1.0, 1.0, 0.0]
    """
    low, high = check_band(low, high)
    ### BEGIN SOLUTION Task 8: 1 where low <= rho ** (1 / T) <= high, else 0 (no ratio)
    rho_geo = geometric_ratio(toy)  # exp(mean_t log rho_t)
    weights = ((rho_geo >= low) & (rho_geo <= high)).astype(float)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def icepop(toy, low=0.5, high=5.0, baseline=0.0, *, return_weights=False):
    r"""IcePop: per-token ratio, masked outside the band $[\alpha, \beta] = [0.5, 5]$.

    $$
    \hat g_t = \rho_t\, \mathbb{1}[\alpha \le \rho_t \le \beta]\, A\, s_t .
    $$

    From the Ling team's IcePop (inclusionAI, Ring-1T, 2025): two-sided token masking, i.e.
    ``token_mis`` with a band of its own. The band is a hyperparameter; $[0.5, 5]$ is the
    default of verl's IcePop presets (``decoupled_token_icepop``, ``bypass_pg_token_icepop``:
    ``rollout_is: token`` with ``rollout_is_threshold: "0.5_5.0"``, verl 0.9.1). slime
    implements IcePop as ``icepop_function`` (``slime/backends/megatron_utils/loss.py`` at commit
    ``624b824``), which keeps $\rho_t$ where ``tis_clip_low`` $\le \rho_t \le$ ``tis_clip`` and
    zeroes it elsewhere. Tokens whose training and inference probabilities disagree by more than
    the band contribute no gradient at all. Biased in general: the ratio corrects its own token,
    not the others on which the reward also depends, and the mask drops mass.

    Examples
    --------
    With $\pi = (0.9, 0.1)$ and $\mu = (0.5, 0.5)$ the ratios are 1.8 and 0.2; 0.2 is below
    the band:

    >>> toy = toy_from_logits(np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]]))
    >>> icepop(toy, return_weights=True).round(6).tolist()
    [[1.8], [0.0]]
    """
    # The same weights as token_mis, with IcePop's band as the default.
    return token_mis(toy, low, high, baseline, return_weights=return_weights)


def token_clamp(toy, low=0.5, high=2.0, baseline=0.0, *, return_weights=False):
    r"""Two-sided truncation per token: $w_t = \mathrm{clip}(\rho_t, l, h)$.

    $$
    \hat g_t = \min(\max(\rho_t, l), h)\, A\, s_t .
    $$

    TIS with a floor as well as a cap: a token that the sampler over-samples keeps at least
    weight $l$ instead of a tiny ratio. Never drops a token. Biased. This is slime's
    ``vanilla_tis_function`` (``torch.clamp(ratio, min=tis_clip_low, max=tis_clip)`` in
    ``slime/backends/megatron_utils/loss.py``, commit ``624b824``), whose defaults are
    ``--tis-clip 2.0`` and ``--tis-clip-low 0`` (``slime/utils/arguments.py``): slime's default is
    one-sided TIS (``token_tis``); the floor $l = 0.5$ here is a value some of its launch scripts
    set, not its default.

    Examples
    --------
    The ratios 1.8 and 0.2: the floor 0.5 lifts the second (``icepop`` drops it):

    >>> toy = toy_from_logits(np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]]))
    >>> token_clamp(toy, low=0.5, high=2.0, return_weights=True).round(6).tolist()
    [[1.8], [0.5]]
    """
    low, high = check_band(low, high)
    weights = np.clip(token_ratios(toy), low, high)
    return _finish(toy, weights, baseline, return_weights)


def cispo(toy, eps_low=1.0, eps_high=4.0, baseline=0.0, *, return_weights=False):
    r"""CISPO: clipped, stop-gradient token weights that never zero a token.

    $$
    \hat g_t = \mathrm{sg}\big(\mathrm{clip}(\rho_t, 1 - \varepsilon_{\mathrm{low}},
    1 + \varepsilon_{\mathrm{high}})\big)\, A\, s_t .
    $$

    From MiniMax-M1 (MiniMax, 2025): the loss is $-\mathrm{sg}(\hat r_t) A \log \pi_\theta(y_t)$,
    so the clip changes the *weight* of a token but, unlike PPO's clip, never removes its
    gradient. The paper sets no lower bound ($\varepsilon_{\mathrm{low}}$ large; here 1, i.e.
    a floor at 0) and tunes only $\varepsilon_{\mathrm{high}}$; 4.0 is this module's choice.
    In bypass mode at one step it equals ``token_clamp(low=1 - eps_low, high=1 + eps_high)``;
    the two differ when several updates reuse one batch. Biased.

    Examples
    --------
    With $\pi = (0.9, 0.1)$ and $\mu = (0.1, 0.9)$ the ratios are 9 and 1/9; the default
    $\varepsilon_{\mathrm{high}} = 4$ caps 9 at 5:

    >>> toy = toy_from_logits(np.log([[0.9, 0.1]]), np.log([[0.1, 0.9]]))
    >>> cispo(toy, return_weights=True).round(6).tolist()
    [[5.0], [0.111111]]
    """
    eps_low = check_finite_number("eps_low", eps_low)
    eps_high = check_finite_number("eps_high", eps_high, allow_inf=True)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low!r}, {eps_high!r}")
    # In bypass mode at one step, CISPO's weight is the two-sided clamp of the ratio.
    return token_clamp(toy, max(1.0 - eps_low, 0.0), 1.0 + eps_high, baseline,
                       return_weights=return_weights)


def ppo_clip_bypass(toy, eps=0.2, clip_ratio_c=3.0, baseline=0.0, *, return_weights=False):
    r"""PPO's clipped surrogate with dual clip in bypass mode: the rollout policy is the anchor.

    With $\rho_t = \pi_\theta(y_t) / \mu(y_t)$, the loss of token $t$ is PPO's
    $L_t = -\min(\rho_t A,\ \mathrm{clip}(\rho_t, 1 - \varepsilon, 1 + \varepsilon) A)$ and,
    for $A < 0$, the dual clip of Ye et al. (2020) bounds it by $-c A$: $L_t = \min(L_t, -cA)$.
    Its gradient is $\rho_t A s_t$ where the unclipped term is the active one, and 0 where a
    clipped constant is:

    $$
    w_t = \rho_t \big(1 - \mathbb{1}[A > 0,\ \rho_t > 1 + \varepsilon]
    - \mathbb{1}[A < 0,\ \rho_t < 1 - \varepsilon]
    - \mathbb{1}[A < 0,\ \rho_t > c]\big).
    $$

    This is verl's bypass mode (``bypass_mode: true`` with its default ``loss_type:
    ppo_clip``), which calls its vanilla PPO loss: ``clip_ratio`` 0.2 and ``clip_ratio_c`` 3.0
    (verl requires $c > 1$). verl also clamps $\log \rho_t$ to $[-20, 20]$, which sets to 0
    the weight of a token with $A > 0$ and $\rho_t < e^{-20}$ (here it keeps its tiny
    $\rho_t$). So PPO's trust region becomes a token mask that depends on the sign of the
    advantage. Biased.

    Parameters
    ----------
    eps : float
        $\varepsilon > 0$, PPO's clip range.
    clip_ratio_c : float
        $c > 1$, the dual clip for negative advantages; ``inf`` turns it off.

    Examples
    --------
    One position with baseline 0.5, so $A = +0.5$ for token 0 ($\rho = 0.625$) and $-0.5$ for
    token 1 ($\rho = 2.5$). Nothing is clipped by default; a dual clip $c = 2$ removes token 1:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> ppo_clip_bypass(one, baseline=0.5, return_weights=True).round(6).tolist()
    [[0.625], [2.5]]
    >>> ppo_clip_bypass(one, clip_ratio_c=2.0, baseline=0.5, return_weights=True).round(6).tolist()
    [[0.625], [0.0]]

    With the ratios 1.8 ($A > 0$) and 0.2 ($A < 0$) PPO's clip removes both:

    >>> toy = toy_from_logits(np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]]))
    >>> ppo_clip_bypass(toy, baseline=0.5, return_weights=True).round(6).tolist()
    [[0.0], [0.0]]
    """
    eps = check_finite_number("eps", eps, positive=True)
    clip_ratio_c = check_finite_number("clip_ratio_c", clip_ratio_c, allow_inf=True)
    if not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be > 1 (the dual clip bounds ratios above 1), got "
                         f"{clip_ratio_c!r}")
    baseline_value = check_finite_number("baseline", baseline)
    ratio = token_ratios(toy)  # (M, T): PPO's ratio, anchored at the rollout policy
    advantage = (toy["R"] - baseline_value)[:, None]  # (M, 1)
    # The clipped branch of min(ratio A, clip(ratio) A) is a constant: no gradient there.
    clipped = ((advantage > 0) & (ratio > 1 + eps)) | ((advantage < 0) & (ratio < 1 - eps))
    # Dual clip: for A < 0 the loss is min(L, -c A), a constant once ratio > c.
    dual_clipped = (advantage < 0) & (ratio > clip_ratio_c)
    weights = np.where(clipped | dual_clipped, 0.0, ratio)
    return _finish(toy, weights, baseline, return_weights)


def token_veto(toy, threshold=1e-4, baseline=0.0, *, return_weights=False):
    r"""Catastrophic-token veto: reject the sequence if any $\rho_t < \tau$.

    $$
    \hat g_t = \mathbb{1}\big[\min_k \rho_k \ge \tau\big]\, A\, s_t .
    $$

    A token the trainer finds $1/\tau = 10^4$ times less likely than the sampler did is a sign
    of a numerical accident, and the whole sequence is dropped. Rejection only, so biased in
    general when $\mu \ne \pi$: the kept sequences are still drawn from $\mu$, with weight 1.

    This was verl's ``rollout_token_veto_threshold`` (off by default; 1e-4 in the presets that
    combined geometric rejection with it, such as ``decoupled_geo_rs``), removed in January
    2026. verl today has no one-sided veto; the nearest are ``rollout_rs: seq_max_k2`` and
    ``seq_max_k3``, which reject a sequence when any token's $\tfrac12 (\log \rho_t)^2$ or
    $\rho_t - 1 - \log \rho_t$ exceeds a bound, on both sides of $\rho_t = 1$; no preset
    uses them.

    Examples
    --------
    The threshold 0.7 vetoes token 0, whose ratio is 0.625:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> token_veto(one, threshold=0.7, return_weights=True).tolist()
    [0.0, 1.0]
    """
    threshold = check_finite_number("threshold", threshold)
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    rho_t = token_ratios(toy)
    if "mask" in toy:  # the padding after <eos> is no token of the response
        rho_t = np.where(np.asarray(toy["mask"]) > 0, rho_t, np.inf)
    keep = rho_t.min(axis=1) >= threshold
    weights = keep.astype(float)
    return _finish(toy, weights, baseline, return_weights)


def k3_seq_rs(toy, threshold=0.01, baseline=0.0, *, return_weights=False):
    r"""Sequence rejection by the mean k3 divergence of its tokens.

    $$
    \bar k_3 = \frac1T \sum_t (\rho_t - 1 - \log \rho_t), \qquad
    \hat g_t = \mathbb{1}[\bar k_3 \le \tau]\, A\, s_t .
    $$

    With $y_t \sim \mu_t$, $\mathbb{E}_{\mu_t}[\rho_t - 1 - \log \rho_t] = \mathrm{KL}(\mu_t
    \,\|\, \pi_t)$, and each term is $\ge 0$: $\bar k_3$ is a per-token estimate of how far
    sampler and trainer are apart on this sequence. verl ``rollout_rs: seq_mean_k3``, whose
    presets (``decoupled_k3_rs``, ``bypass_ppo_clip_k3_rs`` and the ``k3_rs`` combinations with
    TIS) set ``rollout_rs_threshold`` to 0.01, the default here. Rejection only. Biased in
    general.

    Examples
    --------
    One position: $k_3(0.625) = 0.0950$, $k_3(2.5) = 0.5837$; the threshold 0.1 keeps token 0
    only:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> k3_seq_rs(one, threshold=0.1, return_weights=True).tolist()
    [1.0, 0.0]
    """
    threshold = check_finite_number("threshold", threshold, allow_inf=True)
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    with np.errstate(over="ignore"):  # rho_t beyond float max: k3 = inf, rejected
        k3 = np.expm1(log_rho_t) - log_rho_t  # rho - 1 - log rho, accurate near rho = 1
    if "mask" in toy:  # the mean over the response's own tokens
        mean_k3 = (np.where(np.asarray(toy["mask"]) > 0, k3, 0.0).sum(axis=1)
                   / _response_lengths(toy))
    else:
        mean_k3 = k3.mean(axis=1)
    weights = (mean_k3 <= threshold).astype(float)
    return _finish(toy, weights, baseline, return_weights)


def geo_rs_token_tis(toy, low=1 / 1.001, high=1 / 0.999, cap=2.0, baseline=0.0, *,
                     return_weights=False):
    r"""Geometric rejection combined with token TIS: $w_t = \mathbb{1}[l \le \rho_{\mathrm{geo}}
    \le h] \min(\rho_t, C)$.

    Reject the sequences that are far off on average, reweight the tokens of the others. verl's
    presets ``decoupled_geo_rs_token_tis`` and ``bypass_pg_geo_rs_token_tis``: ``rollout_is:
    token`` (threshold 2.0) with ``rollout_rs: seq_mean_k1`` at ``"0.999_1.001"``, which keeps
    $1/1.001 \le \rho_{\mathrm{geo}} \le 1/0.999$ (see ``geo_rs``). Biased.

    Examples
    --------
    Two positions, the band $[0.8, 1.3]$ and the cap 1.5: the sequences $(0, 0)$ and $(1, 1)$
    are rejected, and the ratio 2.5 of token 1 is capped in the other two:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> geo_rs_token_tis(two, low=0.8, high=1.3, cap=1.5, return_weights=True).round(6).tolist()
    [[0.0, 0.0], [0.625, 1.5], [1.5, 0.625], [0.0, 0.0]]
    """
    low, high = check_band(low, high)
    cap = check_finite_number("cap", cap, positive=True, allow_inf=True)
    keep = geo_rs(toy, low, high, return_weights=True)  # (M,)
    weights = keep[:, None] * token_tis(toy, cap, return_weights=True)
    return _finish(toy, weights, baseline, return_weights)


def gspo(toy, eps_low=3e-4, eps_high=4e-4, baseline=0.0, *, return_weights=False):
    r"""GSPO: the geometric sequence ratio as every token's weight, PPO-clipped, bypass mode.

    $$
    w_t = \rho_{\mathrm{geo}} \big(1 - \mathbb{1}[A > 0,\ \rho_{\mathrm{geo}} > 1 +
    \varepsilon_h] - \mathbb{1}[A < 0,\ \rho_{\mathrm{geo}} < 1 - \varepsilon_l]\big).
    $$

    From C. Zheng et al., *Group Sequence Policy Optimization* (Qwen, 2025), with its clip
    range $\varepsilon_l = 3 \cdot 10^{-4}$, $\varepsilon_h = 4 \cdot 10^{-4}$. In TRL:
    ``GRPOConfig(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)`` (the
    ratio is the exponential of the mean token log-ratio; TRL's default clip range is 0.2, and
    its anchor is the old policy, not the sampler). The GSPO objective also divides each
    sequence's log-likelihood by its length; that is a loss-reduction choice (see
    [opd_literate.opd.aggregate_loss][]) and is left out here so that every estimator targets
    the same $\nabla J$. Biased.

    Examples
    --------
    One position, $\pi = (0.8, 0.2)$, $\mu = (0.5, 0.5)$: the ratios are 1.6 and 0.4. With
    baseline 0, token 0 has $A = 1 > 0$ and a ratio above $1 + \varepsilon_h$: clipped;
    token 1 has $A = 0$: kept.

    >>> toy = toy_from_logits(np.log([[0.8, 0.2]]), np.log([[0.5, 0.5]]))
    >>> gspo(toy, return_weights=True).round(6).tolist()
    [0.0, 0.4]
    """
    eps_low = check_finite_number("eps_low", eps_low, positive=True)
    eps_high = check_finite_number("eps_high", eps_high, positive=True)
    baseline_value = check_finite_number("baseline", baseline)
    ratio = geometric_ratio(toy)  # (M,): GSPO's sequence ratio s(y)
    advantage = toy["R"] - baseline_value
    clipped = ((advantage > 0) & (ratio > 1 + eps_high)) | (
        (advantage < 0) & (ratio < 1 - eps_low))
    weights = np.where(clipped, 0.0, ratio)
    return _finish(toy, weights, baseline, return_weights)


def _dppo_weights(toy, divergence, delta_low, delta_high, clip_ratio_c, baseline):
    r"""DPPO's weight $\min(\rho_t, c)\, m_t$ (``divergence`` "tv" or "kl") on checked options."""
    log_p, log_q = toy["logp_train"], toy["logp_sampler"]  # (M, T): log pi(y_t), log mu(y_t)
    p, q = np.exp(log_p), np.exp(log_q)
    if divergence == "tv":
        # pi(y_t) - mu(y_t): the TV of "y_t or not", one side per sign of the advantage
        inside_up, inside_down = p - q <= delta_high, p - q >= -delta_low
    else:
        not_p, not_q = -np.expm1(log_p), -np.expm1(log_q)  # 1 - p, 1 - q, exact near 1
        kl = q * (log_q - log_p) + not_q * np.log((not_q + BINARY_KL_EPS)
                                                  / (not_p + BINARY_KL_EPS))
        inside_up = (kl <= delta_high) | (p <= q)
        inside_down = (kl <= delta_low) | (p >= q)
    advantage = (toy["R"] - baseline)[:, None]  # (M, 1)
    inside = np.where(advantage > 0, inside_up, inside_down)  # A = 0: verl's A <= 0 side
    return np.where(inside, np.minimum(token_ratios(toy), clip_ratio_c), 0.0)


def _check_dppo(delta_low, delta_high, clip_ratio_c, baseline):
    delta_low = check_finite_number("delta_low", delta_low, low=0.0, allow_inf=True)
    delta_high = check_finite_number("delta_high", delta_high, low=0.0, allow_inf=True)
    clip_ratio_c = check_finite_number("clip_ratio_c", clip_ratio_c, positive=True,
                                       allow_inf=True)
    return delta_low, delta_high, clip_ratio_c, check_finite_number("baseline", baseline)


def dppo_tv(toy, delta_low=0.2, delta_high=0.2, clip_ratio_c=3.0, baseline=0.0, *,
            return_weights=False):
    r"""DPPO-Binary-TV, bypass mode: the truncated ratio inside a trust region on $\pi - \mu$.

    $$
    w_t = \min(\rho_t, c)\, \Big(\mathbb{1}[A > 0]\, \mathbb{1}[\pi(y_t) - \mu(y_t) \le
    \delta_h] + \mathbb{1}[A \le 0]\, \mathbb{1}[\pi(y_t) - \mu(y_t) \ge -\delta_l]\Big).
    $$

    From P. Qi et al., *Rethinking the Trust Region in LLM Reinforcement Learning* (DPPO,
    2026): PPO's clip bounds the ratio $\rho_t$, which removes a rare token whose probability
    moved a little (0.01 to 0.02 doubles its ratio) and keeps a frequent one that moved a lot;
    DPPO bounds the probability difference instead, one-sided in the advantage's direction as
    PPO's clip is, and truncates the ratio at $c$ (no dual clip). verl ``loss_mode: dppo_tv``
    (its ``clip_ratio_low`` / ``clip_ratio_high`` are $\delta_l, \delta_h$, 0.2 each, and
    ``clip_ratio_c`` is $c$, 3.0 in its ``ActorConfig``: the defaults here), with the sampler
    as the anchor (verl's ``bypass_mode`` in its default trainer; see
    [opd_literate.mismatch.correction.dppo_tv_loss][]), at $\theta_{\mathrm{old}} = \theta$.
    A token with $A = 0$ gets the $A \le 0$ side, as in verl: its estimate is 0 either way,
    but it counts as modified when outside. Biased: the token ratio of ``token_is``, the
    truncation and the mask.

    Parameters
    ----------
    delta_low, delta_high : float
        $\delta_l, \delta_h \ge 0$; ``inf`` for no bound on that side.
    clip_ratio_c : float
        $c > 0$, the cap of the ratio; ``inf`` for none.

    Examples
    --------
    One position, $\pi = (0.04, 0.96)$, $\mu = (0.01, 0.99)$, baseline 0.5: token 0 ($A > 0$,
    $\rho = 4$) moved by $0.03 \le 0.2$ and keeps the capped ratio 3, where
    ``ppo_clip_bypass`` zeroes it; token 1 ($A < 0$) keeps its ratio $0.96 / 0.99$:

    >>> rare = toy_from_logits(np.log([[0.04, 0.96]]), np.log([[0.01, 0.99]]))
    >>> dppo_tv(rare, baseline=0.5, return_weights=True).round(6).tolist()
    [[3.0], [0.969697]]
    >>> ppo_clip_bypass(rare, baseline=0.5, return_weights=True).round(6).tolist()
    [[0.0], [0.969697]]

    With $\pi = (0.9, 0.1)$, $\mu = (0.5, 0.5)$ both tokens moved by 0.4 in their advantage's
    direction: both are out of the region.

    >>> toy = toy_from_logits(np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]]))
    >>> dppo_tv(toy, baseline=0.5, return_weights=True).round(6).tolist()
    [[0.0], [0.0]]
    """
    delta_low, delta_high, clip_ratio_c, baseline_value = _check_dppo(
        delta_low, delta_high, clip_ratio_c, baseline)
    check_toy(toy)
    weights = _dppo_weights(toy, "tv", delta_low, delta_high, clip_ratio_c, baseline_value)
    return _finish(toy, weights, baseline, return_weights)


def dppo_kl(toy, delta_low=0.2, delta_high=0.2, clip_ratio_c=3.0, baseline=0.0, *,
            return_weights=False):
    r"""DPPO-Binary-KL, bypass mode: the truncated ratio inside a trust region on a binary KL.

    ``dppo_tv`` with the region $D_t \le \delta$ instead of $|\pi(y_t) - \mu(y_t)| \le \delta$,
    where $D_t$ is the KL between the distributions of "the token $y_t$ or another" under
    $\mu$ and $\pi$, in verl's form ($\epsilon = 10^{-8}$):

    $$
    \begin{aligned}
    D_t &= \mu(y_t) \log \frac{\mu(y_t)}{\pi(y_t)} + (1 - \mu(y_t))
    \log \frac{1 - \mu(y_t) + \epsilon}{1 - \pi(y_t) + \epsilon}, \\
    w_t &= \min(\rho_t, c)\, \Big(\mathbb{1}[A > 0]\, \mathbb{1}[D_t \le \delta_h
    \text{ or } \pi \le \mu] \\
    &\qquad + \mathbb{1}[A \le 0]\, \mathbb{1}[D_t \le \delta_l
    \text{ or } \pi \ge \mu]\Big).
    \end{aligned}
    $$

    verl ``loss_mode: dppo_kl`` (same options and defaults as ``dppo_tv``; verl's example
    script sets $\delta = 0.05$ for this variant). The KL is large for a rare token that
    became likely and small for a frequent token that moved by as much. Biased.

    Examples
    --------
    One position, $\pi = (0.81, 0.19)$, $\mu = (0.6, 0.4)$, baseline 0.5: both tokens moved
    by $0.21 > 0.2$ in their advantage's direction (token 0, $A > 0$, rose; token 1, $A < 0$,
    fell), out of TV's region, but $D = 0.118$ for both, inside the KL's:

    >>> toy = toy_from_logits(np.log([[0.81, 0.19]]), np.log([[0.6, 0.4]]))
    >>> dppo_kl(toy, baseline=0.5, return_weights=True).round(6).tolist()
    [[1.35], [0.475]]
    >>> dppo_tv(toy, baseline=0.5, return_weights=True).round(6).tolist()
    [[0.0], [0.0]]
    """
    delta_low, delta_high, clip_ratio_c, baseline_value = _check_dppo(
        delta_low, delta_high, clip_ratio_c, baseline)
    check_toy(toy)
    weights = _dppo_weights(toy, "kl", delta_low, delta_high, clip_ratio_c, baseline_value)
    return _finish(toy, weights, baseline, return_weights)


# ---------------------------------------------------------------------------------------------
# The switches of other frameworks: TRL's vLLM correction, seq-mask-tis, KPop
# ---------------------------------------------------------------------------------------------
def _check_trl_band(clip_min, clip_max):
    r"""TRL's bounds $[C_{\min}, C_{\max}]$: its ``None`` is 0 below and ``inf`` above here."""
    clip_min = check_finite_number("clip_min", clip_min, low=0.0)
    clip_max = check_finite_number("clip_max", clip_max, positive=True, allow_inf=True)
    if not clip_min < clip_max:  # GRPOConfig refuses clip_min >= clip_max
        raise ValueError(f"clip_min must be < clip_max (as TRL's GRPOConfig requires), got "
                         f"clip_min={clip_min!r} >= clip_max={clip_max!r}")
    return clip_min, clip_max


def _trl_vllm_weights(toy, level, constraint, clip_min, clip_max):
    """TRL's vLLM importance weights on checked bounds: (M, T) per token, (M,) per sequence."""
    if level == "token":
        ratio = token_ratios(toy)
    else:  # exp of the summed log-ratios, capped in log space as seq_tis does
        with np.errstate(divide="ignore"):  # log(inf) = inf for an infinite clip_max
            log_rho = np.minimum(_log_seq_ratio(toy), np.log(clip_max) + 1.0)
        ratio = exp_ratio(log_rho, "sequence", toy)
    if constraint == "truncate":
        return np.clip(ratio, clip_min, clip_max)
    return np.where((ratio >= clip_min) & (ratio <= clip_max), ratio, 0.0)


def trl_token_truncate(toy, clip_min=0.0, clip_max=3.0, baseline=0.0, *, return_weights=False):
    r"""TRL's ``vllm_importance_sampling_mode="token_truncate"``: $w_t = \mathrm{clip}(\rho_t,
    C_{\min}, C_{\max})$.

    $$
    \hat g_t = \min(\max(\rho_t, C_{\min}), C_{\max})\, A\, s_t .
    $$

    TRL's ``GRPOTrainer`` (TRL 1.16.0, ``trl/trainer/grpo_trainer.py``) computes, when it
    samples with vLLM, the ratio of the trainer's recomputed log-probability to vLLM's, clamps
    it to ``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]`` (defaults
    ``None`` and 3.0; ``vllm_importance_sampling_cap`` is the deprecated name of the upper
    bound) and multiplies its per-token loss by it. The anchor of its PPO ratio is the
    trainer's own recomputation, so at one update a batch the weight of $A s_t$ is this
    truncated $\rho_t$. TRL's ``None`` bound is ``clip_min=0`` or ``clip_max=inf`` here (no
    floor is a floor at 0: ratios are positive). ``token_tis`` with TRL's cap and a floor:
    biased, as ``token_tis`` and ``token_clamp`` are.

    Parameters
    ----------
    clip_min : float
        $C_{\min} \ge 0$, finite.
    clip_max : float
        $C_{\max} > C_{\min}$; ``inf`` for none.

    Examples
    --------
    The ratios 0.625 and 2.5: the floor 0.7 lifts the first, the cap 2 lowers the second:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> trl_token_truncate(one, clip_min=0.7, clip_max=2.0, return_weights=True).round(6).tolist()
    [[0.7], [2.0]]
    """
    clip_min, clip_max = _check_trl_band(clip_min, clip_max)
    weights = _trl_vllm_weights(toy, "token", "truncate", clip_min, clip_max)
    return _finish(toy, weights, baseline, return_weights)


def trl_token_mask(toy, clip_min=0.0, clip_max=3.0, baseline=0.0, *, return_weights=False):
    r"""TRL's ``vllm_importance_sampling_mode="token_mask"``: $w_t = \rho_t\,
    \mathbb{1}[C_{\min} \le \rho_t \le C_{\max}]$.

    $$
    \hat g_t = \rho_t\, \mathbb{1}[C_{\min} \le \rho_t \le C_{\max}]\, A\, s_t .
    $$

    TRL sets to 0 a ratio below ``vllm_importance_sampling_clip_min`` or above
    ``vllm_importance_sampling_clip_max`` (strict comparisons, so a ratio on a bound is kept)
    and keeps the others unchanged: ``token_mis`` (or IcePop) with TRL's band, $[0, 3]$ by
    default. Biased.

    Examples
    --------
    The cap 2 drops the ratio 2.5 of token 1; TRL's default cap 3 keeps it:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> trl_token_mask(one, clip_max=2.0, return_weights=True).round(6).tolist()
    [[0.625], [0.0]]
    >>> trl_token_mask(one, return_weights=True).round(6).tolist()
    [[0.625], [2.5]]
    """
    clip_min, clip_max = _check_trl_band(clip_min, clip_max)
    weights = _trl_vllm_weights(toy, "token", "mask", clip_min, clip_max)
    return _finish(toy, weights, baseline, return_weights)


def trl_sequence_truncate(toy, clip_min=0.0, clip_max=3.0, baseline=0.0, *,
                          return_weights=False):
    r"""TRL's ``vllm_importance_sampling_mode="sequence_truncate"``: $w_t = \mathrm{clip}(\rho,
    C_{\min}, C_{\max})$ on every token.

    $$
    \rho = \exp \sum_t \big(\log \pi(y_t) - \log \mu(y_t)\big), \qquad
    \hat g_t = \min(\max(\rho, C_{\min}), C_{\max})\, A\, s_t .
    $$

    The sequence ratio is the exponential of the *summed* log-ratios (not their mean, as
    GSPO's and ``geo_rs``'s are), one weight for all the tokens of the response. With
    $C_{\min} = 0$ this is ``seq_tis`` at TRL's cap 3; its bias is then
    $-\mathbb{E}_\mu[(\rho - C_{\max})_+ A \sum_t s_t]$, and a floor adds
    $+\mathbb{E}_\mu[(C_{\min} - \rho)_+ A \sum_t s_t]$. Biased.

    Examples
    --------
    Two positions, $\rho = (0.390625, 1.5625, 1.5625, 6.25)$: the floor 0.5 lifts the first,
    TRL's cap 3 lowers the last:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> trl_sequence_truncate(two, clip_min=0.5, return_weights=True).round(6).tolist()
    [0.5, 1.5625, 1.5625, 3.0]
    """
    clip_min, clip_max = _check_trl_band(clip_min, clip_max)
    weights = _trl_vllm_weights(toy, "sequence", "truncate", clip_min, clip_max)
    return _finish(toy, weights, baseline, return_weights)


def trl_sequence_mask(toy, clip_min=0.0, clip_max=3.0, baseline=0.0, *, return_weights=False):
    r"""TRL's ``vllm_importance_sampling_mode="sequence_mask"``, its default: $w_t = \rho\,
    \mathbb{1}[C_{\min} \le \rho \le C_{\max}]$ on every token.

    $$
    \hat g_t = \rho\, \mathbb{1}[C_{\min} \le \rho \le C_{\max}]\, A\, s_t .
    $$

    The mode that ``GRPOConfig`` selects by default in TRL 1.16.0 (its field and its
    docstring's first line say ``"sequence_mask"``; the docstring's list of modes still calls
    ``token_truncate`` the default). ``seq_mis`` with TRL's band $[0, 3]$: the kept sequences
    keep their exact ratio, so the bias is the dropped mass,
    $-\mathbb{E}_\mu[\rho\, \mathbb{1}[\rho \notin [C_{\min}, C_{\max}]]\, A \sum_t s_t]$.
    The ratio is a product over the tokens: the longer the response, the more of them fall
    outside any fixed band. Biased.

    Examples
    --------
    TRL's default cap 3 drops the sequence $(1, 1)$ ($\rho = 6.25$):

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> trl_sequence_mask(two, return_weights=True).round(6).tolist()
    [0.390625, 1.5625, 1.5625, 0.0]
    """
    clip_min, clip_max = _check_trl_band(clip_min, clip_max)
    weights = _trl_vllm_weights(toy, "sequence", "mask", clip_min, clip_max)
    return _finish(toy, weights, baseline, return_weights)


def off_policy_mask(toy, threshold=0.5, baseline=0.0, *, return_weights=False):
    r"""TRL's off-policy sequence mask (DeepSeek-V3.2): drop a sequence with $A < 0$ whose
    mean log-ratio to the sampler exceeds $\delta$.

    $$
    \bar k_1 = \frac1T \sum_t \big(\log \mu(y_t) - \log \pi(y_t)\big), \qquad
    \hat g_t = \mathbb{1}\big[A \ge 0 \text{ or } \bar k_1 \le \delta\big]\, A\, s_t .
    $$

    TRL's ``off_policy_mask_threshold`` ($\delta$; ``None``, off, by default; its help suggests
    0.5, the default here), ``GRPOTrainer.get_off_policy_mask`` in TRL 1.16.0: $\bar k_1$ is
    the k1 estimate of $\mathrm{KL}(\mu \,\|\, \pi)$ from the sampled tokens, and only a
    sequence the policy would push *down* is dropped, on the argument that its tokens are the
    ones a stale sample makes harmful. A sequence with $A = 0$ is kept. In TRL the mask
    multiplies the loss together with the vLLM importance weight (on by default,
    ``trl_sequence_mask``); here it stands alone, on the weight 1. Rejection only, depending
    on the sign of the advantage: biased.

    Parameters
    ----------
    threshold : float
        $\delta$, finite (``inf`` keeps everything).

    Examples
    --------
    One position, $\pi = (0.5, 0.5)$, $\mu = (0.2, 0.8)$, baseline 0.5. Token 1 has $A < 0$
    and $\bar k_1 = \log(0.8 / 0.5) = 0.470$: dropped at $\delta = 0.4$, kept at 0.5.
    Token 0 has $A > 0$: kept whatever its $\bar k_1 = \log 0.4$.

    >>> flip = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.2, 0.8]]))  # rho_t = 2.5, 0.625
    >>> off_policy_mask(flip, threshold=0.4, baseline=0.5, return_weights=True).tolist()
    [1.0, 0.0]
    >>> off_policy_mask(flip, threshold=0.5, baseline=0.5, return_weights=True).tolist()
    [1.0, 1.0]
    """
    threshold = check_finite_number("threshold", threshold, allow_inf=True)
    baseline_value = check_finite_number("baseline", baseline)
    check_toy(toy)
    k1 = toy["logp_sampler"] - toy["logp_train"]  # (M, T): log mu(y_t) - log pi(y_t)
    if "mask" in toy:  # the mean over the response's own tokens
        k1 = np.where(np.asarray(toy["mask"]) > 0, k1, 0.0)
    mean_k1 = k1.sum(axis=1) / _response_lengths(toy)  # (M,)
    advantage = toy["R"] - baseline_value
    weights = ((advantage >= 0) | (mean_k1 <= threshold)).astype(float)
    return _finish(toy, weights, baseline, return_weights)


def seq_mask_tis(toy, low=0.999, high=1.002, baseline=0.0, *, return_weights=False):
    r"""seq-mask-tis (OpenRLHF, NeMo-RL): the token ratio, untruncated, in the sequences whose
    geometric ratio lies in $[l, h]$.

    $$
    \hat g_t = \rho_t\, \mathbb{1}[l \le \rho_{\mathrm{geo}} \le h]\, A\, s_t, \qquad
    \rho_{\mathrm{geo}} = \exp\Big(\tfrac1T \sum_t \log \rho_t\Big).
    $$

    Despite the name, nothing is truncated: both frameworks mask by the geometric mean and
    keep the raw token ratio. OpenRLHF ``--algo.advantage.is_correction_type seq-mask-tis``
    (``openrlhf/models/loss.py`` at commit ``3c3be62``; its comment says the token weights
    "still use TIS (token-level clamp)", the code does not clamp), with the band
    ``--algo.advantage.is_correction_threshold``, ``[0.5, 5.0]`` by default (shared with
    ``tis`` and ``icepop``). NeMo-RL ``truncated_importance_sampling_type: seq-mask-tis``
    (``nemo_rl/algorithms/loss/loss_functions.py`` at commit ``7ea279a``) with
    ``truncated_importance_sampling_ratio_min`` and ``truncated_importance_sampling_ratio``,
    both required, and the reference band $[0.999, 1.002]$ of its comment: the defaults here.
    (NeMo-RL's mean divides by $T + 10^{-8}$, OpenRLHF's by $T$.) ``geo_rs`` with the token
    ratio instead of the weight 1, or ``geo_rs_token_tis`` without the cap. Biased.

    Examples
    --------
    The geometric ratios of the two-position toy are $0.625, 1.25, 1.25, 2.5$; the band
    $[0.8, 1.3]$ keeps the middle two, with their token ratios, the 2.5 uncapped:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> seq_mask_tis(two, low=0.8, high=1.3, return_weights=True).round(6).tolist()
    [[0.0, 0.0], [0.625, 2.5], [2.5, 0.625], [0.0, 0.0]]
    """
    low, high = check_band(low, high)
    keep = geo_rs(toy, low, high, return_weights=True)  # (M,): 1 inside the geometric band
    weights = keep[:, None] * token_ratios(toy)
    return _finish(toy, weights, baseline, return_weights)


def kpop(toy, threshold=0.1, eps=1e-6, baseline=0.0, *, return_weights=False):
    r"""KPop: the token ratio, masked where either binary KL between $\pi(y_t)$ and $\mu(y_t)$
    exceeds $\phi$.

    With $p = \pi(y_t)$, $q = \mu(y_t)$, both clamped to $[\epsilon, 1 - \epsilon]$, and the KL
    between the Bernoulli distributions of "the token $y_t$ or another",

    $$
    \mathrm{kl}(p, q) = p \log \frac{p}{q} + (1 - p) \log \frac{1 - p}{1 - q}, \qquad
    \hat g_t = \rho_t\, \mathbb{1}\big[\max(\mathrm{kl}(p, q), \mathrm{kl}(q, p)) \le \phi\big]
    \, A\, s_t .
    $$

    KPop: a trust region on the binary KL, both ways, which is wide in
    ratio for a rare token and tight for a likely one. prime-rl's ``kpop`` loss type
    (``src/prime_rl/trainer/rl/loss.py``, ``kpop_loss_fn``, at commit ``b9ba060`` on its
    branch ``feat/algo-ablations``: $\phi$ = ``kpop_threshold`` 0.1 and $\epsilon = 10^{-6}$,
    the defaults here; its loss also adds ``kl_tau`` $(\log \rho_t)^2$, a regulariser with no
    weight $w_t$, left out). AReaL's ``rejection_sampling.metric: binary_kl``
    (``areal/utils/functional/functional.py`` at commit ``cbff54d``) is the same rule with
    $\epsilon = 10^{-8}$ and $\phi$ = ``upper`` (2.0 in its example), though its
    ``RejectionSamplingConfig`` at that commit refuses ``binary_kl`` (``_VALID_METRICS`` in
    ``areal/api/cli_args.py``). verl 0.9.1 has no such option (its PR #6800, which adds
    ``rollout_rs: binary_kl``, is open). Unlike ``dppo_kl`` the region does not depend on the
    sign of the advantage, and the ratio is not capped. Biased.

    Parameters
    ----------
    threshold : float
        $\phi \ge 0$ (``inf`` keeps every token).
    eps : float
        $0 < \epsilon < 0.5$, the clamp that keeps $\log p$ and $\log(1 - p)$ finite.

    Examples
    --------
    Three tokens, $\pi = (0.5, 0.04, 0.46)$, $\mu = (0.8, 0.02, 0.18)$. Token 1 doubled its
    probability, but from 0.02: $\mathrm{kl} = 0.008$ and $0.006$, kept with its ratio 2. Token 0
    moved from 0.8 to 0.5, a ratio of only 0.625, but $\mathrm{kl}(p, q) = 0.223 > 0.1$:
    masked, as is token 2 ($\mathrm{kl} = 0.206$ and $0.174$):

    >>> toy = toy_from_logits(np.log([[0.5, 0.04, 0.46]]), np.log([[0.8, 0.02, 0.18]]))
    >>> kpop(toy, return_weights=True).round(6).tolist()
    [[0.0], [2.0], [0.0]]
    """
    threshold = check_finite_number("threshold", threshold, low=0.0, allow_inf=True)
    eps = check_finite_number("eps", eps, positive=True)
    if not eps < 0.5:
        raise ValueError(f"eps must be < 0.5 (the clamp [eps, 1 - eps] must be an interval "
                         f"holding more than 0.5), got {eps!r}")
    check_toy(toy)
    p = np.clip(np.exp(toy["logp_train"]), eps, 1.0 - eps)  # (M, T): pi(y_t)
    q = np.clip(np.exp(toy["logp_sampler"]), eps, 1.0 - eps)  # (M, T): mu(y_t)
    # kept where both directions are within phi (prime-rl masks kl > phi, AReaL keeps <= phi)
    keep = np.maximum(_binary_kl(p, q), _binary_kl(q, p)) <= threshold
    weights = np.where(keep, token_ratios(toy), 0.0)
    return _finish(toy, weights, baseline, return_weights)


def _binary_kl(p, q):
    """kl(p, q) of Bernoulli(p) and Bernoulli(q), elementwise."""
    return p * np.log(p / q) + (1.0 - p) * np.log((1.0 - p) / (1.0 - q))


# ---------------------------------------------------------------------------------------------
# The policy losses of verl and TRL beyond the clip: soft gates, geometric means, covariances
# ---------------------------------------------------------------------------------------------
def _sech2(x):
    r"""$\mathrm{sech}^2(x / 2) = 4 \sigma(x) (1 - \sigma(x))$, without overflow for large $|x|$."""
    e = np.exp(-np.abs(x))
    return 4.0 * e / (1.0 + e) ** 2


def sapo(toy, tau_pos=1.0, tau_neg=1.05, baseline=0.0, *, return_weights=False):
    r"""SAPO, bypass mode: the token ratio damped by a smooth gate instead of a clip.

    The loss of token $t$ is $L_t = -f_\tau(\rho_t) A$ with the gate
    $f_\tau(r) = \frac{4}{\tau} \sigma(\tau (r - 1))$, $\tau = \tau_+$ where $A > 0$ and
    $\tau_-$ where $A \le 0$. Since $\frac{d}{dr} f_\tau(r) = 4 \sigma(1 - \sigma) =
    \mathrm{sech}^2(\tau (r - 1) / 2)$ and $\nabla \rho_t = \rho_t s_t$:

    $$
    w_t = \rho_t\, \mathrm{sech}^2\Big(\frac{\tau (\rho_t - 1)}{2}\Big), \qquad
    \hat g_t = w_t\, A\, s_t .
    $$

    The gate is 1 at $\rho_t = 1$ and falls off smoothly on both sides: near the anchor the
    weight is the token ratio of ``token_is``, far from it $w_t \to 0$ (exponentially in
    $\rho_t$ above, like $\rho_t$ below), a soft form of PPO's hard clip. From *Soft Adaptive Policy
    Optimization* (arXiv 2511.20347, 2025). verl ``loss_mode: sapo``
    (``compute_policy_loss_sapo``: the actor's ``tau_pos`` 1.0 and ``tau_neg`` 1.05, the
    defaults here) and TRL ``loss_type="sapo"`` (``sapo_temperature_pos`` 1.0,
    ``sapo_temperature_neg`` 1.05); both take $\tau_+$ where $A > 0$ only. Both frameworks
    reduce it per response (``"seq-mean-token-mean"``, verl whatever ``loss_agg_mode`` says), a
    reduction left out here as for ``gspo``. The anchor is the sampler (verl's
    ``bypass_mode`` in its default trainer); TRL's anchor is its own recomputation, so there
    the gate is 1 at one update a batch and the sampler enters through its vLLM weight
    (``trl_sequence_mask`` by default). Biased.

    Parameters
    ----------
    tau_pos, tau_neg : float
        $\tau_+, \tau_- > 0$, finite.

    Examples
    --------
    One position, baseline 0.5: token 0 ($\rho = 0.625$, $A > 0$) gets
    $0.625\, \mathrm{sech}^2(0.1875) = 0.6035$; token 1 ($\rho = 2.5$, $A < 0$)
    $2.5\, \mathrm{sech}^2(1.05 \cdot 1.5 / 2) = 1.4209$, where ``token_is`` keeps 2.5:

    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> sapo(one, baseline=0.5, return_weights=True).round(4).tolist()
    [[0.6035], [1.4209]]
    """
    tau_pos = check_finite_number("tau_pos", tau_pos, positive=True)
    tau_neg = check_finite_number("tau_neg", tau_neg, positive=True)
    baseline_value = check_finite_number("baseline", baseline)
    ratio = token_ratios(toy)  # (M, T)
    advantage = (toy["R"] - baseline_value)[:, None]  # (M, 1)
    tau = np.where(advantage > 0, tau_pos, tau_neg)  # (M, 1): verl's and TRL's A > 0 test
    # d/d log pi of f_tau(rho_t) = f_tau'(rho_t) rho_t, f_tau' = sech^2(tau (rho_t - 1) / 2)
    weights = ratio * _sech2(tau * (ratio - 1.0))
    return _finish(toy, weights, baseline, return_weights)


def gmpo(toy, eps_low=0.2, eps_high=0.2, baseline=0.0, *, return_weights=False):
    r"""GMPO (verl's ``geo_mean``), bypass mode: the geometric mean of token ratios clipped in
    log space, each clipped token removed.

    With $x_t = \log \rho_t$, GMPO clips $x_t$ at $\varepsilon_h$ from above where $A > 0$ and
    at $-\varepsilon_l$ from below where $A < 0$: $m_t = \min(x_t, \varepsilon_h)$ or
    $\max(x_t, -\varepsilon_l)$. The loss of a response is $-A \exp(\frac1T \sum_k m_k)$; a
    clipped $m_t$ is a constant, so

    $$
    w_t = \exp\Big(\frac1T \sum_k m_k\Big)\, \big(1 - \mathbb{1}[A > 0,\ x_t > \varepsilon_h]
    - \mathbb{1}[A < 0,\ x_t < -\varepsilon_l]\big), \qquad \hat g_t = w_t\, A\, s_t .
    $$

    Unlike GSPO (``gspo``), the clip acts on each token, and a clipped token still counts in the
    mean with its clipped value: the other tokens' weight is the geometric mean of the *clipped*
    ratios, not $\rho_{\mathrm{geo}}$. From *Geometric-Mean Policy Optimization* (arXiv
    2507.20673, 2025). verl ``loss_mode: geo_mean`` (``compute_policy_loss_geo_mean``), with the
    actor's ``clip_ratio_low`` / ``clip_ratio_high`` as $\varepsilon_l, \varepsilon_h$ in log
    space (0.2 each: the defaults here, i.e. ratios in $[e^{-0.2}, e^{0.2}]$). verl's loss is
    the mean over responses of $-A \exp(\cdot)$ whatever ``loss_agg_mode`` says, which divides
    each token's gradient by the length (by $T + 10^{-8}$); that division is left out here as
    for ``gspo``. verl's $\mathrm{sign}(0) = 0$ sends no gradient where $A = 0$; the weight
    there is taken unclipped, $\rho_{\mathrm{geo}}$ (its estimate is 0 either way). Biased.

    Parameters
    ----------
    eps_low, eps_high : float
        $\varepsilon_l, \varepsilon_h \ge 0$, in log space; ``inf`` for no clip on that side.

    Examples
    --------
    Two positions, $\log \rho_t = \log 0.625, \log 2.5 = -0.470, 0.916$, baseline 0.5. In
    $(0, 1)$ ($A > 0$) the second token is clipped at 0.2: it gets 0, the first
    $\exp((\log 0.625 + 0.2) / 2) = \sqrt{0.625\, e^{0.2}} = 0.8737$. In $(1, 1)$ ($A < 0$)
    nothing is below $-0.2$: both keep $2.5$.

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> gmpo(two, baseline=0.5, return_weights=True).round(4).tolist()
    [[0.625, 0.625], [0.8737, 0.0], [0.0, 0.8737], [2.5, 2.5]]
    """
    eps_low = check_finite_number("eps_low", eps_low, low=0.0, allow_inf=True)
    eps_high = check_finite_number("eps_high", eps_high, low=0.0, allow_inf=True)
    baseline_value = check_finite_number("baseline", baseline)
    check_toy(toy)
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]  # (M, T); 0 on the AR toy's padding
    advantage = (toy["R"] - baseline_value)[:, None]  # (M, 1)
    up = (advantage > 0) & (log_rho_t > eps_high)  # clipped from above: a constant
    down = (advantage < 0) & (log_rho_t < -eps_low)  # clipped from below: a constant
    m = np.where(up, eps_high, np.where(down, -eps_low, log_rho_t))
    lengths = _response_lengths(toy)
    ratio = exp_ratio(m.sum(axis=1) / lengths, "geometric", toy)  # (M,)
    weights = np.where(up | down, 0.0, ratio[:, None])
    return _finish(toy, weights, baseline, return_weights)


def luspo(toy, eps_low=0.2, eps_high=0.2, baseline=0.0, *, return_weights=False):
    r"""LUSPO (TRL): GSPO's sequence ratio, PPO-clipped, without GSPO's division by the length.

    $$
    w_t = \rho_{\mathrm{geo}} \big(1 - \mathbb{1}[A > 0,\ \rho_{\mathrm{geo}} > 1 +
    \varepsilon_h] - \mathbb{1}[A < 0,\ \rho_{\mathrm{geo}} < 1 - \varepsilon_l]\big).
    $$

    TRL ``loss_type="luspo"`` with ``importance_sampling_level="sequence"`` (which its trainer
    asks for): the GSPO term of a response, $-\min(\rho_{\mathrm{geo}} A,
    \mathrm{clip}(\rho_{\mathrm{geo}}) A)$, summed over its $T$ tokens, the mean over responses.
    Since $\nabla \rho_{\mathrm{geo}} = \rho_{\mathrm{geo}} \frac1T \sum_t s_t$, the sum over
    the $T$ tokens cancels the $\frac1T$: every token gets the weight $\rho_{\mathrm{geo}}$,
    exactly the weight of ``gspo``, with TRL's clip range (``epsilon`` 0.2, ``epsilon_high``
    defaulting to it: the defaults here) instead of GSPO's $3 \cdot 10^{-4}$ and $4 \cdot
    10^{-4}$. From *Length-Unbiased Sequence Policy Optimization* (arXiv 2602.05261). At TRL's
    default ``importance_sampling_level="token"`` the same loss is PPO's clip without the dual
    clip, ``ppo_clip_bypass(clip_ratio_c=inf)``. TRL's anchor is its own recomputation (see
    ``sapo``); the sampler is the anchor here. Biased.

    Examples
    --------
    One position, $\pi = (0.5, 0.5)$, $\mu = (0.45, 0.55)$, baseline 0.5: $\rho = (1.1111,
    0.9091)$ with $A = +0.5$ and $-0.5$. Both are inside TRL's range $[0.8, 1.2]$; GSPO's
    narrow one clips both:

    >>> toy = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.45, 0.55]]))
    >>> luspo(toy, baseline=0.5, return_weights=True).round(4).tolist()
    [1.1111, 0.9091]
    >>> gspo(toy, baseline=0.5, return_weights=True).round(4).tolist()
    [0.0, 0.0]
    """
    # LUSPO's weight is GSPO's: the length it multiplies by is the 1 / T of the ratio's gradient.
    return gspo(toy, eps_low, eps_high, baseline, return_weights=return_weights)


def vespo(toy, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, baseline=0.0, *,
          return_weights=False):
    r"""VESPO (TRL), bypass mode: a gamma-shaped function of the sequence ratio on every token.

    $$
    \varphi(\rho) = e^{\lambda} \rho^{k} e^{-\lambda \rho} = \rho^k e^{\lambda (1 - \rho)},
    \qquad w_t = \varphi(\rho), \qquad \hat g_t = \varphi(\rho)\, A\, s_t,
    $$

    with $(k, \lambda) = (k_+, \lambda_+)$ where $A \ge 0$ and $(k_-, \lambda_-)$ where
    $A < 0$, and $\rho = \pi(y) / \mu(y)$ the sequence ratio (the sum of the log-ratios, not
    their mean). $\varphi(1) = 1$, its maximum is at $\rho = k / \lambda$, and it vanishes as
    $\rho \to 0$ and as $\rho \to \infty$: ``seq_is``'s weight $\rho$ replaced by a bounded one,
    $\varphi \le (k / \lambda)^k e^{\lambda - k}$. The loss is $-\mathrm{sg}(\varphi) A \log
    \pi_\theta(y_t)$, so the weight is $\varphi$ itself. TRL ``loss_type="vespo"``
    (``GRPOTrainer.get_gamma_weights``; ``vespo_k_pos`` 2, ``vespo_lambda_pos`` 3,
    ``vespo_k_neg`` 3, ``vespo_lambda_neg`` 2: the defaults here), from the VESPO paper (arXiv
    2602.10693). TRL clamps $\log \rho$ to $[\log 10^{-8},
    20]$ (here it is not: the two differ where $\varphi < e^{\lambda} 10^{-8 k}$ or
    $\rho > e^{20}$, where both are below $10^{-15}$). In TRL the sampler enters through its
    token-level vLLM weight folded into $\rho$ (``token_truncate`` or ``token_mask``); with the
    trainer's recomputation as the anchor at one update a batch, $\log \rho$ is then the sum of
    the truncated (or masked) token log-ratios to the sampler, which is this $\rho$ where no
    token's ratio is truncated. Biased.

    Parameters
    ----------
    k_pos, k_neg : float
        $k \ge 0$, finite.
    lambda_pos, lambda_neg : float
        $\lambda > 0$, finite.

    Examples
    --------
    Two positions, baseline 0.5: $(0, 0)$ has $\rho = 0.390625$ and $A > 0$:
    $0.390625^2 e^{3 \cdot 0.609375} = 0.9494$; $(0, 1)$ has $\rho = 1.5625$:
    $1.5625^2 e^{-3 \cdot 0.5625} = 0.4516$; $(1, 1)$ has $\rho = 6.25$ and $A < 0$:
    $6.25^3 e^{-2 \cdot 5.25} = 0.0067$, where ``seq_is`` keeps 6.25:

    >>> two = toy_from_logits(np.log([[0.5, 0.5]] * 2), np.log([[0.8, 0.2]] * 2))
    >>> vespo(two, baseline=0.5, return_weights=True).round(4).tolist()
    [0.9494, 0.4516, 0.4516, 0.0067]
    """
    values = {}
    for name, value in (("k_pos", k_pos), ("k_neg", k_neg)):
        values[name] = check_finite_number(name, value, low=0.0)
    for name, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        values[name] = check_finite_number(name, value, positive=True)
    baseline_value = check_finite_number("baseline", baseline)
    check_toy(toy)
    log_rho = _log_seq_ratio(toy)  # (M,)
    positive = toy["R"] - baseline_value >= 0  # TRL's A >= 0 test
    k = np.where(positive, values["k_pos"], values["k_neg"])
    lam = np.where(positive, values["lambda_pos"], values["lambda_neg"])
    with np.errstate(over="ignore"):  # rho = inf: lambda (1 - rho) = -inf, phi = 0
        rho = np.exp(log_rho)
        # log phi = k log rho + lambda (1 - rho), in log space: rho^k alone may overflow
        weights = np.exp(k * log_rho + lam * (1.0 - rho))
    return _finish(toy, weights, baseline, return_weights)


COV_STATISTICS = ("population", "enumerated")
"""The batch whose statistics ``clip_cov`` and ``kl_cov`` read: the sampler's population, or the
batch that holds each response of the toy once."""


def _token_masses(toy, statistics):
    """(M, T) masses of the tokens of the batch whose means verl takes: each response's tokens
    weighted by mu(y) ("population") or 1 ("enumerated"), normalised to sum to 1."""
    if statistics not in COV_STATISTICS:
        raise ValueError(f"statistics must be one of {COV_STATISTICS}, got {statistics!r}")
    mask = np.asarray(toy["mask"], dtype=float) if "mask" in toy else np.ones(
        toy["logp_train"].shape)
    if statistics == "population":
        mask = toy["p_sampler"][:, None] * mask
    return mask / mask.sum()


def _log_prob_advantage_covariance(toy, baseline, masses):
    r"""verl's per-token $(A_t - \bar A)(\log \pi(y_t) - \overline{\log \pi})$, means under
    ``masses``; ``(M, T)`` with the advantage ``(M, 1)``."""
    advantage = (toy["R"] - baseline)[:, None]  # (M, 1)
    log_pi = np.where(masses > 0, toy["logp_train"], 0.0)
    mean_advantage = float((masses * advantage).sum())
    mean_log_pi = float((masses * log_pi).sum())
    return (advantage - mean_advantage) * (log_pi - mean_log_pi), advantage


def clip_cov(toy, eps=0.2, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0, baseline=0.0,
             *, statistics="population", return_weights=False):
    r"""Clip-Cov, bypass mode: PPO's clip, and a share of the tokens of large covariance
    between log-probability and advantage removed.

    With the covariance of token $t$ over the batch,
    $c_t = (A - \bar A)(\log \pi(y_t) - \overline{\log \pi})$ (the means over the batch's
    tokens), the tokens that PPO's clip leaves and whose $c_t$ lies in $(l, u)$ are
    *eligible*, and verl sets the loss of $k = \max(\lfloor r N \rfloor, 1)$ of them, drawn at
    random, to 0 ($N$ the batch's tokens, $r$ = ``clip_cov_ratio``). Each eligible token is
    dropped with probability $q = \min(k, n_e) / n_e$ ($n_e$ eligible tokens). This estimator
    is the average over that draw (the same expectation as verl's gradient on the batch, a
    smaller variance):

    $$
    w_t = \rho_t \big(1 - \mathbb{1}[A > 0,\ \rho_t > 1 + \varepsilon]
    - \mathbb{1}[A < 0,\ \rho_t < 1 - \varepsilon]\big)
    \big(1 - q\, \mathbb{1}[t \text{ eligible}]\big).
    $$

    **Which batch.** $w_t$ depends on the whole batch through $\bar A$,
    $\overline{\log \pi}$ and $q$, so it is no function of one response: it is not of the
    form $w_t A s_t$ of the module's other estimators unless the batch is fixed. Two batches
    are offered. ``statistics="population"`` (the default, and the registered estimator) is
    the limit of a large batch drawn from $\mu$: the means are expectations under $\mu$ over
    the tokens, and $q = \min(1, r / P_e)$ with $P_e$ the share of eligible tokens under
    $\mu$. ``statistics="enumerated"`` is verl's rule on the batch that holds each response of
    the toy once ($N = M T$, plain means, $k$ and $n_e$ counted): what
    [opd_literate.mismatch.correction.clip_cov_loss][] computes on the toy's enumerated batch.

    From *The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models* (2025;
    verl adapts the code of PRIME-RL/Entropy-Mechanism-of-RL). verl ``loss_mode: clip_cov``
    (``compute_policy_loss_clip_cov``; ``policy_loss.clip_cov_ratio`` 0.0002, ``clip_cov_lb``
    1.0, ``clip_cov_ub`` 5.0 and the actor's ``clip_ratio`` 0.2: the defaults here). No dual
    clip, and verl does not clamp the log-ratio. Biased.

    Parameters
    ----------
    eps : float
        $\varepsilon > 0$, PPO's clip range.
    clip_cov_ratio : float
        $r > 0$, the share of the batch's tokens to drop.
    clip_cov_lb, clip_cov_ub : float
        $l < u$, the band of $c_t$ (strict on both sides, as verl's).
    statistics : str
        ``"population"`` or ``"enumerated"`` (see above).

    Examples
    --------
    One position, $\pi = (0.8, 0.2)$, $\mu = (0.5, 0.5)$, baseline 0.5: $\rho = (1.6, 0.4)$,
    $A = \pm 0.5$, $\bar A = 0$ and $c = 0.5 \log 2 = 0.3466$ for both tokens. With
    $\varepsilon = 0.7$ PPO clips neither, and $l = 0.3$ makes both eligible. In the
    population every token is eligible ($P_e = 1$): $q = r = 0.25$; in the enumerated batch
    of $N = 2$ tokens, $k = 1$ of the $n_e = 2$: $q = 0.5$.

    >>> toy = toy_from_logits(np.log([[0.8, 0.2]]), np.log([[0.5, 0.5]]))
    >>> p = dict(eps=0.7, clip_cov_ratio=0.25, clip_cov_lb=0.3, baseline=0.5, return_weights=True)
    >>> clip_cov(toy, **p).round(6).tolist()
    [[1.2], [0.3]]
    >>> clip_cov(toy, **p, statistics="enumerated").round(6).tolist()
    [[0.8], [0.2]]
    """
    eps = check_finite_number("eps", eps, positive=True)
    ratio_share = check_finite_number("clip_cov_ratio", clip_cov_ratio, positive=True)
    low, high = (check_finite_number(n, v, allow_inf=True)
                 for n, v in (("clip_cov_lb", clip_cov_lb), ("clip_cov_ub", clip_cov_ub)))
    if not low < high:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {low!r} >= {high!r}")
    baseline_value = check_finite_number("baseline", baseline)
    check_toy(toy)
    masses = _token_masses(toy, statistics)
    cov, advantage = _log_prob_advantage_covariance(toy, baseline_value, masses)
    ratio = token_ratios(toy)
    clipped = ((advantage > 0) & (ratio > 1 + eps)) | ((advantage < 0) & (ratio < 1 - eps))
    token = np.asarray(toy["mask"]) > 0 if "mask" in toy else np.ones(ratio.shape, bool)
    eligible = token & ~clipped & (cov > low) & (cov < high)
    if statistics == "population":
        share = float(masses[eligible].sum())
        q = min(1.0, ratio_share / share) if share > 0 else 0.0
    else:
        n_eligible = int(eligible.sum())
        k = max(int(ratio_share * int(token.sum())), 1)  # verl's int(): rounds down
        q = min(k, n_eligible) / n_eligible if n_eligible else 0.0
    weights = np.where(clipped, 0.0, ratio) * np.where(eligible, 1.0 - q, 1.0)
    return _finish(toy, weights, baseline, return_weights)


def kl_cov(toy, kl_cov_ratio=2e-4, ppo_kl_coef=0.1, baseline=0.0, *, statistics="population",
           return_weights=False):
    r"""KL-Cov, bypass mode: the token ratio, and on the tokens of largest covariance an
    absolute-log-ratio penalty. Its estimate is **not** of the form $w_t A s_t$.

    The loss is $-A \rho_t$ on every token (no clip) and $-A \rho_t + \beta |\log \rho_t|$ on
    the share $r$ of the batch's tokens whose covariance
    $c_t = (A - \bar A)(\log \pi(y_t) - \overline{\log \pi})$ is largest (``clip_cov``'s $c_t$;
    verl takes the $\max(\lfloor r N \rfloor, 1)$ largest of the $N$ tokens). Since
    $\nabla |\log \rho_t| = \mathrm{sign}(\log \rho_t)\, s_t$,

    $$
    \hat g_t = \rho_t\, A\, s_t - \beta\, \mathbb{1}[t \text{ selected}]\,
    \mathrm{sign}(\log \rho_t)\, s_t :
    $$

    ``token_is`` less a pull towards the anchor that does not scale with $A$ (it acts where
    $A = 0$), so no weight $w_t$ expresses it and ``kl_cov`` is not in ``REGISTRY`` (whose
    comparison reads weights): like DRO's, it estimates the gradient of a regularised
    objective, not $\nabla J$. It returns the estimate, whose exact moments
    [opd_literate.mismatch.toy.estimator_moments][] computes; ``return_weights=True`` is a
    ``ValueError``. At $\theta_{\mathrm{old}} = \theta$ in verl's decoupled mode
    $\log \rho_t = 0$ and the penalty's gradient is 0 (torch's $\mathrm{sign}(0) = 0$); in
    bypass mode it is not.

    **Which batch** (see ``clip_cov``). ``statistics="population"``: the means under $\mu$,
    and the selected tokens are the top share $r$ of the token mass under $\mu$ by $c_t$; the
    tokens whose $c_t$ equals the boundary value share the remaining mass, each selected by
    that fraction. ``statistics="enumerated"``: verl's rule on the batch of the toy's $M$
    responses, the $\max(\lfloor r M T \rfloor, 1)$ largest $c_t$; a tie at the boundary is a
    ``ValueError`` (verl's ``torch.topk`` breaks it arbitrarily).

    verl ``loss_mode: kl_cov`` (``compute_policy_loss_kl_cov``): ``policy_loss.kl_cov_ratio``
    0.0002 and ``ppo_kl_coef`` $\beta$ 0.1 in the composed config (the code falls back to 1.0
    only for a config without one): the defaults here. From the same paper as
    ``clip_cov``.

    Examples
    --------
    One position, $\pi = (0.8, 0.2)$, $\mu = (0.4, 0.6)$, baseline 0: $\rho = (2, 1/3)$,
    $A = (1, 0)$, $\bar A = 0.4$, $c = (0.499, 0.222)$. The top half of the token mass under
    $\mu$ is token 0 (mass 0.4) and $1/6$ of token 1 (0.1 of its 0.6). With $\beta = 1$,
    token 0 gives $(2 \cdot 1 - 1)\, s = (0.2, -0.2)$; token 1 ($A = 0$, $\log \rho < 0$) only
    the penalty, $+\frac16 s = \frac16 (-0.8, 0.8)$:

    >>> toy = toy_from_logits(np.log([[0.8, 0.2]]), np.log([[0.4, 0.6]]))
    >>> kl_cov(toy, kl_cov_ratio=0.5, ppo_kl_coef=1.0).round(4).tolist()
    [[[0.2, -0.2]], [[-0.1333, 0.1333]]]
    """
    if return_weights:
        raise ValueError("kl_cov has no weights: its penalty's gradient -beta sign(log rho_t) "
                         "s_t does not scale with the advantage (call it without "
                         "return_weights for the estimate)")
    share = check_finite_number("kl_cov_ratio", kl_cov_ratio, positive=True)
    beta = check_finite_number("ppo_kl_coef", ppo_kl_coef, low=0.0)
    baseline_value = check_finite_number("baseline", baseline)
    check_toy(toy)
    masses = _token_masses(toy, statistics)
    cov, _ = _log_prob_advantage_covariance(toy, baseline_value, masses)
    token = masses > 0 if statistics == "enumerated" else (
        np.asarray(toy["mask"]) > 0 if "mask" in toy else np.ones(cov.shape, bool))
    selected = _top_share(cov, token, masses, share, statistics)  # (M, T) in [0, 1]
    log_rho_t = np.where(token, toy["logp_train"] - toy["logp_sampler"], 0.0)
    penalty = beta * selected * np.sign(log_rho_t)  # (M, T)
    extra = (1,) * (np.ndim(toy["score"]) - 2)
    return (weighted_score(toy, token_ratios(toy), baseline)
            - penalty.reshape(penalty.shape + extra) * toy["score"])


def _top_share(cov, token, masses, share, statistics):
    """(M, T) selection of the tokens of largest ``cov``: verl's top k of the enumerated batch
    (0 or 1), or the top ``share`` of the population's token mass (a fraction at the boundary)."""
    values = cov[token]
    if statistics == "enumerated":
        k = max(1, int(values.size * share))  # verl's k = max(1, int(N * kl_cov_ratio))
        order = np.sort(values)[::-1]
        if k < values.size and order[k - 1] == order[k]:
            raise ValueError(f"the {k}-th and {k + 1}-th largest covariances are equal "
                             f"({order[k]!r}): verl's top-k would pick either")
        return (token & (cov >= order[k - 1])).astype(float)
    selected = np.zeros(cov.shape)
    remaining = min(share, 1.0)
    for value in np.unique(values)[::-1]:  # the largest covariance first
        if remaining <= 0:
            break
        cells = token & (cov == value)
        mass = float(masses[cells].sum())
        take = min(1.0, remaining / mass) if mass > 0 else 0.0
        selected[cells] = take
        remaining -= take * mass
    return selected


# ---------------------------------------------------------------------------------------------
# The registry and the exact comparison
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EstimatorSpec:
    r"""One estimator: its function, default thresholds, source and reference weight.

    ``reference`` names the uncorrected weight a token would get without truncation or
    masking ("one", "token" = $\rho_t$, "sequence" = $\rho$, "geometric" = $\rho_{geo}$);
    a token whose weight differs from it counts as truncated or masked.
    """

    name: str
    fn: object
    defaults: dict = field(default_factory=dict)
    source: str = ""
    unbiased: bool = False
    reference: str = "one"


REGISTRY = {
    spec.name: spec
    for spec in [
        EstimatorSpec(
            name="naive", fn=naive, defaults={},
            source="no correction",
            unbiased=False, reference="one",
        ),
        EstimatorSpec(
            name="token_is", fn=token_is, defaults={},
            source="per-token ratio (PPO ratio, bypass)",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="seq_is", fn=seq_is, defaults={},
            source="sequence importance sampling",
            unbiased=True, reference="sequence",
        ),
        EstimatorSpec(
            name="token_tis", fn=token_tis, defaults={"cap": 2.0},
            source="Yao et al. 2025 (TIS); verl rollout_is=token, threshold 2.0",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="seq_tis", fn=seq_tis, defaults={"cap": 2.0},
            source="verl rollout_is=sequence, threshold 2.0",
            unbiased=False, reference="sequence",
        ),
        EstimatorSpec(
            name="token_mis", fn=token_mis, defaults={"low": 0.0, "high": 2.0},
            source="Liu, Li et al. 2025 (MIS); verl rollout_rs=token_k1 (needs low > 0)",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="seq_mis", fn=seq_mis, defaults={"low": 0.0, "high": 2.0},
            source="Liu, Li et al. 2025 (MIS); verl rollout_rs=seq_sum_k1 (needs low > 0)",
            unbiased=False, reference="sequence",
        ),
        EstimatorSpec(
            name="geo_rs", fn=geo_rs, defaults={"low": 1 / 1.001, "high": 1 / 0.999},
            source=("verl rollout_rs=seq_mean_k1 0.999_1.001 (decoupled_geo_rs); was "
                "rollout_rs=geometric"),
            unbiased=False, reference="one",
        ),
        EstimatorSpec(
            name="icepop", fn=icepop, defaults={"low": 0.5, "high": 5.0},
            source="IcePop (Ring-1T, 2025)",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="token_clamp", fn=token_clamp, defaults={"low": 0.5, "high": 2.0},
            source="two-sided TIS (slime --tis-clip-low/--tis-clip; 624b824)",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="cispo", fn=cispo, defaults={"eps_low": 1.0, "eps_high": 4.0},
            source="MiniMax-M1 2025 (CISPO)",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="ppo_clip_bypass", fn=ppo_clip_bypass, defaults={"eps": 0.2, "clip_ratio_c": 3.0},
            source="verl bypass_mode, loss_type=ppo_clip: PPO clip 0.2, dual clip 3.0",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="token_veto", fn=token_veto, defaults={"threshold": 1e-4},
            source="verl rollout_token_veto_threshold (removed Jan 2026)",
            unbiased=False, reference="one",
        ),
        EstimatorSpec(
            name="k3_seq_rs", fn=k3_seq_rs, defaults={"threshold": 0.01},
            source="verl rollout_rs=seq_mean_k3 0.01 (decoupled_k3_rs)",
            unbiased=False, reference="one",
        ),
        EstimatorSpec(
            name="geo_rs_token_tis", fn=geo_rs_token_tis,
            defaults={"low": 1 / 1.001, "high": 1 / 0.999, "cap": 2.0},
            source="verl preset decoupled_geo_rs_token_tis",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="gspo", fn=gspo, defaults={"eps_low": 3e-4, "eps_high": 4e-4},
            source="Zheng et al. 2025 (GSPO), bypass; TRL importance_sampling_level=sequence",
            unbiased=False, reference="geometric",
        ),
        EstimatorSpec(
            name="dppo_tv", fn=dppo_tv,
            defaults={"delta_low": 0.2, "delta_high": 0.2, "clip_ratio_c": 3.0},
            source="Qi et al. 2026 (DPPO-Binary-TV); verl loss_mode=dppo_tv, bypass",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="dppo_kl", fn=dppo_kl,
            defaults={"delta_low": 0.2, "delta_high": 0.2, "clip_ratio_c": 3.0},
            source="Qi et al. 2026 (DPPO-Binary-KL); verl loss_mode=dppo_kl, bypass",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="trl_token_truncate", fn=trl_token_truncate,
            defaults={"clip_min": 0.0, "clip_max": 3.0},
            source="TRL vllm_importance_sampling_mode=token_truncate, clip_max 3.0",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="trl_token_mask", fn=trl_token_mask,
            defaults={"clip_min": 0.0, "clip_max": 3.0},
            source="TRL vllm_importance_sampling_mode=token_mask, clip_max 3.0",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="trl_sequence_truncate", fn=trl_sequence_truncate,
            defaults={"clip_min": 0.0, "clip_max": 3.0},
            source="TRL vllm_importance_sampling_mode=sequence_truncate, clip_max 3.0",
            unbiased=False, reference="sequence",
        ),
        EstimatorSpec(
            name="trl_sequence_mask", fn=trl_sequence_mask,
            defaults={"clip_min": 0.0, "clip_max": 3.0},
            source="TRL vllm_importance_sampling_mode=sequence_mask (its default), clip_max 3.0",
            unbiased=False, reference="sequence",
        ),
        EstimatorSpec(
            name="off_policy_mask", fn=off_policy_mask, defaults={"threshold": 0.5},
            source="DeepSeek-V3.2 2025; TRL off_policy_mask_threshold 0.5 (off by default)",
            unbiased=False, reference="one",
        ),
        EstimatorSpec(
            name="seq_mask_tis", fn=seq_mask_tis, defaults={"low": 0.999, "high": 1.002},
            source="OpenRLHF / NeMo-RL seq-mask-tis, NeMo-RL's band 0.999_1.002",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="kpop", fn=kpop, defaults={"threshold": 0.1, "eps": 1e-6},
            source="KPop 2026; prime-rl loss kpop 0.1 (b9ba060), AReaL binary_kl",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="sapo", fn=sapo, defaults={"tau_pos": 1.0, "tau_neg": 1.05},
            source="SAPO 2025; verl loss_mode=sapo (bypass) and TRL loss_type=sapo, tau 1.0/1.05",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="gmpo", fn=gmpo, defaults={"eps_low": 0.2, "eps_high": 0.2},
            source="GMPO 2025; verl loss_mode=geo_mean, bypass, log-space clip 0.2",
            unbiased=False, reference="geometric",
        ),
        EstimatorSpec(
            name="clip_cov", fn=clip_cov,
            defaults={"eps": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
            source="Clip-Cov 2025; verl loss_mode=clip_cov, bypass, population statistics",
            unbiased=False, reference="token",
        ),
        EstimatorSpec(
            name="luspo", fn=luspo, defaults={"eps_low": 0.2, "eps_high": 0.2},
            source="LUSPO 2026; TRL loss_type=luspo, importance_sampling_level=sequence, 0.2",
            unbiased=False, reference="geometric",
        ),
        EstimatorSpec(
            name="vespo", fn=vespo,
            defaults={"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
            source="VESPO 2026; TRL loss_type=vespo, k 2/3, lambda 3/2",
            unbiased=False, reference="sequence",
        ),
    ]
}
"""Every estimator of this module by name, with its default thresholds and source.

Each "verl" source is the verl release ``VERL_VERSION`` (0.9.1): its files
``verl/trainer/ppo/rollout_corr_helper.py``, ``verl/trainer/ppo/core_algos.py`` and
``verl/trainer/config/algorithm.py``. Each "TRL" source is TRL 1.16.0, ``GRPOConfig`` and
``GRPOTrainer`` (``trl/trainer/grpo_config.py``, ``trl/trainer/grpo_trainer.py``); the
OpenRLHF, NeMo-RL, prime-rl and AReaL sources are the commits their estimators name."""


def estimator_weights(toy, name, baseline=0.0, **params):
    """The ``(M, T)`` weights of a registered estimator (its defaults, updated by ``params``).

    ``baseline`` matters for the estimators whose weight depends on the sign of the advantage
    (``ppo_clip_bypass``, ``gspo``, ``dppo_tv``, ``dppo_kl``).

    Examples
    --------
    >>> one = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))  # rho_t = 0.625, 2.5
    >>> estimator_weights(one, "ppo_clip_bypass", baseline=0.5, clip_ratio_c=2.0).tolist()
    [[0.625], [0.0]]
    """
    spec = _spec(name)
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        raise ValueError(f"unknown parameters {unknown} for estimator {name!r}; it takes "
                         f"{sorted(spec.defaults)}")
    weights = spec.fn(toy, **{**spec.defaults, **params}, baseline=baseline,
                      return_weights=True)
    weights = np.asarray(weights, dtype=float)
    if weights.ndim == 1:
        weights = np.broadcast_to(weights[:, None], toy["logp_train"].shape)
    return weights


def _spec(name):
    if name not in REGISTRY:
        raise ValueError(f"unknown estimator {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def _reference_weights(toy, kind):
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    if kind == "one":
        return np.ones_like(log_rho_t)
    if kind == "token":
        return np.exp(log_rho_t)
    total = log_rho_t.sum(axis=1, keepdims=True)
    lengths = _response_lengths(toy)
    if np.ndim(lengths):
        lengths = lengths[:, None]
    per_sequence = np.exp(total) if kind == "sequence" else np.exp(total / lengths)
    return np.broadcast_to(per_sequence, log_rho_t.shape)


def comparison_table(toy, names=None, N=64, baseline=0.0, params=None):
    r"""The exact comparison of estimators on one toy, one row per estimator.

    Each row holds: ``name``, ``bias``, ``var`` (of one sample), ``rel_bias``,
    ``rel_rmse`` for a batch of ``N`` sequences, ``token_frac`` and ``seq_frac`` (the
    probability under $\mu$ that a token, or a sequence, has a weight other than its
    uncorrected ratio: truncated, clipped, masked or rejected), ``unbiased`` (the registry's
    flag: unbiased at every mismatch, whatever the parameters; only ``seq_is``) and ``source``.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.toy.make_toy][].
    names : list of str, optional
        Registered estimators; all by default.
    N : int
        Batch size for ``rel_rmse``.
    baseline : float
        Passed to every estimator.
    params : dict, optional
        ``{name: {param: value}}`` overriding defaults. An estimator or a parameter that does
        not exist is a ``ValueError`` that names it.

    Returns
    -------
    list of dict
        Each row's ``bias``, ``var`` and ``rel_rmse`` are those of the estimator called
        directly, ``fn(toy, **params, baseline=baseline)``.

    Examples
    --------
    >>> rows = comparison_table(make_toy(), names=["naive", "seq_is", "token_tis"])
    >>> [(r["name"], r["rel_bias"] < 1e-12, r["token_frac"] > 0) for r in rows]
    [('naive', False, False), ('seq_is', True, False), ('token_tis', False, True)]
    """
    check_toy(toy)
    params = {} if params is None else dict(params)
    names = list(REGISTRY) if names is None else list(names)
    for name in [*names, *params]:
        _spec(name)  # an unknown name is an error, not silently ignored
    stray = sorted(set(params) - set(names))
    if stray:
        raise ValueError(f"params names estimators that are not compared: {stray}; compared: "
                         f"{names}")
    mu = toy["p_sampler"]
    rows = []
    for name in names:
        spec = _spec(name)
        # The weights depend on the baseline for ppo_clip_bypass, gspo and DPPO (the sign of A).
        weights = estimator_weights(toy, name, baseline=baseline, **params.get(name, {}))
        estimate = weighted_score(toy, weights, baseline)
        moments = estimator_moments(toy, estimate)
        modified = ~np.isclose(weights, _reference_weights(toy, spec.reference),
                               rtol=1e-12, atol=0.0)
        if "mask" in toy:  # count the response's own tokens only, not the padding
            modified &= np.asarray(toy["mask"]) > 0
            token_fraction = modified.sum(axis=1) / _response_lengths(toy)
        else:
            token_fraction = modified.mean(axis=1)
        rows.append(dict(
            name=name,
            bias=moments["bias"],
            var=moments["var"],
            rel_bias=moments["rel_bias"],
            rel_rmse=moments["rel_rmse"](N),
            token_frac=float(mu @ token_fraction),
            seq_frac=float(mu @ modified.any(axis=1)),
            unbiased=spec.unbiased,
            source=spec.source,
        ))
    return rows


def mismatch_sweep(mismatches, names=None, N=64, T=6, V=4, seed=0, baseline=0.0):
    """``comparison_table`` at each mismatch value: ``{mismatch: rows}``.

    Examples
    --------
    >>> sweep = mismatch_sweep([0.0, 0.25, 0.5], names=["naive"])
    >>> bias = [rows[0]["rel_bias"] for rows in sweep.values()]
    >>> bias[0] < 1e-12 < bias[1] < bias[2]  # no bias without mismatch, then growing
    True
    """
    return {float(m): comparison_table(make_toy(T=T, V=V, mismatch=m, seed=seed), names=names,
                                       N=N, baseline=baseline)
            for m in mismatches}


def length_sweep(lengths, names, mismatch=0.3, V=3, seeds=range(5), autoregressive=True,
                 eos=True):
    r"""Median relative bias of each estimator over ``seeds``, at each response length $T$.

    For each seed one table of ``max(lengths)`` positions is drawn (``make_ar_toy`` or
    ``make_toy`` with that seed), and the toy of length $T$ uses its first $T$ positions
    (built with [opd_literate.mismatch.toy.ar_toy_from_logits][] or
    [opd_literate.mismatch.toy.toy_from_logits][]), so the toys of one seed are nested. The median
    over the seeds keeps a seed with a tiny $\lVert \nabla J \rVert$ from dominating.

    Returns
    -------
    dict
        ``{T: {name: median relative bias}}``.

    Examples
    --------
    With one position the token ratio is the sequence ratio, so both are exact:

    >>> sweep = length_sweep([1, 2], ["token_is", "seq_is"], seeds=[0])
    >>> sweep[1]["token_is"] < 1e-12, sweep[2]["token_is"] > 0.01, sweep[2]["seq_is"] < 1e-12
    (True, True, True)
    """
    lengths = [int(T) for T in lengths]
    T_max = max(lengths)
    biases = {T: {name: [] for name in names} for T in lengths}
    for seed in seeds:
        if autoregressive:
            table = make_ar_toy(T=T_max, V=V, mismatch=0.0, seed=seed, eos=eos)
        else:
            table = make_toy(T=T_max, V=V, mismatch=0.0, seed=seed)
        sampler_logits = table["theta"] + mismatch * table["b"]
        for T in lengths:
            if autoregressive:
                toy = ar_toy_from_logits(table["theta"][:T], sampler_logits[:T], eos=eos)
            else:
                toy = toy_from_logits(table["theta"][:T], sampler_logits[:T])
            for row in comparison_table(toy, names=names):
                biases[T][row["name"]].append(row["rel_bias"])
    return {T: {name: float(np.median(values)) for name, values in by_name.items()}
            for T, by_name in biases.items()}


def _significant(x: float, digits: int = 4) -> str:
    """``x`` to ``digits`` significant digits, trailing zeros kept (0.2830, 0.0007223, 2646),
    so that a column reads at one precision; 1e5 and above in scientific notation."""
    if x != 0 and abs(x) >= 10.0 ** 5:
        return f"{x:.{digits - 1}e}"
    return f"{x:#.{digits}g}".rstrip(".")


def format_table(rows, N=64):
    """Render ``comparison_table`` rows as a Markdown table (used by the docs)."""
    lines = [f"| estimator | rel. bias | variance | rel. RMSE (N={N}) | tokens modified "
             "| sequences modified | unbiased |",
             "| --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in rows:
        lines.append(
            f"| `{r['name']}` | {r['rel_bias']:.4f} | {_significant(r['var'])} | "
            f"{r['rel_rmse']:.4f} | "
            f"{100 * r['token_frac']:.1f}% | {100 * r['seq_frac']:.1f}% | "
            f"{'yes' if r['unbiased'] else 'no'} |"
        )
    return "\n".join(lines)


def _check_batch_size(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer batch size >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a batch size >= 1, got {value}")
    return int(value)


def least_error(rows, batches, N=64):
    r"""For each batch size $n$ of ``batches``, the row of least relative RMSE, from rows that
    give it at one batch size ``N``.

    A row of [opd_literate.mismatch.estimators.comparison_table][] holds the relative bias $b$
    and the relative RMSE $r_N$ at $N$; the relative variance of one answer is
    $v = N (r_N^2 - b^2)$, so at any $n$ the error is exactly
    $r_n = \sqrt{b^2 + v / n}$, and only the rows' numbers are needed (as for a committed
    record of tinylm's moments).

    Parameters
    ----------
    rows : sequence of dict
        Each with ``name``, ``rel_bias`` and ``rel_rmse`` (at ``N``), finite, $r_N \ge b \ge 0$
        up to rounding.
    batches : sequence of int
        Batch sizes $n \ge 1$.
    N : int
        The batch size of the rows' ``rel_rmse``.

    Returns
    -------
    list of tuple
        ``(n, name, rel_rmse)`` for each $n$, the first row of the least error on a tie.

    Examples
    --------
    An unbiased row of relative variance 64 against one of bias 0.5 and variance 0: the biased
    one wins while the variance term $64 / n$ is above $0.25$; at $n = 256$ they tie and the
    first row is taken:

    >>> rows = [dict(name="unbiased", rel_bias=0.0, rel_rmse=1.0),
    ...         dict(name="biased", rel_bias=0.5, rel_rmse=0.5)]
    >>> [(n, name, round(r, 4)) for n, name, r in least_error(rows, [64, 256, 1024])]
    [(64, 'biased', 0.5), (256, 'unbiased', 0.5), (1024, 'unbiased', 0.25)]
    """
    N = _check_batch_size("N", N)
    batches = [_check_batch_size("batches", n) for n in check_sequence("batches", batches)]
    rows = list(check_sequence("rows", rows))
    if not rows:
        raise ValueError("rows must hold at least one row")
    bias, variance = [], []
    for row in rows:
        b = check_finite_number(f"rel_bias of {row.get('name')!r}", row["rel_bias"], low=0.0)
        r = check_finite_number(f"rel_rmse of {row.get('name')!r}", row["rel_rmse"], low=0.0)
        bias.append(b)
        variance.append(max(N * (r * r - b * b), 0.0))  # rounding may leave r a hair below b
    out = []
    for n in batches:
        errors = [float(np.sqrt(b * b + v / n)) for b, v in zip(bias, variance)]
        best = int(np.argmin(errors))
        out.append((n, rows[best]["name"], errors[best]))
    return out
