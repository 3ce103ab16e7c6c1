r"""Rollout-correction estimators for a sampler that is not the trainer, with exact moments.

The rollouts come from the sampler $\mu$ (the inference engine), the gradient is wanted for the
trainer $\pi = \pi_\theta$. Every estimator here returns, for each of the $M$ sequences of the
toy of [opd_literate.toy.make_toy][], the ``(T, V)`` gradient estimate it would produce if the
sampler had drawn that sequence: an ``(M, T, V)`` array that
[opd_literate.toy.estimator_moments][] turns into an exact mean, bias and variance.

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
so $w_t = \rho$ is unbiased, whatever the mismatch. Its variance is the price: $\rho$ is a
product of $T$ ratios and its second moment $\mathbb{E}_\mu[\rho^2] = \prod_t (1 +
\chi^2(\pi_t \,\|\, \mu_t))$ grows exponentially with the length. Everything else in this module
trades some bias for less variance: per-token ratios (the right ratio for the last token but not
for the prefix that led to it), truncation (cap the weight), masking and rejection (drop the
sample), and geometric means (length-normalized ratios).

**Bypass mode.** Several estimators come from PPO-style losses. They are evaluated here at the
point where the gradient is taken, $\theta_{\mathrm{old}} = \theta$, with the rollout policy as
the PPO anchor ("bypass mode" in verl's ``rollout_correction``), so the PPO ratio *is* $\rho_t$.
The gradient of a clipped term is then $\rho_t A s_t$ where the clip is inactive and 0 where it
is active.

Each public estimator is ``name(toy, <thresholds>, baseline=0.0, *, return_weights=False)``;
``return_weights=True`` returns the ``(M, T)`` weights $w_t$ instead of the estimate, which is
how the comparison counts truncated and masked tokens. [opd_literate.estimators.REGISTRY][]
lists them all with their defaults and sources, and
[opd_literate.estimators.comparison_table][] and [opd_literate.estimators.mismatch_sweep][]
build the exact comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._checks import check_finite_number
from .toy import check_toy, estimator_moments, make_toy

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
    "EstimatorSpec",
    "REGISTRY",
    "estimator_weights",
    "comparison_table",
    "mismatch_sweep",
    "format_table",
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
    return _exp_ratio(toy["logp_train"] - toy["logp_sampler"], "per-token", toy)


def _log_seq_ratio(toy):
    """log rho = sum_t log rho_t, shape (M,): summed in log space, never as a product."""
    return (toy["logp_train"] - toy["logp_sampler"]).sum(axis=1)


# exp(709.78) is the largest float64: a larger log-ratio would become inf, and inf * 0 is NaN.
_MAX_LOG_RATIO = float(np.log(np.finfo(float).max))


def _exp_ratio(log_ratio, level, toy):
    largest = float(np.max(log_ratio)) if np.size(log_ratio) else 0.0
    if largest > _MAX_LOG_RATIO:
        raise ValueError(
            f"the {level} importance ratios overflow float64 (log ratio up to {largest:.0f} > "
            f"{_MAX_LOG_RATIO:.1f}) at mismatch={toy.get('mismatch')!r}: the sampler gives "
            "some sequences a probability that underflows; use a smaller mismatch"
        )
    return np.exp(log_ratio)


def geometric_ratio(toy):
    r"""Length-normalized sequence ratios $\rho_{\mathrm{geo}} = \rho^{1/T}$, shape ``(M,)``.

    Examples
    --------
    >>> toy = make_toy(T=3, V=2)
    >>> rho = np.exp((toy["logp_train"] - toy["logp_sampler"]).sum(axis=1))
    >>> bool(np.allclose(geometric_ratio(toy) ** 3, rho))
    True
    """
    check_toy(toy, keys=("logp_train", "logp_sampler"))
    return np.exp(_log_seq_ratio(toy) / toy["logp_train"].shape[1])


def weighted_score(toy, weights, baseline=0.0):
    r"""The estimate $\hat g_{m,t} = w_{m,t}\, (R_m - b)\, s_{m,t}$, shape ``(M, T, V)``.

    Parameters
    ----------
    toy : dict
        From [opd_literate.toy.make_toy][].
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
    # w_t * A * s_t: (M, T, 1) * (M, 1, 1) * (M, T, V)
    return (weights * advantage[:, None])[:, :, None] * toy["score"]


def _check_band(low, high, *, low_name="low", high_name="high"):
    low = check_finite_number(low_name, low, low=0.0, allow_inf=True)  # ratios are >= 0
    high = check_finite_number(high_name, high, allow_inf=True)
    if low > high:
        raise ValueError(f"{low_name} must be <= {high_name}, got {low_name}={low!r} > "
                         f"{high_name}={high!r}")
    return low, high


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

    What a trainer computes when it ignores the mismatch. Biased whenever $\mu \ne \pi$: its
    mean is $\mathbb{E}_\mu[A \sum_t s_t]$, the gradient direction for the wrong distribution.
    Unbiased at ``mismatch = 0``.

    Examples
    --------
    >>> toy = make_toy(mismatch=0.0)
    >>> estimator_moments(toy, naive(toy))["rel_bias"] < 1e-12
    True
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
    with the rollout policy as the anchor (verl ``rollout_is: token``, no threshold). It corrects
    the distribution of the token $y_t$ but not of the prefix before it, nor of the reward,
    which depends on the whole sequence: **biased**, with a bias that is second order in the
    mismatch per token.

    Examples
    --------
    >>> toy = make_toy()
    >>> m = estimator_moments(toy, token_is(toy))
    >>> 0 < m["rel_bias"] < estimator_moments(toy, naive(toy))["rel_bias"]
    True
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

    The textbook correction (verl ``rollout_is: sequence`` without a threshold). The ratio is
    summed in log space, $\rho = \exp \sum_t (\log \pi(y_t) - \log \mu(y_t))$, so it does not
    underflow for long sequences. Its variance grows like $\prod_t (1 + \chi^2(\pi_t \| \mu_t))$.

    Examples
    --------
    >>> toy = make_toy(mismatch=1.0)
    >>> estimator_moments(toy, seq_is(toy))["rel_bias"] < 1e-12
    True
    """
    ### BEGIN SOLUTION Task 3: the sequence ratio pi(y) / mu(y), summed in log space
    weights = np.exp(_log_seq_ratio(toy))
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
    [token_is][opd_literate.estimators.token_is] and the truncation.

    Parameters
    ----------
    cap : float
        $C > 0$; ``inf`` gives ``token_is``.

    Examples
    --------
    >>> toy = make_toy()
    >>> bool(np.array_equal(token_tis(toy, cap=np.inf), token_is(toy)))
    True
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

    verl ``rollout_is: sequence`` with ``rollout_is_threshold`` (default 2.0); the
    variance is bounded by $C^2$ times that of ``naive``. Biased by exactly
    $\mathbb{E}_\mu[(\rho - C)_+ A \sum_t s_t]$, the mass above the cap.

    Parameters
    ----------
    cap : float
        $C > 0$; ``inf`` gives ``seq_is``.

    Examples
    --------
    >>> toy = make_toy()
    >>> bool(np.array_equal(seq_tis(toy, cap=np.inf), seq_is(toy)))
    True
    """
    cap = check_finite_number("cap", cap, positive=True, allow_inf=True)
    ### BEGIN SOLUTION Task 5: the sequence ratio, truncated from above at cap
    weights = np.minimum(np.exp(_log_seq_ratio(toy)), cap)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def token_mis(toy, low=0.0, high=2.0, baseline=0.0, *, return_weights=False):
    r"""Masked importance sampling per token (MIS): $w_t = \rho_t\, \mathbb{1}[l \le \rho_t \le h]$.

    $$
    \hat g_t = \rho_t\, \mathbb{1}[l \le \rho_t \le h]\, A\, s_t .
    $$

    From J. Liu, Y. Li et al., *When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch* (2025); verl ``rollout_rs: token`` with ``rollout_rs_threshold``
    and ``rollout_rs_threshold_lower``, on top of token IS weights. Where truncation keeps an
    outlier token at weight $C$, masking drops it: an outlier ratio is taken as a sign that the
    sample is broken, not as information. $l = 0$ is upper-only; $l > 0$ the two-sided band.

    Examples
    --------
    A band containing every ratio masks nothing:

    >>> toy = make_toy()
    >>> bool(np.array_equal(token_mis(toy, low=0.0, high=np.inf), token_is(toy)))
    True
    """
    low, high = _check_band(low, high)
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

    Liu, Li et al. (2025), the sequence-level MIS; verl ``rollout_is: sequence`` with
    ``rollout_rs: sequence`` (``rollout_rs_threshold``; the lower bound defaults to its
    reciprocal in verl, to 0 here). Unbiased on the kept sequences, biased by the dropped
    mass $\mathbb{E}_\mu[\rho\,\mathbb{1}[\rho \notin [l, h]]\, A \sum_t s_t]$.

    Examples
    --------
    >>> toy = make_toy()
    >>> bool(np.array_equal(seq_mis(toy, low=0.0, high=np.inf), seq_is(toy)))
    True
    """
    low, high = _check_band(low, high)
    ### BEGIN SOLUTION Task 7: the sequence ratio where low <= rho <= high, else 0
    rho = np.exp(_log_seq_ratio(toy))
    weights = np.where((rho >= low) & (rho <= high), rho, 0.0)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def geo_rs(toy, low=0.999, high=1.001, baseline=0.0, *, return_weights=False):
    r"""Geometric-mean rejection sampling: $w_t = \mathbb{1}[l \le \rho_{\mathrm{geo}} \le h]$.

    $$
    \rho_{\mathrm{geo}} = \rho^{1/T} = \exp\Big(\tfrac1T \sum_t \log \rho_t\Big), \qquad
    \hat g_t = \mathbb{1}[l \le \rho_{\mathrm{geo}} \le h]\, A\, s_t .
    $$

    verl ``rollout_rs: geometric`` with ``rollout_rs_threshold: 1.001`` and
    ``rollout_rs_threshold_lower: 0.999`` (the ``pg_rs`` / ``decoupled_geo_rs`` presets); Liu,
    Li et al. (2025), part 3. Rejection only: kept sequences get weight 1, no ratio. The
    geometric mean is length-normalized, so long sequences are not rejected just for being
    long. Biased: the kept samples are still distributed as $\mu$, not $\pi$.

    Examples
    --------
    >>> toy = make_toy(mismatch=0.0)
    >>> bool(np.array_equal(geo_rs(toy), naive(toy)))  # every rho_geo is 1 at mismatch 0
    True
    """
    low, high = _check_band(low, high)
    ### BEGIN SOLUTION Task 8: 1 where low <= rho ** (1 / T) <= high, else 0 (no ratio)
    rho_geo = np.exp(_log_seq_ratio(toy) / toy["logp_train"].shape[1])
    weights = ((rho_geo >= low) & (rho_geo <= high)).astype(float)
    return _finish(toy, weights, baseline, return_weights)
    ### END SOLUTION


def icepop(toy, low=0.5, high=5.0, baseline=0.0, *, return_weights=False):
    r"""IcePop: per-token ratio, masked outside the band $[\alpha, \beta] = [0.5, 5]$.

    $$
    \hat g_t = \rho_t\, \mathbb{1}[\alpha \le \rho_t \le \beta]\, A\, s_t .
    $$

    From the Ling team's IcePop (inclusionAI, Ring-1T, 2025), with their band
    $\alpha = 0.5$, $\beta = 5$: two-sided token masking, i.e. ``token_mis(low=0.5, high=5.0)``.
    Tokens whose training and inference probabilities disagree by more than the band
    contribute no gradient at all. Biased, like every token-level correction: the ratio
    corrects the token, not its prefix or the sequence's reward, and the mask drops mass.

    Examples
    --------
    >>> toy = make_toy()
    >>> bool(np.array_equal(icepop(toy), token_mis(toy, low=0.5, high=5.0)))
    True
    """
    # The same weights as token_mis, with IcePop's band as the default.
    return token_mis(toy, low, high, baseline, return_weights=return_weights)


def token_clamp(toy, low=0.5, high=2.0, baseline=0.0, *, return_weights=False):
    r"""Two-sided truncation per token: $w_t = \mathrm{clip}(\rho_t, l, h)$.

    $$
    \hat g_t = \min(\max(\rho_t, l), h)\, A\, s_t .
    $$

    TIS with a floor as well as a cap (slime's ``--tis-clip-low`` / ``--tis-clip``): a token
    that the sampler over-samples keeps at least weight $l$ instead of a tiny ratio. Never
    drops a token. Biased.

    Examples
    --------
    >>> toy = make_toy()
    >>> w = token_clamp(toy, return_weights=True)
    >>> float(w.min()) >= 0.5 and float(w.max()) <= 2.0
    True
    """
    low, high = _check_band(low, high)
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
    >>> toy = make_toy()
    >>> bool(np.array_equal(cispo(toy, 0.5, 1.0), token_clamp(toy, 0.5, 2.0)))
    True
    """
    eps_low = check_finite_number("eps_low", eps_low)
    eps_high = check_finite_number("eps_high", eps_high, allow_inf=True)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low!r}, {eps_high!r}")
    # In bypass mode at one step, CISPO's weight is the two-sided clamp of the ratio.
    return token_clamp(toy, max(1.0 - eps_low, 0.0), 1.0 + eps_high, baseline,
                       return_weights=return_weights)


def ppo_clip_bypass(toy, eps=0.2, baseline=0.0, *, return_weights=False):
    r"""PPO's clipped surrogate in bypass mode: the rollout policy is the PPO anchor.

    The loss of token $t$ is $-\min(\rho_t A,\ \mathrm{clip}(\rho_t, 1 - \varepsilon,
    1 + \varepsilon) A)$ with $\rho_t = \pi_\theta(y_t) / \mu(y_t)$ (verl ``bypass_mode: true``
    with the PPO loss, ``clip_ratio`` 0.2). Its gradient is $\rho_t A s_t$ where the unclipped
    term is the minimum, and 0 where the clipped constant is:

    $$
    w_t = \rho_t \big(1 - \mathbb{1}[A > 0,\ \rho_t > 1 + \varepsilon]
    - \mathbb{1}[A < 0,\ \rho_t < 1 - \varepsilon]\big).
    $$

    So PPO's trust region becomes a one-sided token mask that depends on the sign of the
    advantage. Biased.

    Examples
    --------
    With a huge $\varepsilon$ nothing is clipped and it is ``token_is``:

    >>> toy = make_toy()
    >>> bool(np.array_equal(ppo_clip_bypass(toy, eps=1e9), token_is(toy)))
    True
    """
    eps = check_finite_number("eps", eps, positive=True)
    baseline_value = check_finite_number("baseline", baseline)
    ratio = token_ratios(toy)  # (M, T): PPO's ratio, anchored at the rollout policy
    advantage = (toy["R"] - baseline_value)[:, None]  # (M, 1)
    # The clipped branch of min(ratio A, clip(ratio) A) is a constant: no gradient there.
    clipped = ((advantage > 0) & (ratio > 1 + eps)) | ((advantage < 0) & (ratio < 1 - eps))
    weights = np.where(clipped, 0.0, ratio)
    return _finish(toy, weights, baseline, return_weights)


def token_veto(toy, threshold=1e-4, baseline=0.0, *, return_weights=False):
    r"""Catastrophic-token veto: reject the sequence if any $\rho_t < \tau$.

    $$
    \hat g_t = \mathbb{1}\big[\min_k \rho_k \ge \tau\big]\, A\, s_t .
    $$

    verl ``rollout_token_veto_threshold`` (off by default; 1e-4 in the ``decoupled_geo_rs`` and
    ``pg_rs`` presets). A token the trainer finds $10^4$ times less likely than the sampler
    did is a sign of a numerical accident, and the whole sequence is dropped. Rejection only,
    so biased wherever $\mu \ne \pi$: the kept sequences are still drawn from $\mu$, with
    weight 1.

    Examples
    --------
    >>> toy = make_toy()
    >>> bool(np.array_equal(token_veto(toy, threshold=0.0), naive(toy)))
    True
    """
    threshold = check_finite_number("threshold", threshold)
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    keep = token_ratios(toy).min(axis=1) >= threshold
    weights = keep.astype(float)
    return _finish(toy, weights, baseline, return_weights)


def k3_seq_rs(toy, threshold=0.01, baseline=0.0, *, return_weights=False):
    r"""Sequence rejection by the mean k3 divergence of its tokens.

    $$
    \bar k_3 = \frac1T \sum_t (\rho_t - 1 - \log \rho_t), \qquad
    \hat g_t = \mathbb{1}[\bar k_3 \le \tau]\, A\, s_t .
    $$

    With $y_t \sim \mu$, $\mathbb{E}_\mu[\rho_t - 1 - \log \rho_t] = \mathrm{KL}(\mu_t \,\|\,
    \pi_t)$, and each term is $\ge 0$: $\bar k_3$ is a per-token estimate of how far sampler and
    trainer are apart on this sequence. verl ``rollout_rs: seq_mean_k3`` with
    ``rollout_rs_threshold`` (no default there; 0.01 here). Rejection only. Biased.

    Examples
    --------
    >>> toy = make_toy()
    >>> bool(np.array_equal(k3_seq_rs(toy, threshold=np.inf), naive(toy)))
    True
    """
    threshold = check_finite_number("threshold", threshold, allow_inf=True)
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    log_rho_t = toy["logp_train"] - toy["logp_sampler"]
    k3 = np.expm1(log_rho_t) - log_rho_t  # rho - 1 - log rho, accurate near rho = 1
    weights = (k3.mean(axis=1) <= threshold).astype(float)
    return _finish(toy, weights, baseline, return_weights)


def geo_rs_token_tis(toy, low=0.999, high=1.001, cap=2.0, baseline=0.0, *,
                     return_weights=False):
    r"""Geometric rejection combined with token TIS: $w_t = \mathbb{1}[l \le \rho_{\mathrm{geo}}
    \le h] \min(\rho_t, C)$.

    The combination verl allows with ``rollout_rs: geometric`` and ``rollout_is: token``: reject
    the sequences that are far off on average, reweight the tokens of the others. Biased.

    Examples
    --------
    >>> toy = make_toy()
    >>> w = geo_rs_token_tis(toy, return_weights=True)
    >>> bool(np.array_equal(w, geo_rs(toy, return_weights=True)[:, None]
    ...                      * token_tis(toy, return_weights=True)))
    True
    """
    low, high = _check_band(low, high)
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
    range $\varepsilon_l = 3 \cdot 10^{-4}$, $\varepsilon_h = 4 \cdot 10^{-4}$ (TRL
    ``importance_sampling_level="sequence"``). The GSPO objective also divides each sequence's
    log-likelihood by its length; that is a loss-reduction choice (see
    [opd_literate.opd.aggregate_loss][]) and is left out here so that every estimator targets
    the same $\nabla J$. Biased.

    Examples
    --------
    >>> toy = make_toy(mismatch=0.0)
    >>> bool(np.array_equal(gspo(toy), naive(toy)))  # rho_geo = 1: nothing clipped
    True
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
        EstimatorSpec("naive", naive, {}, "no correction", False, "one"),
        EstimatorSpec("token_is", token_is, {}, "per-token ratio (PPO ratio, bypass)", False,
                      "token"),
        EstimatorSpec("seq_is", seq_is, {}, "sequence importance sampling", True, "sequence"),
        EstimatorSpec("token_tis", token_tis, {"cap": 2.0},
                      "Yao et al. 2025 (TIS); verl rollout_is=token", False, "token"),
        EstimatorSpec("seq_tis", seq_tis, {"cap": 2.0}, "verl rollout_is=sequence", False,
                      "sequence"),
        EstimatorSpec("token_mis", token_mis, {"low": 0.0, "high": 2.0},
                      "Liu, Li et al. 2025 (MIS); verl rollout_rs=token", False, "token"),
        EstimatorSpec("seq_mis", seq_mis, {"low": 0.0, "high": 2.0},
                      "Liu, Li et al. 2025 (MIS); verl rollout_rs=sequence", False, "sequence"),
        EstimatorSpec("geo_rs", geo_rs, {"low": 0.999, "high": 1.001},
                      "verl rollout_rs=geometric (pg_rs preset)", False, "one"),
        EstimatorSpec("icepop", icepop, {"low": 0.5, "high": 5.0}, "IcePop (Ring-1T, 2025)",
                      False, "token"),
        EstimatorSpec("token_clamp", token_clamp, {"low": 0.5, "high": 2.0},
                      "two-sided TIS (slime tis-clip-low/tis-clip)", False, "token"),
        EstimatorSpec("cispo", cispo, {"eps_low": 1.0, "eps_high": 4.0},
                      "MiniMax-M1 2025 (CISPO)", False, "token"),
        EstimatorSpec("ppo_clip_bypass", ppo_clip_bypass, {"eps": 0.2},
                      "PPO clip, verl bypass_mode", False, "token"),
        EstimatorSpec("token_veto", token_veto, {"threshold": 1e-4},
                      "verl rollout_token_veto_threshold", False, "one"),
        EstimatorSpec("k3_seq_rs", k3_seq_rs, {"threshold": 0.01},
                      "verl rollout_rs=seq_mean_k3", False, "one"),
        EstimatorSpec("geo_rs_token_tis", geo_rs_token_tis,
                      {"low": 0.999, "high": 1.001, "cap": 2.0},
                      "verl rollout_rs=geometric + rollout_is=token", False, "token"),
        EstimatorSpec("gspo", gspo, {"eps_low": 3e-4, "eps_high": 4e-4},
                      "Zheng et al. 2025 (GSPO), bypass", False, "geometric"),
    ]
}
"""Every estimator of this module by name, with its default thresholds and source."""


def estimator_weights(toy, name, **params):
    """The ``(M, T)`` weights of a registered estimator (its defaults, updated by ``params``)."""
    spec = _spec(name)
    weights = spec.fn(toy, **{**spec.defaults, **params}, return_weights=True)
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
    T = log_rho_t.shape[1]
    if kind == "one":
        return np.ones_like(log_rho_t)
    if kind == "token":
        return np.exp(log_rho_t)
    total = log_rho_t.sum(axis=1, keepdims=True)
    per_sequence = np.exp(total) if kind == "sequence" else np.exp(total / T)
    return np.broadcast_to(per_sequence, log_rho_t.shape)


def comparison_table(toy, names=None, N=64, baseline=0.0, params=None):
    r"""The exact comparison of estimators on one toy, one row per estimator.

    Each row holds: ``name``, ``bias``, ``var`` (of one sample), ``rel_bias``,
    ``rel_rmse`` for a batch of ``N`` sequences, ``token_frac`` and ``seq_frac`` (the
    probability under $\mu$ that a token, or a sequence, has a weight other than its
    uncorrected ratio: truncated, clipped, masked or rejected), ``unbiased`` (by construction)
    and ``source``.

    Parameters
    ----------
    toy : dict
        From [opd_literate.toy.make_toy][].
    names : list of str, optional
        Registered estimators; all by default.
    N : int
        Batch size for ``rel_rmse``.
    baseline : float
        Passed to every estimator.
    params : dict, optional
        ``{name: {param: value}}`` overriding defaults.

    Returns
    -------
    list of dict

    Examples
    --------
    >>> rows = comparison_table(make_toy(), names=["naive", "seq_is", "token_tis"])
    >>> [(r["name"], r["rel_bias"] < 1e-12, r["token_frac"] > 0) for r in rows]
    [('naive', False, False), ('seq_is', True, False), ('token_tis', False, True)]
    """
    check_toy(toy)
    params = params or {}
    names = list(REGISTRY) if names is None else list(names)
    mu = toy["p_sampler"]
    rows = []
    for name in names:
        spec = _spec(name)
        kwargs = {**spec.defaults, **params.get(name, {})}
        weights = estimator_weights(toy, name, **kwargs)
        estimate = weighted_score(toy, weights, baseline)
        moments = estimator_moments(toy, estimate)
        modified = ~np.isclose(weights, _reference_weights(toy, spec.reference),
                               rtol=1e-12, atol=0.0)
        rows.append(dict(
            name=name,
            bias=moments["bias"],
            var=moments["var"],
            rel_bias=moments["rel_bias"],
            rel_rmse=moments["rel_rmse"](N),
            token_frac=float(mu @ modified.mean(axis=1)),
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


def format_table(rows, N=64):
    """Render ``comparison_table`` rows as a Markdown table (used by the docs)."""
    lines = [f"| estimator | rel. bias | variance | rel. RMSE (N={N}) | tokens modified "
             "| sequences modified | unbiased |",
             "| --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in rows:
        lines.append(
            f"| `{r['name']}` | {r['rel_bias']:.4f} | {r['var']:.4g} | {r['rel_rmse']:.4f} | "
            f"{100 * r['token_frac']:.1f}% | {100 * r['seq_frac']:.1f}% | "
            f"{'yes' if r['unbiased'] else 'no'} |"
        )
    return "\n".join(lines)
