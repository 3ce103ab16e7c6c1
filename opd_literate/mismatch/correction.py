r"""Rollout correction on real ``(B, T)`` batches: the weights, rejections and losses of verl.

[opd_literate.mismatch.estimators][] defines every correction as a numpy function of the enumerable
toy, where its exact bias and variance can be computed. This module is the same set of corrections
in the form a trainer needs: torch functions of the ``(B, T)`` tensors that an RL framework holds
after a rollout.

* ``trainer_logp``: $\log \pi_\theta(y_t \mid s_t)$, the trainer's log-probability of each
  sampled token (it may carry a gradient);
* ``sampler_logp``: $\log \mu(y_t \mid s_t)$, the inference engine's log-probability of the same
  token (a constant);
* ``mask``: 1 for the response's tokens, 0 for the padding;
* ``advantages``: $A_{b,t}$, ``(B, T)``, or ``(B,)`` for one advantage per response, expanded
  over its tokens (the losses only).

With $\log \rho_t = \log \pi_\theta(y_t) - \log \mu(y_t)$ and $n_b$ the tokens of response $b$:

$$
\rho_t = e^{\log \rho_t}, \qquad
\rho = \exp \sum_t \log \rho_t, \qquad
\rho_{\mathrm{geo}} = \exp\Big(\frac{1}{n_b} \sum_t \log \rho_t\Big).
$$

[opd_literate.mismatch.correction.rollout_correction][] returns a ``Correction``: detached per-token
``weights`` (the importance weights, 0 on the padding), a boolean ``keep`` mask (the response
mask less the rejected tokens) and ``metrics``, named as verl logs them. A trainer multiplies
its per-token policy-gradient loss by ``weights`` and reduces it over ``keep``; on the toy,
``weights * keep`` is exactly the weight $w_t$ of the matching numpy estimator
(``tests/mismatch/test_correction.py`` checks the eighteen of verl's options and the papers,
``tests/mismatch/test_peer_switches.py`` the seven below). The losses take the sampler's
log-probabilities as the PPO anchor, as verl's *bypass mode* does, and their autograd
gradient is the estimator: [opd_literate.mismatch.correction.ppo_clip_loss][] (with verl's
dual clip) and [opd_literate.mismatch.correction.reinforce_loss][] are the two losses of
verl's bypass-mode loss (``loss_mode: bypass_mode``, ``loss_type: ppo_clip`` and
``reinforce``); [opd_literate.mismatch.correction.cispo_loss][],
[opd_literate.mismatch.correction.gspo_loss][], the DPPO losses
[opd_literate.mismatch.correction.dppo_tv_loss][] and
[opd_literate.mismatch.correction.dppo_kl_loss][], and
[opd_literate.mismatch.correction.dro_loss][] are verl's losses of those names with the sampler
as their anchor. **Which verl trainer runs them so** (``VERL_VERSION``): its default trainer
(``trainer.use_v1: true``, ``verl/trainer/ppo/v1/trainer_base.py``) answers
``bypass_mode: true`` by setting ``old_log_probs = rollout_log_probs`` and nothing else: the
actor's ``loss_mode`` (``vanilla``, ``cispo``, ``gspo``, ``dppo_tv``, ``dppo_kl``, ``dro``, ...)
runs with the sampler as its anchor, and the rollout-correction weights and rejection are not
computed (``loss_type`` and ``rollout_rs`` are read only by ``loss_mode: bypass_mode``, which
reads them from ``policy_loss.rollout_correction``). The legacy trainer
(``trainer.use_v1: false``, ``verl/trainer/ppo/ray_trainer.py``) calls ``apply_bypass_mode``,
which also replaces the ``loss_mode`` by ``"bypass_mode"`` and copies the rollout-correction
options into it: there the only losses with the sampler as their anchor are PPO's clip and
REINFORCE (``tests/integration/test_verl.py`` reads both trainers).
[opd_literate.mismatch.correction.kl_penalty][] adds the straight-through ``"k1+"`` /
``"k3+"`` estimators.

**Other frameworks' switches.** [opd_literate.mismatch.correction.trl_importance_weights][] is
TRL's vLLM importance correction (its four ``vllm_importance_sampling_mode`` values) and
[opd_literate.mismatch.correction.off_policy_sequence_mask][] its ``off_policy_mask_threshold``
(TRL 1.16.0, ``tests/integration/test_trl_is_modes.py`` runs TRL's own code on the same
batches); [opd_literate.mismatch.correction.seq_mask_tis_weights][] is the seq-mask-tis of
OpenRLHF and NeMo-RL, and [opd_literate.mismatch.correction.kpop_mask][] KPop's binary-KL
mask (prime-rl, AReaL), each read from the commit its docstring names.

**Kept masses.** Where the engine cuts (top-$k$, top-$p$, min-$p$), which log-probs it reports
and how the trainer corrects them by a kept mass decide what the ratio estimates
([opd_literate.mismatch.engine][] derives it on the toy).
[opd_literate.mismatch.correction.kept_mass_log_ratio][] computes the per-token log-ratio of
each choice from the trainer's ``(B, T, V)`` logits and the engine's kept sets: the processed,
raw or tempered (SGLang's) log-probs, renormalised on the kept set or with the trainer's kept
mass added (TRL's pull request #7269), or the engine's mask replayed in the trainer; the
``trainer_logp`` and ``sampler_logp`` it returns are those the weights and losses here take.

**Overflow.** Every ratio is the exponential of a log-ratio clamped to
$[-20, 20]$ (``SAFETY_BOUND``, as verl's ``rollout_corr_helper.py`` and its PPO losses do), so a
ratio lies in $[e^{-20}, e^{20}] \approx [2 \cdot 10^{-9}, 4.9 \cdot 10^{8}]$ and never overflows,
even in float32. The price: a sequence ratio beyond $e^{20}$ is reported as $e^{20}$, and the
clamp has zero derivative outside its range. In the losses whose gradient flows through the
ratio ([opd_literate.mismatch.correction.ppo_clip_loss][] and
[opd_literate.mismatch.correction.gspo_loss][]) a term whose log-ratio is clamped therefore
sends no gradient. [opd_literate.mismatch.correction.cispo_loss][] and
[opd_literate.mismatch.correction.reinforce_loss][] detach the weight and differentiate
$\log \pi$ alone, so such a term still sends its weighted score: at $\log \rho = 25$ and
$A = 1$, CISPO's gradient is $-1.2$ (its weight capped at $1 + \epsilon$) and REINFORCE with
the truncated weight (2) gives $-2$.

**Conventions** (those of [opd_literate.opd][]). Inputs are validated, with errors that name the
argument; a half-precision input is computed in float32; positions with ``mask == 0`` may hold
anything (``-inf``, NaN) and are selected away with ``torch.where`` before any arithmetic, so
they are exactly 0 in every value and every gradient. A valid position must hold finite
log-probabilities: a sampled token has probability $> 0$ under the sampler that drew it.
The DPPO and DRO losses also refuse a log-probability above 0 where ``mask`` is 1 (a
``ValueError`` naming the argument and the position): DPPO reads $p = e^{\log p}$ as a
probability ($p - q$, and $1 - p$ inside a logarithm, where verl would take the logarithm of a
negative number), and DRO's value is the log-likelihood $A \log \pi_\theta(y_t)$ pulled toward
$\log \mu(y_t)$. The other functions accept any finite value, as verl's do: the weights, masks,
KL penalties and the PPO and GSPO losses read only $\log \pi_\theta - \log \mu$, so a log-ratio
may stand as ``trainer_logp`` with ``sampler_logp = 0``; the perplexities of
[opd_literate.mismatch.correction.offpolicy_metrics][] and the values of CISPO and REINFORCE
read $\log \pi_\theta$ itself, as DRO's does, and take it above 0 all the same.

**Source.** Every "verl" below is the verl release ``VERL_VERSION`` (0.9.1, from the package
index), whose functions ``tests/integration/test_verl.py`` calls on the same batches as this
module: the rollout-correction helper ``verl/trainer/ppo/rollout_corr_helper.py``, its config
``RolloutCorrectionConfig`` in ``verl/trainer/config/algorithm.py`` and
``verl/trainer/config/algorithm/rollout_correction.yaml``, and the losses in
``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``,
``compute_policy_loss_cispo``, ``compute_policy_loss_gspo``, ``compute_policy_loss_reinforce``,
``compute_policy_loss_bypass_mode``, ``agg_loss``, ``kl_penalty``). The history ("since
commit ...") is read from verl-project/verl up to ``VERL_COMMIT`` (1dda039, 2026-08-22, the
newest stored commit; 0.9.1's ``rollout_corr_helper.py`` is byte-identical to it, and its
``core_algos.py`` differs only in GSPO's reduction, see
[opd_literate.mismatch.correction.gspo_loss][]).
"""

from __future__ import annotations

import math
import numbers
import re
from typing import NamedTuple

import torch

from .._numerics import (
    BINARY_KL_EPS,
    VERL_COMMIT,
    VERL_VERSION,
    aggregate,
    check_band,
    check_choice,
    check_finite_number,
    check_float_tensor,
    check_mask,
    check_reduction,
    check_same_shape,
    compute_dtype,
    lengths,
    masked_mean,
    select,
)
from ..opd import kl_estimator
from .engine import KEPT_MASS, REPORTED
from .groups import BASELINES, VERL_EPSILON

__all__ = [
    "VERL_COMMIT",
    "VERL_VERSION",
    "SAFETY_BOUND",
    "IS_LEVELS",
    "IS_MODES",
    "RS_OPTIONS",
    "KL_PENALTIES",
    "PRESETS",
    "Correction",
    "log_ratios",
    "importance_weights",
    "rejection_mask",
    "veto_mask",
    "offpolicy_metrics",
    "rollout_correction",
    "TRL_IS_MODES",
    "trl_importance_weights",
    "off_policy_sequence_mask",
    "seq_mask_tis_weights",
    "kpop_mask",
    "ppo_clip_loss",
    "cispo_loss",
    "gspo_loss",
    "reinforce_loss",
    "dppo_tv_loss",
    "dppo_kl_loss",
    "dro_loss",
    "sapo_loss",
    "geo_mean_loss",
    "luspo_loss",
    "VESPO_LOG_W_MIN",
    "vespo_loss",
    "clip_cov_loss",
    "sapo_weights",
    "gspo_weights",
    "clip_cov_weights",
    "kl_cov_loss",
    "kl_penalty",
    "KeptMassRatio",
    "kept_mass_log_ratio",
    "group_advantages",
]

SAFETY_BOUND = 20.0
r"""Log-ratios are clamped to $[-20, 20]$ before the exponential (verl's ``SAFETY_BOUND``)."""

IS_LEVELS = ("token", "sequence", "geometric")
"""The ratio of [opd_literate.mismatch.correction.importance_weights][]: verl's ``rollout_is``
levels ``"token"`` and ``"sequence"``, and the geometric mean (not a ``rollout_is`` level in
verl)."""

IS_MODES = ("truncate", "mask", "clamp")
"""What happens outside the band: cap the weight (verl's TIS), drop it (verl's IcePop, a
``"lower_upper"`` threshold), or clamp it (not a verl mode)."""

RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
"""verl's ``rollout_rs`` criteria (``SUPPORTED_ROLLOUT_RS_OPTIONS`` in ``VERL_VERSION``)."""

KL_PENALTIES = ("k1", "k2", "k3", "k1+", "k3+")
"""The estimators of [opd_literate.mismatch.correction.kl_penalty][] (verl's ``kl_penalty``)."""

_METRIC_PREFIX = "rollout_corr/"


class Correction(NamedTuple):
    """What [opd_literate.mismatch.correction.rollout_correction][] returns."""

    weights: torch.Tensor
    """``(B, T)`` detached importance weights, 0 on the padding (1 on the tokens without IS)."""
    keep: torch.Tensor
    """``(B, T)`` bool: the mask less every rejected token."""
    metrics: dict
    """``{"rollout_corr/<verl name>": float}``."""


# ---------------------------------------------------------------------------------------------
# Checks and log-ratios
# ---------------------------------------------------------------------------------------------
def _check_batch(trainer_logp, sampler_logp, mask, sampler_name="sampler_logp"):
    """Validate the (B, T) pair and the mask; return the bool mask and the compute dtype.

    ``sampler_name`` names the second tensor in the errors (kl_penalty's is ``ref_logp``)."""
    check_float_tensor("trainer_logp", trainer_logp, 2)
    check_float_tensor(sampler_name, sampler_logp, 2)
    check_same_shape("trainer_logp", trainer_logp, sampler_name, sampler_logp)
    mask = check_mask(mask, "trainer_logp", tuple(trainer_logp.shape))
    for name, logp in (("trainer_logp", trainer_logp), (sampler_name, sampler_logp)):
        bad = mask & ~torch.isfinite(logp.detach())
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} must be finite where mask is 1 (a sampled token has a probability > 0), "
                f"got {logp[b, t].item()!r} at position ({b}, {t})"
            )
    return mask, compute_dtype(trainer_logp, sampler_logp)


def _token_log_ratio(trainer_logp, sampler_logp, mask, dtype):
    r"""$\log \rho_t$ where mask is 1, exactly 0 elsewhere (in value and gradient)."""
    zeros = torch.zeros((), dtype=dtype, device=trainer_logp.device)
    trainer = torch.where(mask, trainer_logp.to(dtype), zeros)
    sampler = torch.where(mask, sampler_logp.detach().to(dtype), zeros)
    # log rho_t = log pi(y_t) - log mu(y_t)
    return trainer - sampler


def _level_log_ratio(log_rho_t, mask, level):
    """The (B, T) log-ratio of a level: per token, or the response's sum or mean on every token."""
    if level == "token":
        return log_rho_t
    total = log_rho_t.sum(dim=1, keepdim=True)  # (B, 1): the padding holds exactly 0
    if level == "geometric":
        total = total / lengths(mask, log_rho_t.dtype)[:, None]
    return total.expand_as(log_rho_t)


def _exp_safe(log_ratio):
    r"""$\exp(\mathrm{clamp}(x, -20, 20))$: never overflows (verl's ``SAFETY_BOUND``)."""
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def log_ratios(trainer_logp, sampler_logp, mask, level="token"):
    r"""The ``(B, T)`` log importance ratio of a level, 0 on the padding, unclamped.

    ``"token"``: $\log \rho_t$; ``"sequence"``: $\sum_t \log \rho_t$ on every token of the
    response; ``"geometric"``: $\frac{1}{n_b} \sum_t \log \rho_t$ on every token. It keeps the
    gradient of ``trainer_logp`` (the sampler's is a constant).

    Examples
    --------
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2]]))   # rho_t = 0.625, 2.5
    >>> ones = torch.ones(1, 2)
    >>> [round(v, 6) for v in log_ratios(trainer, sampler, ones, "sequence").exp()[0].tolist()]
    [1.5625, 1.5625]
    >>> [round(v, 6) for v in log_ratios(trainer, sampler, ones, "geometric").exp()[0].tolist()]
    [1.25, 1.25]
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {IS_LEVELS}, got {level!r}")
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    return select(mask, _level_log_ratio(log_rho_t, mask, level))


# ---------------------------------------------------------------------------------------------
# Importance weights
# ---------------------------------------------------------------------------------------------
def importance_weights(trainer_logp, sampler_logp, mask, rollout_is="token", *,
                       rollout_is_threshold=2.0, mode="truncate", lower=None,
                       rollout_is_batch_normalize=False):
    r"""Detached importance weights: a ratio, capped, masked or clamped, optionally normalised.

    With $r$ the ratio of the level ``rollout_is`` ($\rho_t$, $\rho$ or $\rho_{\mathrm{geo}}$,
    the last two the same on every token of a response), $h$ = ``rollout_is_threshold`` and
    $l$ = ``lower``:

    $$
    w^{\mathrm{truncate}} = \min(r, h), \qquad
    w^{\mathrm{mask}} = r\, \mathbb{1}[l \le r \le h], \qquad
    w^{\mathrm{clamp}} = \min(\max(r, l), h),
    $$

    and with ``rollout_is_batch_normalize`` the weights are divided by their mean: over the
    valid tokens for ``"token"``, over the responses with a token for the sequence levels
    (verl's two means), unless that mean is below $10^{-8}$ (then unchanged, as in verl).

    ``rollout_is_threshold`` is read as verl reads it: a number (or a string holding one) is
    the cap $h$ (TIS); a string ``"l_h"`` is IcePop, ``mode="mask"`` with ``lower=l``: the
    ratio kept inside $[l, h]$ and 0 outside, with $0 < l \le h$ (verl's check, since commit
    ``d2916f5``, PR #5722; before it verl only truncated).

    | option | verl name (``algorithm.rollout_correction``) | default here | verl default |
    | --- | --- | --- | --- |
    | ``rollout_is`` | ``rollout_is`` (``"token"``, ``"sequence"``) | ``"token"`` | ``null`` |
    | ``rollout_is_threshold`` | ``rollout_is_threshold`` (``h`` or ``"l_h"``) | 2.0 | 2.0 |
    | ``rollout_is_batch_normalize`` | ``rollout_is_batch_normalize`` | False | false |
    | ``mode="clamp"``, ``lower`` | none: verl truncates or masks (IcePop) | | |

    verl's presets ``decoupled_token_icepop`` and ``bypass_pg_token_icepop`` are
    ``rollout_is="token"`` with ``rollout_is_threshold="0.5_5.0"`` (``PRESETS``). verl's
    ``RolloutCorrectionConfig`` dataclass defaults ``rollout_is`` to ``"sequence"``, its YAML
    to ``null``.

    Parameters
    ----------
    trainer_logp, sampler_logp : torch.Tensor
        ``(B, T)`` floating; finite where ``mask`` is 1.
    mask : torch.Tensor
        ``(B, T)`` in {0, 1}.
    rollout_is : {"token", "sequence", "geometric"}
    rollout_is_threshold : float or str
        $h > 0$ (``inf`` for none), or ``"l_h"`` with $0 < l \le h$ (IcePop); a finite bound
        must be a normal number of the compute dtype (in float32
        $1.2 \cdot 10^{-38} \le h \le 3.4 \cdot 10^{38}$).
    mode : {"truncate", "mask", "clamp"}
    lower : float, optional
        $l \ge 0$ for ``"mask"`` and ``"clamp"`` (default 0); not allowed with ``"truncate"``
        nor with an ``"l_h"`` threshold.
    rollout_is_batch_normalize : bool

    Returns
    -------
    weights : torch.Tensor
        ``(B, T)``, detached, 0 where ``mask`` is 0 (float32 for half-precision inputs).
    metrics : dict
        verl's names (``compute_is_metrics``) without the ``rollout_corr/`` prefix, of the
        applied weights $w$ (before the batch normalisation), with $l' = l$ if $l > 0$ else
        $1/h$ as in verl:

        * ``rollout_is_mean``: the mean of $w$ over the valid tokens;
        * ``rollout_is_max``, ``rollout_is_min``: of $w$ over the valid tokens for
          ``"token"``; for the sequence levels, of the response's ratio $r$ before the cap,
          from its unclamped log-ratio (reported at most $e^{20}$, where verl's minimum is not
          capped);
        * ``rollout_is_ratio_fraction_high`` / ``_low``: the share of tokens (or responses)
          whose ratio is above $h$ / below $l'$;
        * ``rollout_is_std`` and ``rollout_is_eff_sample_size`` of $u = \min(w, h)$ over the
          $n$ valid tokens: the standard deviation (population, 0 for one token) and the
          effective sample size per token $\bar u^2 / \overline{u^2}$, in $(0, 1]$ when some
          weight is above 0 (computed on $u / \max u$, whose squares cannot underflow). Where
          every weight is 0 (IcePop with every ratio outside its band) that is $0 / 0$, and
          this library reports 0: no token carries weight. verl computes
          $1 / \overline{(u / (\bar u_v + 10^{-8}))^2}_v = (\bar u_v + 10^{-8})^2 /
          \overline{u^2}_v$, its means dividing by $n + 10^{-8}$ ($\bar x_v = \sum x /
          (n + 10^{-8})$): this one times $(1 + 10^{-8} (1 + 10^{-8} / n) / \bar u)^2 /
          (1 + 10^{-8} / n)$, to first order larger by a relative
          $2 \cdot 10^{-8} / \bar u - 10^{-8} / n$. Where every weight is 0, verl divides the
          Python float 1.0 by 0.0 and raises ``ZeroDivisionError`` (``compute_is_metrics``,
          ``verl/trainer/ppo/rollout_corr_helper.py`` line 758 in ``VERL_VERSION``), which
          its trainer's call in decoupled mode (``compute_rollout_correction_and_add_to_batch``)
          does not catch;
        * ``rollout_is_seq_mean``, ``_seq_std`` (with $n - 1$), ``_seq_max``, ``_seq_min``,
          ``_seq_max_deviation`` ($\max |\bar w_b - 1|$) of the per-response mean weight
          $\bar w_b$, and ``rollout_is_seq_fraction_high`` / ``_low``, the share of
          responses whose mean *ratio* is above $h$ / below $l'$;
        * ``rollout_is_oob_ratio`` (IcePop only): the share of tokens outside $[l, h]$;
        * ``rollout_is_batch_norm_factor`` when normalising.

        The ``rollout_is_seq_*`` metrics are over the responses with a token; verl also counts
        a row with no token (with $\bar w_b = 0$), and its sequence-level max, min and
        fractions count such a row as a ratio of 1.

    Examples
    --------
    The ratios $0.625$ and $2.5$: the cap 2 truncates the second, IcePop's band $[0.5, 2]$
    drops it, the band $[0.7, 2]$ clamps both:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2]]))
    >>> ones = torch.ones(1, 2)
    >>> w, m = importance_weights(trainer, sampler, ones)
    >>> [round(v, 6) for v in w[0].tolist()], round(m["rollout_is_max"], 6)
    ([0.625, 2.0], 2.0)
    >>> w, m = importance_weights(trainer, sampler, ones, rollout_is_threshold="0.5_2.0")
    >>> [round(v, 6) for v in w[0].tolist()], m["rollout_is_oob_ratio"]
    ([0.625, 0.0], 0.5)
    >>> w, _ = importance_weights(trainer, sampler, ones, mode="clamp", lower=0.7)
    >>> [round(v, 6) for v in w[0].tolist()]
    [0.7, 2.0]

    The sequence ratio $0.625 \cdot 2.5 = 1.5625$ is under the cap:

    >>> w, m = importance_weights(trainer, sampler, ones, "sequence")
    >>> [round(v, 6) for v in w[0].tolist()], round(m["rollout_is_max"], 6)
    ([1.5625, 1.5625], 1.5625)
    """
    low, high, mode = _check_is_options(rollout_is, rollout_is_threshold, mode, lower,
                                        rollout_is_batch_normalize)
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    return _importance_weights(trainer_logp, sampler_logp, mask, dtype, rollout_is, low, high,
                               mode, rollout_is_batch_normalize)


def _parse_is_threshold(rollout_is_threshold):
    """verl's reading of ``rollout_is_threshold``: (lower or None, upper); "l_h" is IcePop."""
    if not isinstance(rollout_is_threshold, str):
        return None, rollout_is_threshold
    spec = rollout_is_threshold.strip()
    parts = spec.split("_", 1) if "_" in spec else [None, spec]
    try:
        # a plain decimal each (float() alone would read "0.5_5_0"'s upper "5_0" as 50)
        if any(p is not None and not _NUMBER.fullmatch(p.strip()) for p in parts):
            raise ValueError
        lower, upper = (None if p is None else float(p) for p in parts)
    except ValueError:
        raise ValueError("rollout_is_threshold must be a number or a string 'upper' or "
                         f"'lower_upper' such as '0.5_5.0', got {rollout_is_threshold!r}"
                         ) from None
    if lower is not None:
        lower = check_finite_number("rollout_is_threshold's lower bound", lower, positive=True)
    return lower, upper


def _check_is_options(rollout_is, rollout_is_threshold, mode, lower, rollout_is_batch_normalize):
    """Validate the options of importance_weights; return the band (lower or 0, threshold) and
    the mode ("mask" for an IcePop threshold "l_h")."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS}, got {rollout_is!r}")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    icepop_lower, upper = _parse_is_threshold(rollout_is_threshold)
    if icepop_lower is not None:
        if mode != "truncate" or lower is not None:
            raise ValueError(f"rollout_is_threshold={rollout_is_threshold!r} (IcePop) sets the "
                             f"band itself; got also mode={mode!r}, lower={lower!r}")
        mode, lower = "mask", icepop_lower
    if mode == "truncate" and lower is not None:
        raise ValueError(f"lower applies to mode 'mask' or 'clamp', not 'truncate' (got "
                         f"lower={lower!r}); truncation caps from above only")
    low, high = check_band(0.0 if lower is None else lower, upper,
                           "lower", "rollout_is_threshold", cap=True)
    if not isinstance(rollout_is_batch_normalize, bool):
        raise TypeError("rollout_is_batch_normalize must be a bool, got "
                        f"{type(rollout_is_batch_normalize).__name__}")
    return low, high, mode


def _importance_weights(trainer_logp, sampler_logp, mask, dtype, rollout_is, low, high, mode,
                        rollout_is_batch_normalize):
    """[opd_literate.mismatch.correction.importance_weights][] on checked inputs."""
    _check_threshold_fits(high, dtype)
    with torch.no_grad():  # the weights change the measure, not the objective: detached
        log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
        log_r = _level_log_ratio(log_rho_t, mask, rollout_is)
        ratio = select(mask, _exp_safe(log_r))  # (B, T), in [e^-20, e^20], 0 on the padding
        if mode == "truncate":
            weights = torch.clamp(ratio, max=high)  # min(r, h)
        elif mode == "mask":
            weights = torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)
        else:
            weights = torch.clamp(ratio, min=low, max=high)
        weights = select(mask, weights)
        metrics = _is_metrics(weights, ratio, log_r, mask, rollout_is,
                              low if low > 0 else 1.0 / high, high)
        if mode == "mask" and low > 0 and bool(mask.any()):  # verl's IcePop diagnostic
            outside = (ratio < low) | (ratio > high)
            metrics["rollout_is_oob_ratio"] = float(masked_mean(outside.to(dtype), mask))
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean = masked_mean(weights, mask)
            else:
                has_token = mask.any(dim=1)
                # max over a response = its one weight (all its tokens share it, padding is 0);
                # a (B, 0) batch has no token, and max over an empty dimension is an error
                per_response = (weights.max(dim=1).values if weights.shape[1]
                                else weights.new_zeros(weights.shape[0]))
                mean = per_response.sum() / has_token.sum().clamp_min(1)
            factor = float(mean) if float(mean) > 1e-8 else 1.0
            weights = weights / factor
            metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _check_threshold_fits(high, dtype):
    """Refuse a finite cap that the compute dtype cannot hold (it would round to 0 or inf)."""
    info = torch.finfo(dtype)
    if math.isfinite(high) and not info.tiny <= high <= info.max:
        raise ValueError(
            f"rollout_is_threshold={high!r} is outside the normal range of {dtype} "
            f"[{info.tiny:.3g}, {info.max:.3g}], the dtype the weights are computed in (float32 "
            "for half-precision inputs); use float64 inputs, or inf for no cap")


def _is_metrics(weights, ratio, log_r, mask, level, low, high):
    """verl's ``compute_is_metrics``: the applied weights, the ratios for the fractions."""
    if not bool(mask.any()):
        return {}
    metrics = {"rollout_is_mean": float(masked_mean(weights, mask))}
    log_high = math.log(high) if math.isfinite(high) else math.inf
    log_low = math.log(low) if low > 0 else -math.inf
    has_token = mask.any(dim=1)
    if level == "token":
        metrics["rollout_is_max"] = float(weights[mask].max())
        metrics["rollout_is_min"] = float(weights[mask].min())
        unit_log = log_r[mask]
    else:  # one ratio per response with a token, read in log space: exact beyond the clamp
        unit_log = log_r[:, 0][has_token]
        metrics["rollout_is_max"] = math.exp(min(float(unit_log.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(min(float(unit_log.min()), SAFETY_BOUND))
    metrics["rollout_is_ratio_fraction_high"] = float((unit_log > log_high).double().mean())
    metrics["rollout_is_ratio_fraction_low"] = float((unit_log < log_low).double().mean())
    capped = torch.clamp(weights, max=high)
    mean = masked_mean(capped, mask)
    mean_square = masked_mean(capped.square(), mask)
    n_tokens = int(mask.sum())
    metrics["rollout_is_std"] = (float(torch.sqrt((mean_square - mean.square()).clamp_min(0.0)))
                                 if n_tokens > 1 else 0.0)
    # ESS / n = mean(u)^2 / mean(u^2), scale-free: on v = u / max u in [0, 1] (one v is 1, so
    # mean(v^2) >= 1/n, where u^2 could underflow: u = 1e-30 in float32), at most 1 by
    # Cauchy-Schwarz (min absorbs the rounding); 0, not 0/0, when every weight is 0
    top = capped[mask].max()
    if float(top) > 0:
        v = capped / top
        ess = min(float(masked_mean(v, mask).square() / masked_mean(v.square(), mask)), 1.0)
    else:
        ess = 0.0
    metrics["rollout_is_eff_sample_size"] = ess
    lengths_ = lengths(mask, weights.dtype)
    seq_weight = (weights.sum(dim=1) / lengths_)[has_token]  # (responses,) mean weight
    seq_ratio = (ratio.sum(dim=1) / lengths_)[has_token]  # mean ratio, before the cap
    metrics["rollout_is_seq_mean"] = float(seq_weight.mean())
    metrics["rollout_is_seq_std"] = float(seq_weight.std()) if seq_weight.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = float(seq_weight.max())
    metrics["rollout_is_seq_min"] = float(seq_weight.min())
    metrics["rollout_is_seq_max_deviation"] = float((seq_weight - 1.0).abs().max())
    metrics["rollout_is_seq_fraction_high"] = float((seq_ratio > high).double().mean())
    metrics["rollout_is_seq_fraction_low"] = float((seq_ratio < low).double().mean())
    return metrics


# ---------------------------------------------------------------------------------------------
# Rejection
# ---------------------------------------------------------------------------------------------
def _parse_rs(rollout_rs, rollout_rs_threshold):
    """verl's parsing: comma-separated options and thresholds, one shared or one per option."""
    if not isinstance(rollout_rs, str):
        raise TypeError(f"rollout_rs must be a string such as 'token_k1,seq_mean_k3', got "
                        f"{type(rollout_rs).__name__} {rollout_rs!r}")
    options = _rs_entries("rollout_rs", rollout_rs, f"at least one of {RS_OPTIONS}")
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rollout_rs options {unknown} are not verl's; known: {RS_OPTIONS}")
    repeated = sorted({o for o in options if options.count(o) > 1})
    if repeated:
        raise ValueError(f"rollout_rs names {repeated} more than once: {rollout_rs!r}")
    if isinstance(rollout_rs_threshold, bool) or rollout_rs_threshold is None:
        raise TypeError("rollout_rs_threshold must be a number or a string such as "
                        f"'0.5_2.0,0.01', got {rollout_rs_threshold!r}")
    if isinstance(rollout_rs_threshold, numbers.Real):
        specs = [str(check_finite_number("rollout_rs_threshold", rollout_rs_threshold,
                                         allow_inf=True))]
    elif isinstance(rollout_rs_threshold, str):
        specs = _rs_entries("rollout_rs_threshold", rollout_rs_threshold, "a threshold")
    else:
        raise TypeError("rollout_rs_threshold must be a number or a string, got "
                        f"{type(rollout_rs_threshold).__name__}")
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold must give one threshold or one per option "
                         f"({len(options)} for {options}), got {len(specs)}: "
                         f"{rollout_rs_threshold!r}")
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = {}
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            # "a_b" keeps log a <= -log rho <= log b; a single h means "1/h_h"
            parts = spec.split("_")
            if len(parts) > 2:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option!r}: k1 takes "
                                 "'lower_upper' or one number")
            upper = _rs_number(option, spec, parts[-1])
            lower = _rs_number(option, spec, parts[0]) if len(parts) == 2 else 1.0 / upper
            if lower == 0.0:  # "inf" alone: the band [1/h, h] would have the lower bound 0
                raise ValueError(f"rollout_rs_threshold for {option!r} must be positive, got "
                                 f"{spec!r}, whose lower bound 1/h is 0 (for no lower bound "
                                 "on the ratio write 'a_inf')")
            if math.isinf(lower):  # -log rho >= inf: no token is kept
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option!r} has the lower "
                                 "bound inf, which keeps no token")
            if not lower <= upper:  # an empty band would silently reject every token
                raise ValueError(
                    f"rollout_rs_threshold {spec!r} for {option!r} is the empty band "
                    f"[{lower!r}, {upper!r}] (lower > upper; a single number h < 1 means "
                    "the band [1/h, h])")
        elif "_" in spec:
            raise ValueError(f"rollout_rs_threshold for {option!r} is one upper bound, got "
                             f"{spec!r}")
        else:
            lower, upper = None, _rs_number(option, spec, spec)
        bounds[option] = (lower, upper)
    return bounds


def _rs_entries(name, text, expected):
    """The comma-separated entries of an option string; an empty entry is an error, not skipped
    (it would pair every later threshold with the wrong option)."""
    entries = [entry.strip() for entry in text.split(",")]
    if not any(entries):
        raise ValueError(f"{name} must name {expected}, got {text!r}")
    if not all(entries):
        raise ValueError(f"{name} has an empty entry (entry {entries.index('') + 1} of "
                         f"{len(entries)} in {text!r})")
    return entries


# A plain decimal number: float() would also read "2_0" as 20 and "0.5_2.0_3"'s upper as 2.03
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|infinity|nan)",
                     re.IGNORECASE)


def _rs_number(option, spec, text):
    """One bound of a rejection threshold: a positive decimal number, or inf (no bound there:
    verl reads ``"0.5_inf"`` as the ratio at most 2 with no lower bound); NaN is refused, which
    verl accepts and then rejects every token with."""
    if not _NUMBER.fullmatch(text.strip()):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option!r} is not a number "
                         "(k1 takes 'lower_upper' or one number)")
    value = float(text)
    if not value > 0:  # NaN fails this too
        raise ValueError(f"rollout_rs_threshold for {option!r} must be positive (or inf), "
                         f"got {spec!r}")
    return value


def rejection_mask(trainer_logp, sampler_logp, mask, rollout_rs, rollout_rs_threshold):
    r"""verl's rejection sampling: which tokens every criterion of ``rollout_rs`` keeps.

    With the clamped log-ratio $x_t = \mathrm{clamp}(\log \rho_t, -20, 20)$, the per-token
    divergences are verl's

    $$
    k_1 = -x_t, \qquad k_2 = \tfrac12 x_t^2, \qquad k_3 = e^{x_t} - 1 - x_t,
    $$

    and a criterion ``level_kN`` reads one of them per token (``token_``) or per response, as
    the sum, mean or max over its tokens (``seq_sum_``, ``seq_mean_``, ``seq_max_``; a sequence
    criterion rejects every token of the response). k2 and k3 keep a value $\le u$. k1 keeps
    the band $\log a \le k_1 \le \log b$ for the threshold ``"a_b"``: on the ratio that is
    $1/b \le \rho_t \le 1/a$ (``token_k1``), $1/b \le \rho \le 1/a$ (``seq_sum_k1``) and
    $1/b \le \rho_{\mathrm{geo}} \le 1/a$ (``seq_mean_k1``); a single number $h$ means
    ``"1/h_h"``, the band $[1/h, h]$. Several criteria separated by commas are chained: a token
    is kept when every one keeps it. ``rollout_rs_threshold`` gives one threshold for all or
    one per criterion, separated by commas, and must be positive; a k1 band must not be empty
    ($a \le b$; a single $h$ must be $\ge 1$: ``"2.0_0.5"`` is a ``ValueError``, as in verl),
    and an empty entry, a repeated criterion or a number that ``float`` reads only leniently
    (``"2_0"``) is a ``ValueError`` too. This is verl's ``rollout_rs`` /
    ``rollout_rs_threshold`` (config defaults ``null``: off), option by option.

    Returns
    -------
    keep : torch.Tensor
        ``(B, T)`` bool: ``mask`` and every criterion.
    metrics : dict
        verl's names (``compute_rs_metrics``), without the prefix. Per criterion
        ``rollout_rs_<option>_masked_fraction`` (the share of valid tokens it rejects) and
        ``..._seq_masked_fraction`` (of responses with a token, the share in which it rejects
        one), and the statistics of its value $s$ ($k_1$, $k_2$ or $k_3$ per token, or the
        response's sum, mean or max) against its band ($[\log a, \log b]$ for k1, $[0, u]$
        otherwise): ``_mean`` (over the valid tokens), ``_max``, ``_min``, ``_fraction_high``,
        ``_fraction_low`` (over the tokens for ``token_`` criteria, over the responses
        otherwise; ``_fraction_low`` is 0 but for k1), ``_std`` (of $s$ clamped to the band,
        over the tokens), and over the responses' values (a token criterion's mean per
        response) ``_seq_mean``, ``_seq_std`` (with $n - 1$), ``_seq_max``, ``_seq_min``,
        ``_seq_max_deviation`` ($\max |s|$), ``_seq_fraction_high`` and, for k1,
        ``_seq_fraction_low``. Then ``rollout_rs_masked_fraction`` and
        ``rollout_rs_seq_masked_fraction`` for all criteria together; verl divides the last
        by all $B$ rows, here by the responses with a token (the same when none is empty).

    Examples
    --------
    Two responses of two tokens; the ratios of the first are $0.625, 2.5$ and of the second
    $1, 1$. ``token_k1`` at 2 keeps $[0.5, 2]$; ``seq_mean_k3`` at 0.1 rejects a response
    whose mean $k_3$ is above 0.1 (the first: $(0.0950 + 0.5837) / 2 = 0.339$):

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2], [0.5, 0.5]]))
    >>> ones = torch.ones(2, 2)
    >>> keep, m = rejection_mask(trainer, sampler, ones, "token_k1", 2.0)
    >>> keep.tolist(), m["rollout_rs_seq_masked_fraction"]
    ([[True, False], [True, True]], 0.5)
    >>> keep, _ = rejection_mask(trainer, sampler, ones, "token_k1,seq_mean_k3", "0.5_2.0,0.1")
    >>> keep.tolist()
    [[False, False], [True, True]]
    """
    bounds = _parse_rs(rollout_rs, rollout_rs_threshold)
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    return _rejection_mask(trainer_logp, sampler_logp, mask, dtype, bounds)


def _rejection_mask(trainer_logp, sampler_logp, mask, dtype, bounds):
    """[opd_literate.mismatch.correction.rejection_mask][] on checked inputs and parsed bounds."""
    if not bool(mask.any()):  # nothing to reject, and seq_max has no max over a (B, 0) batch
        return mask.clone(), {}
    metrics = {}
    with torch.no_grad():
        x = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype).clamp(-SAFETY_BOUND,
                                                                             SAFETY_BOUND)
        divergences = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.expm1(x) - x}
        keep = mask.clone()
        has_token = mask.any(dim=1)
        for option, (lower, upper) in bounds.items():
            level, kind = option.rsplit("_", 1)
            per_token = select(mask, divergences[kind])
            if level == "token":
                stat = per_token
            elif level == "seq_sum":
                stat = per_token.sum(dim=1, keepdim=True)
            elif level == "seq_mean":
                stat = per_token.sum(dim=1, keepdim=True) / lengths(mask, dtype)[:, None]
            else:  # seq_max: over the response's tokens only (k2, k3 >= 0, so 0 is below all)
                stat = per_token.max(dim=1, keepdim=True).values
            # k1 keeps log a <= k1 <= log b; k2 and k3 keep a value <= u
            low, high = (math.log(lower), math.log(upper)) if kind == "k1" else (None, upper)
            passes = stat <= high if low is None else (stat >= low) & (stat <= high)
            passes = passes.expand_as(mask) & mask
            rejected = mask & ~passes
            metrics.update(_rs_statistics(f"rollout_rs_{option}_", stat.expand_as(mask), mask,
                                          has_token, level == "token", low, high))
            metrics.update(_fractions(f"rollout_rs_{option}_", rejected, mask, has_token))
            keep &= passes
        metrics.update(_fractions("rollout_rs_", mask & ~keep, mask, has_token))
    return keep, metrics


def _rs_statistics(prefix, stat, mask, has_token, token_level, low, high):
    """verl's ``compute_rs_metrics`` for one criterion: its statistic against its band."""
    if not bool(mask.any()):
        return {}
    # one value per response: the criterion's own for the sequence levels, else the mean
    per_response = (select(mask, stat).sum(dim=1) / lengths(mask, stat.dtype))[has_token]
    unit = per_response if not token_level else stat[mask]
    floor = -math.inf if low is None else low
    # a bound beyond the dtype's range cannot bind: clamp at the largest finite value instead
    # (torch refuses a float32 clamp at 1e100)
    largest = torch.finfo(stat.dtype).max
    clamped = stat.clamp(min=0.0 if low is None else min(low, largest), max=min(high, largest))
    mean = masked_mean(clamped, mask)
    spread = masked_mean(clamped.square(), mask) - mean.square()
    metrics = {
        "mean": float(masked_mean(stat, mask)),
        "max": float(unit.max()),
        "min": float(unit.min()),
        "fraction_high": float((unit > high).double().mean()),
        "fraction_low": float((unit < floor).double().mean()),
        "std": float(spread.clamp_min(0.0).sqrt()) if int(mask.sum()) > 1 else 0.0,
        "seq_mean": float(per_response.mean()),
        "seq_std": float(per_response.std()) if per_response.numel() > 1 else 0.0,
        "seq_max": float(per_response.max()),
        "seq_min": float(per_response.min()),
        "seq_max_deviation": float(per_response.abs().max()),
        "seq_fraction_high": float((per_response > high).double().mean()),
    }
    if low is not None:
        metrics["seq_fraction_low"] = float((per_response < low).double().mean())
    return {prefix + name: value for name, value in metrics.items()}


def _fractions(prefix, rejected, mask, has_token):
    if not bool(mask.any()):
        return {}
    tokens = float(rejected.sum()) / float(mask.sum())
    sequences = float(rejected.any(dim=1).sum()) / float(has_token.sum())
    return {f"{prefix}masked_fraction": tokens, f"{prefix}seq_masked_fraction": sequences}


def veto_mask(trainer_logp, sampler_logp, mask, veto_threshold=1e-4):
    r"""The catastrophic-token veto: reject a whole response if any $\rho_t < \tau$.

    verl's former ``rollout_token_veto_threshold`` (see
    [opd_literate.mismatch.estimators.token_veto][]), no longer an option in ``VERL_VERSION``; its
    nearest criteria there are ``seq_max_k2`` and ``seq_max_k3``, which are two-sided. The default
    $\tau = 10^{-4}$ is the value of the former presets. Compared in log space: $\log \rho_t < \log
    \tau$.

    Returns
    -------
    torch.Tensor
        ``(B, T)`` bool: ``mask`` on the responses with no vetoed token, False elsewhere.

    Examples
    --------
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2], [0.5, 0.5]]))   # rho_t = 0.625, 2.5 | 1, 1
    >>> veto_mask(trainer, sampler, torch.ones(2, 2), veto_threshold=0.7).tolist()
    [[False, False], [True, True]]
    """
    threshold = check_finite_number("veto_threshold", veto_threshold, positive=True)
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    return _veto_mask(trainer_logp, sampler_logp, mask, dtype, threshold)


def _veto_mask(trainer_logp, sampler_logp, mask, dtype, threshold):
    """[opd_literate.mismatch.correction.veto_mask][] on checked inputs."""
    with torch.no_grad():
        log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
        vetoed = (mask & (log_rho_t < math.log(threshold))).any(dim=1, keepdim=True)
        return mask & ~vetoed


# ---------------------------------------------------------------------------------------------
# Diagnostics and the one-call entry point
# ---------------------------------------------------------------------------------------------
def offpolicy_metrics(trainer_logp, sampler_logp, mask):
    r"""verl's off-policy diagnostics (``compute_offpolicy_metrics``), without the prefix.

    Over the valid tokens, with $x_t = \log \rho_t$:

    * ``kl``: $\overline{-x_t}$, the k1 estimate of $\mathrm{KL}(\mu \,\|\, \pi)$;
    * ``k3_kl``: $\overline{e^{x_t} - 1 - x_t}$, the k3 estimate of the same KL;
    * ``chi2_token``: $\overline{\rho_t^2} - 1$, an estimate of $\chi^2(\pi_t \,\|\, \mu_t)$
      ($\mathbb{E}_\mu[\rho_t^2] = 1 + \chi^2$);
    * ``chi2_seq``: the mean over responses of $\rho^2$, minus 1, an estimate of the sequence
      $\chi^2$ that drives the variance of sequence IS.

    Per response, with $\bar\ell^\pi_b$ and $\bar\ell^\mu_b$ the mean log-probabilities of its
    tokens under the trainer and the sampler, averaged over the responses:

    * ``training_log_ppl`` $= \overline{-\bar\ell^\pi_b}$ and ``training_ppl``
      $= \overline{e^{-\bar\ell^\pi_b}}$; ``rollout_log_ppl`` and ``rollout_ppl`` the same
      for $\mu$;
    * ``log_ppl_diff`` $= \overline{d_b}$ with $d_b = \bar\ell^\mu_b - \bar\ell^\pi_b
      = -\log \rho_{\mathrm{geo}}$, ``log_ppl_abs_diff`` $= \overline{|d_b|}$,
      ``log_ppl_diff_max``, ``log_ppl_diff_min``, and ``ppl_ratio`` $= \overline{e^{d_b}}$.

    Every exponent is clamped to $\pm 20$ as everywhere here, so no value overflows; verl
    clamps only the $\chi^2$ ones (its ``k3_kl``, perplexities and ``ppl_ratio`` agree with
    these while $|x_t|$, $|\bar\ell_b|$ and $|d_b|$ stay below 20). verl averages the
    per-response metrics over all $B$ rows (a row with no token counts as $\rho = 1$ and a
    perplexity of 1); here over the responses with a token.

    Examples
    --------
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2]]))   # rho_t = 0.625, 2.5
    >>> m = offpolicy_metrics(trainer, sampler, torch.ones(1, 2))
    >>> # (0.625^2 + 2.5^2) / 2 - 1 = 2.3203; 1.5625^2 - 1 = 1.4414; 1 / 0.5 = 2
    >>> round(m["chi2_token"], 4), round(m["chi2_seq"], 4), round(m["training_ppl"], 4)
    (2.3203, 1.4414, 2.0)
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    return _offpolicy_metrics(trainer_logp, sampler_logp, mask, dtype)


def _offpolicy_metrics(trainer_logp, sampler_logp, mask, dtype):
    """[opd_literate.mismatch.correction.offpolicy_metrics][] on checked inputs."""
    if not bool(mask.any()):
        return {}
    with torch.no_grad():
        x = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
        x_safe = x.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        has_token = mask.any(dim=1)
        seq = x.sum(dim=1)[has_token].clamp(-SAFETY_BOUND, SAFETY_BOUND)
        n = lengths(mask, dtype)
        trainer_mean = (select(mask, trainer_logp.detach().to(dtype)).sum(dim=1) / n)[has_token]
        sampler_mean = (select(mask, sampler_logp.detach().to(dtype)).sum(dim=1) / n)[has_token]
        log_ppl_diff = sampler_mean - trainer_mean  # (responses,) -log rho_geo
        metrics = {
            "training_ppl": float(_exp_safe(-trainer_mean).mean()),
            "training_log_ppl": float((-trainer_mean).mean()),
            "kl": float(masked_mean(-x, mask)),
            "k3_kl": float(masked_mean(torch.expm1(x_safe) - x_safe, mask)),
            "rollout_ppl": float(_exp_safe(-sampler_mean).mean()),
            "rollout_log_ppl": float((-sampler_mean).mean()),
            "log_ppl_diff": float(log_ppl_diff.mean()),
            "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
            "log_ppl_diff_max": float(log_ppl_diff.max()),
            "log_ppl_diff_min": float(log_ppl_diff.min()),
            "ppl_ratio": float(_exp_safe(log_ppl_diff).mean()),
            "chi2_token": float(masked_mean(torch.exp(2.0 * x_safe), mask)) - 1.0,
            "chi2_seq": float(torch.exp(2.0 * seq).mean()) - 1.0,
        }
    return metrics


PRESETS = {
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                     rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001"),
    "decoupled_k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                    rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0,
                                      rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "bypass_ppo_clip": dict(bypass_mode=True, loss_type="ppo_clip"),
    "bypass_ppo_clip_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001",
                                   bypass_mode=True, loss_type="ppo_clip"),
    "bypass_ppo_clip_k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01,
                                  bypass_mode=True, loss_type="ppo_clip"),
    "bypass_pg_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True,
                         loss_type="reinforce"),
    "bypass_pg_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0",
                                   bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001",
                             bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                     rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001", bypass_mode=True,
                                     loss_type="reinforce"),
    "bypass_pg_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001", bypass_mode=True,
                                       loss_type="reinforce"),
    "disabled": dict(),
}
"""verl's ``RolloutCorrectionConfig`` presets with their default arguments (the classmethods
of ``verl/trainer/config/algorithm.py``): the fields each sets that differ from
``rollout_is=None``, ``rollout_rs=None``, ``bypass_mode=False``, ``loss_type="ppo_clip"``.
Without ``bypass_mode`` and ``loss_type``, a preset is the keyword arguments of
[opd_literate.mismatch.correction.rollout_correction][]; with ``bypass_mode=True``, in verl's
legacy trainer (``apply_bypass_mode``; see the module docstring for the default one), the loss
is [opd_literate.mismatch.correction.ppo_clip_loss][] over ``keep`` (``loss_type="ppo_clip"``,
whose importance weights verl computes for its metrics only) or
[opd_literate.mismatch.correction.reinforce_loss][] with ``weights`` over ``keep``
(``"reinforce"``)."""


def rollout_correction(trainer_logp, sampler_logp, mask, *, rollout_is=None,
                       rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                       rollout_rs=None, rollout_rs_threshold=None, mode="truncate", lower=None,
                       veto_threshold=None):
    r"""Importance weights, rejection and diagnostics in one call, as verl's helper returns them.

    verl's ``compute_rollout_correction_and_rejection_mask``: the weights of
    [opd_literate.mismatch.correction.importance_weights][] (or 1 on every token when ``rollout_is``
    is None), the ``keep`` mask of [opd_literate.mismatch.correction.rejection_mask][] (the mask
    itself when ``rollout_rs`` is None), further reduced by
    [opd_literate.mismatch.correction.veto_mask][] when ``veto_threshold`` is set, and the metrics
    of all three and of [opd_literate.mismatch.correction.offpolicy_metrics][], each prefixed
    ``rollout_corr/`` as verl logs them. The weights are not multiplied by ``keep``: a token's
    effective weight is ``weights * keep``, and a trainer reduces its loss over ``keep`` (verl
    replaces its ``response_mask`` by it).

    Presets: ``PRESETS`` holds verl's nineteen, e.g. ``decoupled_geo_rs_token_tis`` is
    ``rollout_is="token"`` with ``rollout_rs="seq_mean_k1"`` and
    ``rollout_rs_threshold="0.999_1.001"``, ``decoupled_token_icepop`` is
    ``rollout_is="token"`` with ``rollout_is_threshold="0.5_5.0"``, and ``decoupled_k3_rs``
    is ``rollout_rs="seq_mean_k3"`` at 0.01 without IS.

    Examples
    --------
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2], [0.5, 0.5]]))
    >>> c = rollout_correction(trainer, sampler, torch.ones(2, 2), rollout_is="token",
    ...                        rollout_rs="token_k1", rollout_rs_threshold=2.0)
    >>> (c.weights * c.keep).tolist()
    [[0.625, 0.0], [1.0, 1.0]]
    >>> c.metrics["rollout_corr/rollout_rs_masked_fraction"]
    0.25
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    metrics = {}
    if rollout_is is None:
        if mode != "truncate" or lower is not None or rollout_is_batch_normalize:
            raise ValueError("mode, lower and rollout_is_batch_normalize need rollout_is "
                             "('token', 'sequence' or 'geometric'); it is None")
        # unused without IS, but a NaN or negative threshold is a mistake all the same
        check_finite_number("rollout_is_threshold", rollout_is_threshold, positive=True,
                            allow_inf=True)
        weights = mask.to(dtype)
    else:
        low, high, mode = _check_is_options(rollout_is, rollout_is_threshold, mode, lower,
                                            rollout_is_batch_normalize)
        weights, is_metrics = _importance_weights(trainer_logp, sampler_logp, mask, dtype,
                                                  rollout_is, low, high, mode,
                                                  rollout_is_batch_normalize)
        metrics.update(is_metrics)
    keep = mask
    if rollout_rs is not None:
        bounds = _parse_rs(rollout_rs, rollout_rs_threshold)
        keep, rs_metrics = _rejection_mask(trainer_logp, sampler_logp, mask, dtype, bounds)
        metrics.update(rs_metrics)
    elif rollout_rs_threshold is not None:
        raise ValueError(f"rollout_rs_threshold={rollout_rs_threshold!r} needs rollout_rs")
    if veto_threshold is not None:
        threshold = check_finite_number("veto_threshold", veto_threshold, positive=True)
        keep = keep & _veto_mask(trainer_logp, sampler_logp, mask, dtype, threshold)
    metrics.update(_offpolicy_metrics(trainer_logp, sampler_logp, mask, dtype))
    metrics = {_METRIC_PREFIX + name: value for name, value in metrics.items()}
    return Correction(weights.detach(), keep, metrics)


# ---------------------------------------------------------------------------------------------
# The switches of other frameworks: TRL's vLLM correction and off-policy mask, seq-mask-tis, KPop
# ---------------------------------------------------------------------------------------------
TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL's ``vllm_importance_sampling_mode`` values (TRL 1.16.0, ``GRPOConfig``)."""


def trl_importance_weights(trainer_logp, sampler_logp, mask,
                           vllm_importance_sampling_mode="sequence_mask", *,
                           vllm_importance_sampling_clip_min=None,
                           vllm_importance_sampling_clip_max=3.0):
    r"""TRL's vLLM importance weights: the token or sequence ratio, truncated or masked.

    With $r = \rho_t$ (``token_*``) or $r = \rho = \exp \sum_t \log \rho_t$ on every token of
    the response (``sequence_*``; the sum, not the mean), and the bounds $C_{\min}$,
    $C_{\max}$ (``None``: no bound on that side),

    $$
    w^{\mathrm{truncate}} = \min(\max(r, C_{\min}), C_{\max}), \qquad
    w^{\mathrm{mask}} = r\, \mathbb{1}[C_{\min} \le r \le C_{\max}] .
    $$

    TRL 1.16.0's ``GRPOTrainer._generate_and_score_completions``
    (``trl/trainer/grpo_trainer.py`` lines 2660-2707) computes these from the trainer's
    recomputed log-probabilities (``old_per_token_logps``) and vLLM's
    (``sampling_per_token_logps``), and ``_compute_loss`` multiplies the per-token loss by them
    (line 3147), before the KL term is added. The defaults are TRL's: ``"sequence_mask"``
    (``GRPOConfig``'s field, ``trl/trainer/grpo_config.py`` line 935, and its docstring line
    327; the docstring's list of modes, line 331, still calls ``token_truncate`` the default),
    $C_{\min}$ ``None`` and $C_{\max} = 3$; ``vllm_importance_sampling_cap`` is TRL's
    deprecated name of $C_{\max}$. As TRL's ``GRPOConfig`` does, a truncation needs one bound
    at least, and $C_{\min} < C_{\max}$. On the toy these are the weights of
    [opd_literate.mismatch.estimators.trl_token_truncate][] and its three siblings.

    Differences from TRL, by this module's conventions: the log-ratio is clamped to
    $[-20, 20]$ before the exponential (TRL's is not, so its sequence ratio can overflow to
    ``inf``: masked, or truncated to $C_{\max}$, as here, unless $C_{\max}$ is ``None``); a
    NaN log-probability where ``mask`` is 1 is an error (TRL counts a NaN sampler
    log-probability as a log-ratio of 0).

    Returns
    -------
    weights : torch.Tensor
        ``(B, T)``, detached, 0 where ``mask`` is 0 (float32 for half-precision inputs).
    metrics : dict
        TRL's names, as it logs them: ``sampling/sampling_logp_difference/mean`` and ``/max``
        of $|\log \pi(y_t) - \log \mu(y_t)|$ over the valid tokens, and
        ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max`` of the weights $w$:
        over the valid tokens for ``token_*``, over the responses with a token for
        ``sequence_*`` (TRL counts every row, and a row with no token has the ratio 1).

    Examples
    --------
    The ratios $0.625$ and $2.5$, their product $1.5625$; a second response has $\rho_t =
    2.5, 2.5$ and $\rho = 6.25$, above TRL's cap 3:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2], [0.2, 0.2]]))
    >>> ones = torch.ones(2, 2)
    >>> w, m = trl_importance_weights(trainer, sampler, ones)  # sequence_mask, C_max = 3
    >>> [[round(v, 6) for v in row] for row in w.tolist()]
    [[1.5625, 1.5625], [0.0, 0.0]]
    >>> round(m["sampling/importance_sampling_ratio/max"], 6)
    1.5625
    >>> w, _ = trl_importance_weights(trainer, sampler, ones, "token_truncate",
    ...                               vllm_importance_sampling_clip_max=2.0)
    >>> [[round(v, 6) for v in row] for row in w.tolist()]
    [[0.625, 2.0], [2.0, 2.0]]
    """
    level, constraint, low, high = _check_trl_options(vllm_importance_sampling_mode,
                                                      vllm_importance_sampling_clip_min,
                                                      vllm_importance_sampling_clip_max)
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    _check_threshold_fits(high, dtype)
    with torch.no_grad():  # TRL computes the weights under no_grad, from detached log-probs
        log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
        ratio = select(mask, _exp_safe(_level_log_ratio(log_rho_t, mask, level)))  # (B, T)
        if constraint == "truncate":
            weights = torch.clamp(ratio, min=low, max=high)
        else:  # TRL zeroes r < C_min or r > C_max: a ratio on a bound is kept
            weights = torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)
        weights = select(mask, weights)
        metrics = {}
        if bool(mask.any()):
            difference = log_rho_t.abs()[mask]
            metrics["sampling/sampling_logp_difference/mean"] = float(difference.mean())
            metrics["sampling/sampling_logp_difference/max"] = float(difference.max())
            if level == "token":
                applied = weights[mask]
            else:  # one weight per response with a token: its first token holds it
                has_token = mask.any(dim=1)
                first = mask.to(torch.int8).argmax(dim=1)
                applied = weights.gather(1, first[:, None])[:, 0][has_token]
            name = "sampling/importance_sampling_ratio/"
            metrics[name + "min"] = float(applied.min())
            metrics[name + "mean"] = float(applied.mean())
            metrics[name + "max"] = float(applied.max())
    return weights, metrics


def _check_trl_options(mode, clip_min, clip_max):
    """TRL's checks of the mode and the bounds; return (level, constraint, low, high)."""
    if mode not in TRL_IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {TRL_IS_MODES}, got "
                         f"{mode!r}")
    level, constraint = mode.split("_")
    if constraint == "truncate" and clip_min is None and clip_max is None:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} needs "
                         "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max "
                         "(both are None), as TRL's GRPOConfig requires")
    low = 0.0 if clip_min is None else check_finite_number(
        "vllm_importance_sampling_clip_min", clip_min, low=0.0)
    high = math.inf if clip_max is None else check_finite_number(
        "vllm_importance_sampling_clip_max", clip_max, positive=True, allow_inf=True)
    if clip_min is not None and clip_max is not None and not low < high:
        raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min!r}) must be less than "
                         f"vllm_importance_sampling_clip_max ({clip_max!r}), as in TRL's "
                         "GRPOConfig")
    return level, constraint, low, high


def off_policy_sequence_mask(trainer_logp, sampler_logp, advantages, mask,
                             off_policy_mask_threshold):
    r"""TRL's off-policy sequence mask (DeepSeek-V3.2): drop the responses with $A < 0$ that are
    far from the sampler.

    $$
    \bar k_{1,b} = \frac{1}{n_b} \sum_t \big(\log \mu(y_t) - \log \pi_\theta(y_t)\big), \qquad
    \mathrm{keep}_{b,t} = \mathbb{1}\big[A_{b,t} \ge 0 \text{ or } \bar k_{1,b} \le \delta\big] .
    $$

    TRL 1.16.0's ``GRPOTrainer.get_off_policy_mask`` (``trl/trainer/grpo_trainer.py`` lines
    2945-2968) with $\delta$ = ``off_policy_mask_threshold`` (``GRPOConfig``'s default ``None``
    turns it off; its help suggests 0.5). ``_compute_loss`` multiplies the per-token loss by it
    (line 3141), as well as by the vLLM importance weight
    ([opd_literate.mismatch.correction.trl_importance_weights][]), with $\pi_\theta$ the
    current policy (detached) and $\mu$ vLLM's log-probabilities. A response with $A = 0$ is
    kept. With per-token advantages the sign is read per token, as TRL's broadcast does. On
    the toy this is [opd_literate.mismatch.estimators.off_policy_mask][].

    Parameters
    ----------
    trainer_logp, sampler_logp : torch.Tensor
        ``(B, T)``; finite where ``mask`` is 1.
    advantages : torch.Tensor
        ``(B, T)`` or ``(B,)``.
    mask : torch.Tensor
        ``(B, T)`` in {0, 1}.
    off_policy_mask_threshold : float
        $\delta$, finite.

    Returns
    -------
    torch.Tensor
        ``(B, T)`` bool: ``mask`` less the dropped responses (TRL returns the ``(B, 1)`` float).

    Examples
    --------
    $\pi = 0.5$ where $\mu = 0.8$ on the first response ($\bar k_1 = \log 1.6 = 0.470$) and
    $\mu = 0.5$ on the second ($\bar k_1 = 0$); both have $A < 0$, and $\delta = 0.4$ drops the
    first. With $A \ge 0$ nothing is dropped:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.8], [0.5, 0.5]]))
    >>> off_policy_sequence_mask(trainer, sampler, torch.tensor([-1.0, -1.0]), torch.ones(2, 2),
    ...                          0.4).tolist()
    [[False, False], [True, True]]
    >>> off_policy_sequence_mask(trainer, sampler, torch.tensor([0.0, 1.0]), torch.ones(2, 2),
    ...                          0.4).tolist()
    [[True, True], [True, True]]
    """
    threshold = check_finite_number("off_policy_mask_threshold", off_policy_mask_threshold)
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    A = _check_advantages(advantages, mask, dtype)
    with torch.no_grad():
        k1 = -_token_log_ratio(trainer_logp, sampler_logp, mask, dtype)  # log mu - log pi
        mean_k1 = k1.sum(dim=1, keepdim=True) / lengths(mask, dtype)[:, None]  # (B, 1)
        return mask & ((A >= 0) | (mean_k1 <= threshold))


def seq_mask_tis_weights(trainer_logp, sampler_logp, mask, *, low=0.999, high=1.002):
    r"""seq-mask-tis (OpenRLHF, NeMo-RL): the raw token ratio, in the responses whose geometric
    ratio lies in $[l, h]$.

    $$
    w_t = \rho_t\, \mathbb{1}\big[l \le \rho_{\mathrm{geo}} \le h\big], \qquad
    \rho_{\mathrm{geo}} = \exp\Big(\frac{1}{n_b} \sum_t \log \rho_t\Big) .
    $$

    NeMo-RL's ``truncated_importance_sampling_type: seq-mask-tis``
    (``nemo_rl/algorithms/loss/loss_functions.py`` at commit ``7ea279a``:
    ``truncated_importance_sampling_ratio_min`` $= l$ and ``truncated_importance_sampling_ratio``
    $= h$, the band $[0.999, 1.002]$ of its comment the defaults here) and OpenRLHF's
    ``--algo.advantage.is_correction_type seq-mask-tis`` (``openrlhf/models/loss.py`` at
    commit ``3c3be62``, the band ``--algo.advantage.is_correction_threshold``, default
    ``0.5 5.0``). Neither truncates the token ratio. The same weights as
    [opd_literate.mismatch.correction.rollout_correction][] with ``rollout_is="token"``,
    ``rollout_is_threshold=inf``, ``rollout_rs="seq_mean_k1"`` at ``f"{1 / h}_{1 / l}"``.
    On the toy these are the weights of [opd_literate.mismatch.estimators.seq_mask_tis][].

    Returns
    -------
    weights : torch.Tensor
        ``(B, T)``, detached, 0 where ``mask`` is 0 or the response is masked.
    metrics : dict
        ``is_oob_ratio``, NeMo-RL's name: the share of the responses with a token whose
        $\rho_{\mathrm{geo}}$ is outside $[l, h]$.

    Examples
    --------
    The geometric ratios $1.25$ and $2.5$; the band $[0.8, 1.3]$ keeps the first, whose
    weights are its raw token ratios:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2], [0.2, 0.2]]))
    >>> w, m = seq_mask_tis_weights(trainer, sampler, torch.ones(2, 2), low=0.8, high=1.3)
    >>> [[round(v, 6) for v in row] for row in w.tolist()], m["is_oob_ratio"]
    ([[0.625, 2.5], [0.0, 0.0]], 0.5)
    """
    low, high = check_band(low, high)
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    with torch.no_grad():
        log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
        log_geo = _level_log_ratio(log_rho_t, mask, "geometric")  # (B, T), the mean on each
        # compared in log space: log l <= mean log rho_t <= log h (log 0 = -inf keeps all)
        log_low = math.log(low) if low > 0 else -math.inf
        log_high = math.log(high) if high > 0 else -math.inf
        kept = mask & (log_geo >= log_low) & (log_geo <= log_high)
        weights = torch.where(kept, _exp_safe(log_rho_t), 0.0)
        has_token = mask.any(dim=1)
        metrics = {}
        if bool(has_token.any()):
            outside = has_token & ~kept.any(dim=1)
            metrics["is_oob_ratio"] = float(outside.sum()) / float(has_token.sum())
    return weights, metrics


def kpop_mask(trainer_logp, sampler_logp, mask, kpop_threshold=0.1, *, eps=1e-6):
    r"""KPop: keep a token when both binary KLs between $\pi_\theta(y_t)$ and $\mu(y_t)$ are
    at most $\phi$.

    With $p = \pi_\theta(y_t)$ and $q = \mu(y_t)$ clamped to $[\epsilon, 1 - \epsilon]$ and
    $\mathrm{kl}(p, q) = p \log \frac{p}{q} + (1 - p) \log \frac{1 - p}{1 - q}$,

    $$
    \mathrm{keep}_t = \mathbb{1}\big[\max(\mathrm{kl}(p, q), \mathrm{kl}(q, p)) \le \phi\big] .
    $$

    prime-rl's ``kpop`` loss type (``src/prime_rl/trainer/rl/loss.py``, ``kpop_loss_fn``, at
    commit ``b9ba060`` on its branch ``feat/algo-ablations``; $\phi$ = ``kpop_threshold``,
    default 0.1, $\epsilon = 10^{-6}$), whose loss is $-\mathrm{keep}_t\, A\, \rho_t$ (the
    ratio not detached, so its gradient is $\mathrm{keep}_t \rho_t A \nabla \log \pi_\theta$)
    plus ``kl_tau`` $(\log \rho_t)^2$; AReaL's ``rejection_sampling.metric: binary_kl``
    (``areal/utils/functional/functional.py`` at commit ``cbff54d``, $\epsilon = 10^{-8}$,
    $\phi$ = ``upper``). The importance weight of the kept tokens is the raw $\rho_t$
    ([opd_literate.mismatch.correction.importance_weights][] with ``rollout_is_threshold=inf``);
    on the toy, that weight times ``keep`` is [opd_literate.mismatch.estimators.kpop][]. A
    log-probability above 0 where ``mask`` is 1 is a ``ValueError``: $p$ is a probability.

    Returns
    -------
    keep : torch.Tensor
        ``(B, T)`` bool: ``mask`` less the masked tokens.
    metrics : dict
        prime-rl's names: ``is_masked`` (the share of valid tokens masked),
        ``masked_mismatch_kl`` and ``unmasked_mismatch_kl`` (the mean of
        $\rho_t - 1 - \log \rho_t$ over the masked and over the kept tokens; 0 over none).

    Examples
    --------
    $\pi = 0.04$ where $\mu = 0.02$ (ratio 2, $\mathrm{kl} = 0.008$ and $0.006$): kept;
    $\pi = 0.5$ where $\mu = 0.8$ (ratio 0.625, $\mathrm{kl}(p, q) = 0.223$): masked:

    >>> trainer = torch.log(torch.tensor([[0.04, 0.5]]))
    >>> sampler = torch.log(torch.tensor([[0.02, 0.8]]))
    >>> keep, m = kpop_mask(trainer, sampler, torch.ones(1, 2))
    >>> keep.tolist(), m["is_masked"]
    ([[True, False]], 0.5)
    """
    threshold = check_finite_number("kpop_threshold", kpop_threshold, low=0.0, allow_inf=True)
    eps = check_finite_number("eps", eps, positive=True)
    if not eps < 0.5:
        raise ValueError(f"eps must be < 0.5 (the clamp [eps, 1 - eps] must be an interval "
                         f"holding more than 0.5), got {eps!r}")
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    _check_log_probabilities(mask, "kpop", trainer_logp=trainer_logp, sampler_logp=sampler_logp)
    with torch.no_grad():
        zeros = torch.zeros((), dtype=dtype, device=trainer_logp.device)
        log_p = torch.where(mask, trainer_logp.detach().to(dtype), zeros)  # 1 on the padding
        log_q = torch.where(mask, sampler_logp.detach().to(dtype), zeros)
        # the clamp keeps log p and log(1 - p) finite; 1 - eps rounds in float32 (1 - 1e-6)
        p = torch.exp(log_p).clamp(eps, 1.0 - eps)
        q = torch.exp(log_q).clamp(eps, 1.0 - eps)
        divergence = torch.maximum(_bernoulli_kl(p, q), _bernoulli_kl(q, p))
        keep = mask & (divergence <= threshold)
        metrics = {}
        if bool(mask.any()):
            x = (log_p - log_q).clamp(-SAFETY_BOUND, SAFETY_BOUND)
            k3 = torch.expm1(x) - x  # rho - 1 - log rho, prime-rl's mismatch_kl
            masked = mask & ~keep
            metrics["is_masked"] = float(masked.sum()) / float(mask.sum())
            metrics["masked_mismatch_kl"] = (float(k3[masked].mean()) if bool(masked.any())
                                             else 0.0)
            metrics["unmasked_mismatch_kl"] = (float(k3[keep].mean()) if bool(keep.any())
                                               else 0.0)
    return keep, metrics


def _bernoulli_kl(p, q):
    """kl(p, q) of Bernoulli(p) and Bernoulli(q), elementwise, for p, q in (0, 1)."""
    return p * torch.log(p / q) + (1.0 - p) * torch.log((1.0 - p) / (1.0 - q))


# ---------------------------------------------------------------------------------------------
# Bypass-mode losses
# ---------------------------------------------------------------------------------------------
def _check_advantages(advantages, mask, dtype):
    check_float_tensor("advantages", advantages, None)
    B, T = mask.shape
    if tuple(advantages.shape) == (B,):
        advantages = advantages[:, None].expand(B, T)  # one advantage per response, documented
    elif tuple(advantages.shape) != (B, T):
        raise ValueError(f"advantages must have shape (B, T) = {(B, T)} or (B,) = {(B,)}, got "
                         f"{tuple(advantages.shape)}")
    bad = mask & ~torch.isfinite(advantages.detach())
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"advantages must be finite where mask is 1, got "
                         f"{advantages[b, t].item()!r} at position ({b}, {t})")
    zeros = torch.zeros((), dtype=dtype, device=advantages.device)
    return torch.where(mask, advantages.detach().to(dtype), zeros)


def _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high):
    clip_ratio = check_finite_number("clip_ratio", clip_ratio, low=0.0)
    low = clip_ratio if clip_ratio_low is None else check_finite_number(
        "clip_ratio_low", clip_ratio_low, low=0.0)
    high = clip_ratio if clip_ratio_high is None else check_finite_number(
        "clip_ratio_high", clip_ratio_high, low=0.0)
    # A ratio lies in [e^-20, e^20]: a floor 1 - low below 0 or a cap 1 + high above e^21 never
    # binds, so both are cut there, where every compute dtype holds them (1 + 1e39 overflows
    # float32, and torch.clamp refuses it).
    return min(low, 1.0), min(high, math.exp(SAFETY_BOUND + 1.0))


def ppo_clip_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
                  clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                  reduction="token-mean"):
    r"""PPO's clipped loss with the dual clip, the sampler as the anchor (verl's bypass mode).

    With $r_t = \exp(\mathrm{clamp}(\log \rho_t, -20, 20))$ and the clip range
    $[1 - \varepsilon_l, 1 + \varepsilon_h]$,

    $$
    L_t = \max\big(-A r_t,\ -A\, \mathrm{clip}(r_t, 1 - \varepsilon_l, 1 + \varepsilon_h)\big),
    \qquad
    L_t \leftarrow \min(L_t, -c A) \ \text{ where } A < 0,
    $$

    reduced by ``reduction``. Its gradient with respect to $\log \pi_\theta(y_t)$ is
    $-A r_t$ where the unclipped term is active and 0 where a clipped constant is: the weight
    $w_t = r_t$ of [opd_literate.mismatch.estimators.ppo_clip_bypass][], zeroed where $A > 0,\ r_t >
    1 + \varepsilon_h$, where $A < 0,\ r_t < 1 - \varepsilon_l$ and where $A < 0,\ r_t > c$.

    verl: ``bypass_mode: true`` with ``loss_type: ppo_clip`` calls
    ``compute_policy_loss_vanilla`` with ``old_log_prob = rollout_log_prob``. Its options are the
    actor's ``clip_ratio`` (0.2), ``clip_ratio_low`` / ``clip_ratio_high`` (0.2 each in
    ``ActorConfig``; None here means ``clip_ratio``) and ``clip_ratio_c`` (3.0, must be
    $> 1$), and ``loss_agg_mode`` (``reduction``, default ``"token-mean"``).

    Returns
    -------
    loss : torch.Tensor
        A scalar.
    metrics : dict
        verl's ``actor/pg_clipfrac`` (share of valid tokens where the clipped term is the
        larger), ``actor/ppo_kl`` (mean $-\log \rho_t$) and ``actor/pg_clipfrac_lower`` (share
        where the dual clip is active).

    Examples
    --------
    One token, $\rho = 2.5$, $A = -1$: PPO's clip leaves $-A r = 2.5$, the dual clip $c = 2$
    caps it at $-cA = 2$, a constant (no gradient):

    >>> trainer = torch.log(torch.tensor([[0.5]])).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.2]]))
    >>> loss, m = ppo_clip_loss(trainer, sampler, torch.tensor([-1.0]), torch.ones(1, 1),
    ...                         clip_ratio_c=2.0)
    >>> loss.backward()
    >>> round(loss.item(), 6), trainer.grad.item(), m["actor/pg_clipfrac_lower"]
    (2.0, 0.0, 1.0)
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    eps_low, eps_high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    clip_ratio_c = check_finite_number("clip_ratio_c", clip_ratio_c, allow_inf=True)
    if not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be > 1 (verl asserts it), got {clip_ratio_c!r}")
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    # r_t = pi_theta(y_t) / mu(y_t), from a clamped log-ratio
    ratio = _exp_safe(log_rho_t)
    unclipped = -A * ratio
    clipped = -A * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    # dual clip: for A < 0, min(L, -c A)
    dual = -A * clip_ratio_c if math.isfinite(clip_ratio_c) else torch.full_like(A, math.inf)
    dual_active = (A < 0) & (per_token > dual)
    per_token = torch.where(A < 0, torch.minimum(per_token, dual), per_token)
    loss = aggregate(select(mask, per_token), mask, reduction)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": float(masked_mean((clipped > unclipped).to(dtype), mask)),
            "actor/ppo_kl": float(masked_mean(-log_rho_t, mask)),
            "actor/pg_clipfrac_lower": float(masked_mean(dual_active.to(dtype), mask)),
        }
    return loss, metrics


def cispo_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
               clip_ratio_low=None, clip_ratio_high=None, reduction="token-mean"):
    r"""CISPO: a clipped, stop-gradient ratio times the log-likelihood; no token loses its gradient.

    $$
    \begin{aligned}
    L_t &= -\,\mathrm{sg}\big(\mathrm{clip}(r_t, 1 - \varepsilon_l, 1 + \varepsilon_h)\big)\,
    A\, \log \pi_\theta(y_t), \\
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} &= -\,\mathrm{clip}(r_t, 1 - \varepsilon_l,
    1 + \varepsilon_h)\, A .
    \end{aligned}
    $$

    The weight of [opd_literate.mismatch.estimators.cispo][] (whose defaults are the paper's
    $\varepsilon_l = 1$, i.e. no floor, and this project's $\varepsilon_h = 4$). This is
    verl's ``compute_policy_loss_cispo`` (``loss_mode: cispo``) called with
    ``old_log_prob = sampler_logp``: it reads the actor's ``clip_ratio_low`` and
    ``clip_ratio_high`` (0.2 each in ``ActorConfig``, the defaults here) and the same clamped
    ratio. In decoupled mode CISPO's anchor is the recomputed ``old_log_prob``; with
    ``bypass_mode: true`` verl 0.9.1's default trainer makes this call (it only substitutes
    the anchor), and its legacy trainer cannot (``apply_bypass_mode`` sets
    ``loss_mode = "bypass_mode"``, whose loss is PPO's clip or REINFORCE,
    ``compute_policy_loss_bypass_mode``): see the module docstring.

    Returns
    -------
    loss : torch.Tensor
    metrics : dict
        ``actor/pg_clipfrac`` (share of valid tokens whose ratio was clipped),
        ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` (0, as verl logs it).

    Examples
    --------
    $\rho = 9$ is clipped to $1.2$; the gradient is $-1.2 A$:

    >>> trainer = torch.log(torch.tensor([[0.9]])).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.1]]))
    >>> loss, _ = cispo_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 1))
    >>> loss.backward()
    >>> round(trainer.grad.item(), 6)
    -1.2
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    eps_low, eps_high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    with torch.no_grad():
        ratio = _exp_safe(log_rho_t)
        weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # sg(clip(r_t))
    trainer = select(mask, trainer_logp.to(dtype))
    per_token = -weight * A * trainer
    loss = aggregate(select(mask, per_token), mask, reduction)
    metrics = {
        "actor/pg_clipfrac": float(masked_mean((weight != ratio).to(dtype), mask)),
        "actor/ppo_kl": float(masked_mean(-log_rho_t.detach(), mask)),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


def gspo_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio_low=3e-4,
              clip_ratio_high=4e-4, reduction="seq-mean-token-mean"):
    r"""GSPO: the geometric sequence ratio on every token, PPO-clipped, sampler as the anchor.

    With $s = \rho_{\mathrm{geo}}$ of the response, verl's token-level form
    $s_t = \mathrm{sg}(s)\, \pi_\theta(y_t) / \mathrm{sg}(\pi_\theta(y_t))$ (the value $s$, the
    gradient $s \nabla \log \pi_\theta(y_t)$):

    $$
    L_t = \max\big(-A s_t,\ -A\, \mathrm{clip}(s_t, 1 - \varepsilon_l, 1 + \varepsilon_h)\big),
    \qquad
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} = -A s \ \text{ unless clipped}.
    $$

    With ``reduction="sum"`` the gradient of each token is the weight of
    [opd_literate.mismatch.estimators.gspo][] times $-A$; the default here,
    ``"seq-mean-token-mean"``, divides each response's gradient by its length, as the GSPO
    objective does. verl 0.9.1 reduces GSPO by the actor's ``loss_agg_mode`` (default
    ``"token-mean"``); until then (verl-project/verl up to ``VERL_COMMIT`` at least, e.g. at
    b178a3c) it used ``"seq-mean-token-mean"`` whatever ``loss_agg_mode`` said. No dual clip.
    Defaults: the GSPO paper's $\varepsilon_l = 3 \cdot 10^{-4}$, $\varepsilon_h = 4 \cdot
    10^{-4}$; verl (``loss_mode: gspo``, ``compute_policy_loss_gspo``) reads the actor's
    ``clip_ratio_low`` / ``clip_ratio_high``, whose defaults (0.2) must be set to these. verl
    clamps $\log s_t$ at 10 from above only; here at $\pm 20$ like every ratio. A bound given
    as ``None`` is 0 here (that edge of the band at 1), where verl reads ``None`` as the actor's
    ``clip_ratio``. As for
    [opd_literate.mismatch.correction.cispo_loss][], the sampler is GSPO's anchor in verl
    with ``bypass_mode: true`` in the default trainer, not in the legacy one.

    Examples
    --------
    One response of two tokens with $\rho_t = 0.625, 2.5$: $s = 1.25$, above $1 + 4 \cdot
    10^{-4}$, so with $A > 0$ both tokens are clipped; with $A < 0$ both get the gradient
    $-A s / 2$ (the mean over the two tokens):

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2]]))
    >>> loss, _ = gspo_loss(trainer, sampler, torch.tensor([-1.0]), torch.ones(1, 2))
    >>> loss.backward()
    >>> [round(g, 6) for g in trainer.grad[0].tolist()]
    [0.625, 0.625]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    eps_low, eps_high = _clip_range(0.0, clip_ratio_low, clip_ratio_high)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    log_s = _level_log_ratio(log_rho_t, mask, "geometric").detach()  # sg(log s), (B, T)
    trainer = select(mask, trainer_logp.to(dtype))
    # log s_t = sg(log s) + log pi(y_t) - sg(log pi(y_t)): the value of s, the gradient of pi
    seq_ratio = _exp_safe(log_s + trainer - trainer.detach())
    unclipped = -A * seq_ratio
    clipped = -A * torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(select(mask, per_token), mask, reduction)
    metrics = {
        "actor/pg_clipfrac": float(masked_mean((clipped > unclipped).to(dtype), mask)),
        "actor/ppo_kl": float(masked_mean(-log_rho_t.detach(), mask)),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


def reinforce_loss(trainer_logp, advantages, mask, weights=None, *, reduction="token-mean"):
    r"""REINFORCE with explicit importance weights: $L_t = -\,\mathrm{sg}(w_t)\, A\, \log
    \pi_\theta(y_t)$.

    Its gradient with respect to $\log \pi_\theta(y_t)$ is $-w_t A$: with the ``weights`` of
    [opd_literate.mismatch.correction.rollout_correction][] and ``mask = keep`` it is the estimate
    $w_t A s_t$ of [opd_literate.mismatch.estimators][]. verl's bypass-mode loss with
    ``loss_type: reinforce`` (``compute_policy_loss_reinforce``; the actor's ``loss_agg_mode``,
    default ``"token-mean"``). ``weights=None`` is $w_t = 1$.

    Examples
    --------
    >>> logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    >>> loss = reinforce_loss(logp, torch.tensor([2.0]), torch.ones(1, 2),
    ...                       weights=torch.tensor([[1.0, 0.5]]), reduction="sum")
    >>> loss.backward()
    >>> logp.grad.tolist()
    [[-2.0, -1.0]]
    """
    check_float_tensor("trainer_logp", trainer_logp, 2)
    if weights is None:
        weights = torch.ones_like(trainer_logp.detach())
    check_float_tensor("weights", weights, 2)
    mask, dtype = _check_batch(trainer_logp, trainer_logp.detach(), mask)
    check_same_shape("trainer_logp", trainer_logp, "weights", weights)
    bad = mask & ~torch.isfinite(weights.detach())
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"weights must be finite where mask is 1, got {weights[b, t].item()!r} "
                         f"at position ({b}, {t})")
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    w = select(mask, weights.detach().to(dtype))
    per_token = -w * A * select(mask, trainer_logp.to(dtype))
    return aggregate(select(mask, per_token), mask, reduction)


# ---------------------------------------------------------------------------------------------
# Trust regions on the probabilities (DPPO) and a quadratic pull to the anchor (DRO)
# ---------------------------------------------------------------------------------------------
def _check_dppo_options(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    r"""The thresholds $\delta_l, \delta_h \ge 0$ and the cap $c > 0$ of DPPO (``inf``: none).

    verl reads them from PPO's options: ``clip_ratio_low`` / ``clip_ratio_high`` (None means
    ``clip_ratio``) are the divergence thresholds, ``clip_ratio_c`` the truncation of the ratio.
    """
    clip_ratio = check_finite_number("clip_ratio", clip_ratio, low=0.0, allow_inf=True)
    low, high = (clip_ratio if value is None else
                 check_finite_number(name, value, low=0.0, allow_inf=True)
                 for name, value in (("clip_ratio_low", clip_ratio_low),
                                     ("clip_ratio_high", clip_ratio_high)))
    cap = check_finite_number("clip_ratio_c", clip_ratio_c, positive=True, allow_inf=True)
    # A ratio lies in [e^-20, e^20]: a cap above e^21 never binds, and torch.clamp refuses a
    # bound its dtype cannot hold (1e39 in float32).
    return low, high, min(cap, math.exp(SAFETY_BOUND + 1.0))


_LOG_PROBABILITY_USE = {
    "kpop": "KPop's binary KL reads p = exp(log p) as a probability",
    "tv": "DPPO-TV reads p = exp(log p) as a probability",
    "kl": "DPPO-KL's binary KL needs 1 - p >= 0",
    "dro": "DRO's value is the log-likelihood of the sampled token",
}


def _check_log_probabilities(mask, use, **log_probs):
    """Refuse a log-probability above 0 where mask is 1 (``use``: why the loss needs one).

    Off the mask anything goes (it is selected away); NaN was refused by ``_check_batch``."""
    for name, logp in log_probs.items():
        bad = mask & (logp.detach() > 0)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} must be <= 0 where mask is 1 (a log-probability: "
                f"{_LOG_PROBABILITY_USE[use]}), got {logp[b, t].item()!r} at position ({b}, {t})")


def _binary_kl(log_q, log_p):
    r"""verl's $q \log \frac{q}{p} + (1 - q) \log \frac{1 - q + 10^{-8}}{1 - p + 10^{-8}}$,
    elementwise, for log-probabilities $\le 0$; $1 - p$ as $-\mathrm{expm1}(\log p)$, exact
    near $p = 1$ where $1 - e^{\log p}$ loses its digits."""
    q = torch.exp(log_q)
    not_q, not_p = -torch.expm1(log_q), -torch.expm1(log_p)  # 1 - q, 1 - p
    return q * (log_q - log_p) + not_q * torch.log((not_q + BINARY_KL_EPS)
                                                   / (not_p + BINARY_KL_EPS))


def _dppo_loss(trainer_logp, sampler_logp, A, mask, dtype, low, high, cap, reduction,
               divergence):
    """DPPO's loss and verl's metrics on checked inputs (``divergence`` "tv" or "kl")."""
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    trainer = select(mask, trainer_logp.to(dtype))  # log pi(y_t), with its gradient
    with torch.no_grad():  # the trust region and the weight are constants of the update
        sampler = select(mask, sampler_logp.detach().to(dtype))
        log_p = trainer.detach()
        p, q = torch.exp(log_p), torch.exp(sampler)  # pi(y_t), mu(y_t); 1 on the padding
        if divergence == "tv":
            # |p - q| is the TV between "y_t or not" under pi and under mu; one side per sign
            inside_up, inside_down = p - q <= high, p - q >= -low
        else:
            kl = _binary_kl(sampler, log_p)
            # the KL bounds a move in the advantage's direction only
            inside_up, inside_down = (kl <= high) | (p <= q), (kl <= low) | (p >= q)
        inside = torch.where(A > 0, inside_up, inside_down)  # A = 0 takes verl's A <= 0 side
        ratio = _exp_safe(log_rho_t)
        weight = torch.clamp(ratio, max=cap)  # sg(min(r_t, c)), verl's truncated IS
    # L_t = -sg(min(r_t, c)) A log pi(y_t) inside the trust region, 0 outside
    per_token = torch.where(inside, -weight * A * trainer, torch.zeros_like(trainer))
    loss = aggregate(select(mask, per_token), mask, reduction)
    metrics = {
        "actor/pg_clipfrac": float(masked_mean((~inside).to(dtype), mask)),
        "actor/ppo_kl": float(masked_mean(-log_rho_t.detach(), mask)),
        "actor/pg_clipfrac_lower": float(masked_mean((inside & (ratio > cap)).to(dtype), mask)),
    }
    return loss, metrics


def dppo_tv_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
                 clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                 reduction="token-mean"):
    r"""DPPO-Binary-TV: truncated IS inside a trust region on $\pi_\theta(y_t) - \mu(y_t)$.

    PPO's clip bounds the *ratio* $r_t$, which over-constrains rare tokens (a probability that
    moves from 0.01 to 0.02 doubles its ratio) and under-constrains frequent ones. DPPO
    (Qi et al., *Rethinking the Trust Region in LLM Reinforcement Learning*, 2026) bounds a
    divergence instead; this variant the probability difference. With $p_t = \pi_\theta(y_t)$,
    $q_t = \mu(y_t)$, $r_t = \exp(\mathrm{clamp}(\log \rho_t, -20, 20))$, the thresholds
    $\delta_l, \delta_h$ and the cap $c$:

    $$
    \begin{aligned}
    L_t &= -\,\mathrm{sg}\big(\min(r_t, c)\big)\, m_t\, A\, \log \pi_\theta(y_t), \qquad
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} = -\min(r_t, c)\, m_t\, A, \\
    m_t &= \mathbb{1}[A > 0]\, \mathbb{1}[p_t - q_t \le \delta_h]
    + \mathbb{1}[A \le 0]\, \mathbb{1}[p_t - q_t \ge -\delta_l] .
    \end{aligned}
    $$

    $|p_t - q_t|$ is the total variation between the two distributions of "the token $y_t$ or
    another" under $\pi_\theta$ and $\mu$, which the full-vocabulary TV bounds from above:
    merging the other tokens into one outcome never increases a TV,
    $|p_t - q_t| \le \frac12 \sum_v |\pi_\theta(v \mid s_t) - \mu(v \mid s_t)|$. The
    region is one-sided, like PPO's clip: a token leaves it only once its probability has
    moved by more than $\delta$ in the direction its advantage pushes it. The gradient is the
    weight $w_t = \min(r_t, c)\, m_t$ of [opd_literate.mismatch.estimators.dppo_tv][] times
    $-A$. No dual clip.

    verl: ``loss_mode: dppo_tv`` (``compute_policy_loss_dppo_tv``, since commit ``182383b``,
    PR #5397, February 2026; in ``VERL_VERSION``). It reads the actor's ``clip_ratio``,
    ``clip_ratio_low`` and ``clip_ratio_high`` as $\delta$ (0.2 each in ``ActorConfig``: the
    defaults here), ``clip_ratio_c`` as $c$ and ``loss_agg_mode`` (``reduction``). Its code
    falls back to $c = 20$ only for a config without ``clip_ratio_c``; ``ActorConfig`` has one,
    3.0 (the dual clip's constant), the default here, although the code's comment recommends a
    large cap. verl's DPPO example script
    (``examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh`` at ``VERL_COMMIT``, in the
    repository, not in the package) sets $\delta = 0.15$, ``clip_ratio_c=10000`` and
    ``loss_agg_mode=seq-mean-token-sum-norm``.

    **The anchor.** $q_t$ is verl's ``old_log_prob``: in decoupled mode the recomputed
    $\pi_{\mathrm{old}}$ (then verl also multiplies the loss by the ``rollout_is`` weights, if
    any). With ``bypass_mode: true`` it is the sampler's ``rollout_log_probs``, as here, in
    verl 0.9.1's default trainer (``trainer.use_v1: true``,
    ``verl/trainer/ppo/v1/trainer_base.py``), which keeps the actor's ``loss_mode``; the legacy
    trainer (``trainer.use_v1: false``) replaces ``loss_mode`` by ``"bypass_mode"``
    (``apply_bypass_mode``), so DPPO never sees the sampler there.

    $p_t$ and $q_t$ are read as probabilities, so both log-probabilities must be $\le 0$
    inside the mask: a ``ValueError`` names the one that is not (verl reads $p_t > 1$ as
    given).

    Returns
    -------
    loss : torch.Tensor
    metrics : dict
        verl's ``actor/pg_clipfrac`` (share of valid tokens outside the trust region, whatever
        the sign of $A$), ``actor/ppo_kl`` (mean $-\log \rho_t$) and
        ``actor/pg_clipfrac_lower`` (share of valid tokens inside it whose ratio exceeds $c$).

    Examples
    --------
    Three tokens with $A = 1$ and $(p, q) = (0.02, 0.01), (0.9, 0.6), (0.04, 0.01)$, so
    $r_t = 2, 1.5, 4$: PPO's clip at 1.2 would remove all three. The trust region removes only
    the frequent token, whose probability rose by $0.3 > 0.2$; the cap $c = 3$ truncates the
    last ratio:

    >>> trainer = torch.log(torch.tensor([[0.02, 0.9, 0.04]])).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.01, 0.6, 0.01]]))
    >>> loss, m = dppo_tv_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 3),
    ...                        reduction="sum")
    >>> loss.backward()
    >>> [round(g, 6) for g in trainer.grad[0].tolist()]
    [-2.0, 0.0, -3.0]
    >>> round(m["actor/pg_clipfrac"], 6), round(m["actor/pg_clipfrac_lower"], 6)
    (0.333333, 0.333333)
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    _check_log_probabilities(mask, "tv", trainer_logp=trainer_logp, sampler_logp=sampler_logp)
    low, high, cap = _check_dppo_options(clip_ratio, clip_ratio_low, clip_ratio_high,
                                         clip_ratio_c)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    return _dppo_loss(trainer_logp, sampler_logp, A, mask, dtype, low, high, cap, reduction,
                      "tv")


def dppo_kl_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
                 clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                 reduction="token-mean"):
    r"""DPPO-Binary-KL: truncated IS inside a trust region on a binary KL to the anchor.

    [opd_literate.mismatch.correction.dppo_tv_loss][] with the divergence
    $\mathrm{KL}(q_t \,\|\, p_t)$ between the two distributions of "the token $y_t$ or
    another" under $\mu$ and $\pi_\theta$, in verl's form, with $\epsilon = 10^{-8}$
    (``BINARY_KL_EPS`` of ``_numerics``):

    $$
    \begin{aligned}
    D_t &= q_t \log \frac{q_t}{p_t} + (1 - q_t) \log \frac{1 - q_t + \epsilon}{1 - p_t +
    \epsilon}, \\
    m_t &= \mathbb{1}[A > 0]\, \mathbb{1}[D_t \le \delta_h \text{ or } p_t \le q_t]
    + \mathbb{1}[A \le 0]\, \mathbb{1}[D_t \le \delta_l \text{ or } p_t \ge q_t],
    \end{aligned}
    $$

    and the same loss $L_t = -\mathrm{sg}(\min(r_t, c))\, m_t\, A \log \pi_\theta(y_t)$: the
    weight of [opd_literate.mismatch.estimators.dppo_kl][]. Where TV weighs every unit of
    probability alike, the KL is large for a rare token that became likely and small for a
    frequent one that moved by as much.

    **The full-vocabulary bound, and what $\epsilon$ does to it.** Without $\epsilon$,
    $D^0_t = q_t \log \frac{q_t}{p_t} + (1 - q_t) \log \frac{1 - q_t}{1 - p_t}$ is at most the
    full-vocabulary $\mathrm{KL}(\mu_t \,\|\, \pi_t) = \sum_v \mu(v \mid s_t)
    \log \frac{\mu(v \mid s_t)}{\pi_\theta(v \mid s_t)}$ (data processing: merging the other
    tokens into one outcome never increases a KL), with equality for two tokens. verl's
    $\epsilon$ changes the second term only:

    $$
    D_t - D^0_t = (1 - q_t) \Big[\log\Big(1 + \frac{\epsilon}{1 - q_t}\Big)
    - \log\Big(1 + \frac{\epsilon}{1 - p_t}\Big)\Big],
    $$

    which is $\le 0$ where $p_t \ge q_t$, so there $D_t \le \mathrm{KL}(\mu_t \,\|\, \pi_t)$.
    Where $p_t < q_t < 1$ it is positive (at $q_t = 1$ it is 0), and by
    $\frac{x}{1 + x} \le \log(1 + x) \le x$

    $$
    0 < D_t - D^0_t \le \epsilon\, \frac{q_t - p_t + \epsilon}{1 - p_t + \epsilon} < \epsilon,
    $$

    so there the full-vocabulary KL bounds $D_t$ only up to that excess: with two tokens and
    $(q_t, p_t) = (0.6, 0.5)$, $D_t$ exceeds the full KL by $2.0 \cdot 10^{-9}$. The region
    reads $D_t$ on that side only for $A \le 0$ (a token whose probability fell), where a token
    whose full-vocabulary KL is exactly $\delta_l$ can be outside it. These are statements of
    exact arithmetic; the computed $D_t$ adds its rounding.

    verl: ``loss_mode: dppo_kl`` (``compute_policy_loss_dppo_kl``, same commit, release,
    options, defaults and anchor as [opd_literate.mismatch.correction.dppo_tv_loss][]; verl's
    example script sets $\delta = 0.05$ for this variant). $1 - p$ is computed as
    $-\mathrm{expm1}(\log p)$ (verl: $1 - e^{\log p}$, the same to rounding), so the
    log-probabilities must be $\le 0$ inside the mask: a ``ValueError`` names the one that is
    not (verl would take the logarithm of a negative number).

    Examples
    --------
    $A = 1$, $(p, q) = (0.81, 0.6)$ and $(0.19, 0.001)$. The frequent token moved by
    $0.21 > 0.2$ (out of TV's region) but $D = 0.118$ (inside the KL's); the rare one by
    $0.189$ (inside TV's) but $D = 0.204 > 0.2$ (out of the KL's):

    >>> trainer = torch.log(torch.tensor([[0.81, 0.19]], dtype=torch.float64))
    >>> sampler = torch.log(torch.tensor([[0.6, 0.001]], dtype=torch.float64))
    >>> A, ones = torch.tensor([1.0]), torch.ones(1, 2)
    >>> for loss_fn in (dppo_tv_loss, dppo_kl_loss):
    ...     x = trainer.clone().requires_grad_()
    ...     loss_fn(x, sampler, A, ones, reduction="sum")[0].backward()
    ...     print(loss_fn.__name__, [round(g, 6) for g in x.grad[0].tolist()])
    dppo_tv_loss [0.0, -3.0]
    dppo_kl_loss [-1.35, 0.0]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    _check_log_probabilities(mask, "kl", trainer_logp=trainer_logp, sampler_logp=sampler_logp)
    low, high, cap = _check_dppo_options(clip_ratio, clip_ratio_low, clip_ratio_high,
                                         clip_ratio_c)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    return _dppo_loss(trainer_logp, sampler_logp, A, mask, dtype, low, high, cap, reduction,
                      "kl")


def dro_loss(trainer_logp, sampler_logp, advantages, mask, *, dro_beta,
             reduction="token-mean"):
    r"""DRO: the advantage-weighted log-likelihood less a quadratic penalty on the log-ratio.

    verl's Direct Reward Optimization loss, with $\beta$ = ``dro_beta``:

    $$
    L_t = -\Big(A \log \pi_\theta(y_t) - \frac{\beta}{2}\, (\log \rho_t)^2\Big), \qquad
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} = -A + \beta \log \rho_t .
    $$

    No ratio weights the advantage: the penalty pulls $\log \pi_\theta(y_t)$ back to the
    anchor's $\log \mu(y_t)$ with a force proportional to their distance, and at the anchor
    ($\log \rho_t = 0$) the gradient is plain REINFORCE's $-A$. The log-ratio is not clamped
    (verl's is not either). The gradient is not of the form $w_t A$ (the penalty does not
    scale with $A$, and acts where $A = 0$), so DRO has no weight in
    [opd_literate.mismatch.estimators][]' catalogue of $w_t A s_t$ estimators: it estimates
    the gradient of a regularised objective, not $\nabla J$.

    verl: ``loss_mode: dro`` (``compute_policy_loss_dro``, since commit ``ddfbf4e``,
    PR #7245, August 2026; in ``VERL_VERSION``), with ``policy_loss.dro_beta`` (default
    ``null``, and verl raises unless it is $> 0$: no default here either; its PR's example
    uses 0.05) and the actor's ``loss_agg_mode``. verl's ``docs/algo/dro.md`` (in the
    repository at ``VERL_COMMIT``) says DRO "expects the caller to construct advantages
    appropriate for its soft off-policy formulation". The anchor is verl's ``old_log_prob``,
    as for [opd_literate.mismatch.correction.dppo_tv_loss][]: $\pi_{\mathrm{old}}$ in
    decoupled mode, the sampler with ``bypass_mode: true`` in the default (v1) trainer, never
    the sampler in the legacy one. Both arguments are log-likelihoods of the sampled token and
    must be $\le 0$ inside the mask: a ``ValueError`` names the one that is not (verl computes
    the loss of any finite value).

    Returns
    -------
    loss : torch.Tensor
    metrics : dict
        verl's one metric, ``actor/ppo_kl`` (mean $-\log \rho_t$).

    Examples
    --------
    One token with $\log \rho = \log 2 = 0.693$ and $A = 1$: with $\beta = 1$ the penalty
    cancels most of the push, $-1 + 0.693 = -0.307$:

    >>> trainer = torch.log(torch.tensor([[0.5]], dtype=torch.float64)).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.25]], dtype=torch.float64))
    >>> loss, m = dro_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 1),
    ...                    dro_beta=1.0)
    >>> loss.backward()
    >>> round(trainer.grad.item(), 6), round(m["actor/ppo_kl"], 6)
    (-0.306853, -0.693147)
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    _check_log_probabilities(mask, "dro", trainer_logp=trainer_logp, sampler_logp=sampler_logp)
    beta = check_finite_number("dro_beta", dro_beta, positive=True)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    trainer = select(mask, trainer_logp.to(dtype))
    # one path from trainer_logp: a half-precision input gets its float32 gradient rounded once
    log_rho_t = trainer - select(mask, sampler_logp.detach().to(dtype))
    # L_t = -(A log pi(y_t) - beta / 2 (log pi(y_t) - log mu(y_t))^2)
    per_token = -(A * trainer - 0.5 * beta * log_rho_t.square())
    bad = mask & ~torch.isfinite(per_token.detach())
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"dro_loss overflows {dtype} at position ({b}, {t}): dro_beta / 2 * (log ratio)^2 "
            f"with dro_beta={beta!r}, log ratio {log_rho_t[b, t].item()!r}; use float64 inputs "
            "or a smaller dro_beta")
    loss = aggregate(select(mask, per_token), mask, reduction)
    metrics = {"actor/ppo_kl": float(masked_mean(-log_rho_t.detach(), mask))}
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Soft gates, geometric means and covariance selection: verl's and TRL's other policy losses
# ---------------------------------------------------------------------------------------------
def _ppo_kl(log_rho_t, mask):
    r"""verl's ``actor/ppo_kl``: the mean of $-\log \rho_t$ over the valid tokens."""
    return float(masked_mean(-log_rho_t.detach(), mask))


def sapo_loss(trainer_logp, sampler_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05,
              reduction="seq-mean-token-mean"):
    r"""SAPO: a sigmoid gate of the ratio instead of PPO's clip, the sampler as the anchor.

    With $r_t = \exp(\mathrm{clamp}(\log \rho_t, -20, 20))$ and $\tau = \tau_+$ where $A > 0$,
    $\tau_-$ elsewhere,

    $$
    L_t = -\frac{4}{\tau}\, \sigma\big(\tau (r_t - 1)\big)\, A, \qquad
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} = -r_t\,
    \mathrm{sech}^2\Big(\frac{\tau (r_t - 1)}{2}\Big)\, A :
    $$

    the weight of [opd_literate.mismatch.estimators.sapo][] times $-A$ (with
    ``reduction="sum"``). verl ``loss_mode: sapo`` (``compute_policy_loss_sapo``, the actor's
    ``tau_pos`` 1.0 and ``tau_neg`` 1.05; it reduces by ``"seq-mean-token-mean"`` whatever
    ``loss_agg_mode`` says, dividing each response by its length plus $10^{-8}$, where this
    one divides by the length) and TRL ``loss_type="sapo"`` (``sapo_temperature_pos`` /
    ``_neg``, the same defaults and reduction; TRL does not clamp the log-ratio). The default
    ``reduction`` is theirs.

    Examples
    --------
    $\rho = 2.5$, $A = -1$: the gradient is $2.5\, \mathrm{sech}^2(0.7875) = 1.4209$ where
    PPO's would be $2.5$:

    >>> trainer = torch.log(torch.tensor([[0.5]], dtype=torch.float64)).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.2]], dtype=torch.float64))
    >>> loss, _ = sapo_loss(trainer, sampler, torch.tensor([-1.0]), torch.ones(1, 1))
    >>> loss.backward()
    >>> round(trainer.grad.item(), 4)
    1.4209
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    tau_pos = check_finite_number("tau_pos", tau_pos, positive=True)
    tau_neg = check_finite_number("tau_neg", tau_neg, positive=True)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    ratio = _exp_safe(log_rho_t)
    tau = torch.where(A > 0, torch.full_like(A, tau_pos), torch.full_like(A, tau_neg))
    # f_tau(r) = (4 / tau) sigmoid(tau (r - 1)), 1 at r = 1 in slope
    per_token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * A
    loss = aggregate(select(mask, per_token), mask, reduction)
    return loss, {"actor/ppo_kl": _ppo_kl(log_rho_t, mask)}


def geo_mean_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
                  clip_ratio_low=None, clip_ratio_high=None):
    r"""GMPO (verl's ``geo_mean``): the geometric mean of the log-space-clipped token ratios,
    one term a response, the sampler as the anchor.

    With $x_t = \log \rho_t$, $m_t = \min(x_t, \varepsilon_h)$ where $A > 0$, $\max(x_t,
    -\varepsilon_l)$ where $A < 0$, 0 where $A = 0$ (verl's $\mathrm{sign}(A)$), $n_b$ the
    tokens of response $b$ and $\bar A_b$ the mean of its advantages,

    $$
    \begin{aligned}
    L &= \frac1B \sum_b -\bar A_b \exp\Big(\frac{1}{n_b} \sum_t m_t\Big), \\
    \frac{\partial L}{\partial \log \pi_\theta(y_t)} &= -\frac{\bar A_b}{B\, n_b}
    \exp\Big(\frac{1}{n_b} \sum_k m_k\Big)\, \mathbb{1}[t \text{ not clipped}] :
    \end{aligned}
    $$

    $B n_b$ times the gradient is the weight of [opd_literate.mismatch.estimators.gmpo][] times
    $-A$. verl ``loss_mode: geo_mean`` (``compute_policy_loss_geo_mean``) reads the actor's
    ``clip_ratio_low`` / ``clip_ratio_high`` (None: ``clip_ratio``; 0.2 each in its config) as
    $\varepsilon_l, \varepsilon_h$ and ignores ``loss_agg_mode``: there is no ``reduction``
    here either. verl divides by $n_b + 10^{-8}$ (here by $n_b$, at least 1) and does not clamp
    $x_t$ (here $\pm 20$, as every ratio); it supports one advantage a response, as here.

    Returns
    -------
    loss : torch.Tensor
    metrics : dict
        verl's ``actor/pg_clipfrac`` (share of valid tokens whose $x_t$ lies outside
        $[-\varepsilon_l, \varepsilon_h]$ with $A > 0$), ``actor/pg_clipfrac_lower`` (the
        same with $A < 0$) and ``actor/ppo_kl``.

    Examples
    --------
    One response of two tokens, $\rho_t = 0.625, 2.5$, $A = 1$: the second is clipped at
    $e^{0.2}$, the first gets $-\frac12 \sqrt{0.625\, e^{0.2}} = -0.4369$:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2]], dtype=torch.float64))
    >>> loss, _ = geo_mean_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 2))
    >>> loss.backward()
    >>> [round(g, 4) for g in trainer.grad[0].tolist()]
    [-0.4369, 0.0]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    x = log_rho_t.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sign = torch.sign(A)
    # sign(A) min(sign(A) x, sign(A) clamp(x)): clipped above for A > 0, below for A < 0
    m = sign * torch.minimum(sign * x, sign * x.clamp(-low, high))
    n = lengths(mask, dtype)  # (B,)
    ratio = torch.exp(select(mask, m).sum(dim=1) / n)  # (B,)
    seq_advantage = select(mask, A).sum(dim=1) / n  # (B,): verl's mean advantage
    loss = (-seq_advantage * ratio).mean()
    with torch.no_grad():
        clipped = (x < -low) | (x > high)
        metrics = {
            "actor/pg_clipfrac": float(masked_mean((clipped & (A > 0)).to(dtype), mask)),
            "actor/ppo_kl": _ppo_kl(log_rho_t, mask),
            "actor/pg_clipfrac_lower": float(masked_mean((clipped & (A < 0)).to(dtype), mask)),
        }
    return loss, metrics


def luspo_loss(trainer_logp, sampler_logp, advantages, mask, *, epsilon=0.2,
               epsilon_high=None):
    r"""LUSPO (TRL): GSPO's clipped sequence-ratio term, summed over the response's tokens.

    TRL ``loss_type="luspo"`` with ``importance_sampling_level="sequence"``: with $s$ the
    geometric sequence ratio,
    $L = \frac1B \sum_b n_b \max(-A s, -A\, \mathrm{clip}(s, 1 - \varepsilon,
    1 + \varepsilon_h))$. That is [opd_literate.mismatch.correction.gspo_loss][] with
    ``reduction="seq-mean-token-sum"`` (GSPO's value on each of the $n_b$ tokens, summed), and
    its gradient on token $t$ is $-A s / B$ unless clipped: $B$ times it is the weight of
    [opd_literate.mismatch.estimators.luspo][] times $-A$. ``epsilon`` and ``epsilon_high``
    are ``GRPOConfig``'s (0.2, and None meaning ``epsilon``). TRL does not clamp the log-ratio.

    Examples
    --------
    $\rho_t = 1.1, 1.1$ and $A = 1$: $s = 1.1$, inside $[0.8, 1.2]$; the loss is
    $2 \cdot (-1.1)$, and each token gets $-1.1$:

    >>> trainer = torch.log(torch.tensor([[0.55, 0.55]], dtype=torch.float64)).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    >>> loss, _ = luspo_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 2))
    >>> loss.backward()
    >>> round(loss.item(), 6), [round(g, 6) for g in trainer.grad[0].tolist()]
    (-2.2, [-1.1, -1.1])
    """
    epsilon = check_finite_number("epsilon", epsilon, low=0.0)
    high = epsilon if epsilon_high is None else check_finite_number("epsilon_high",
                                                                    epsilon_high, low=0.0)
    return gspo_loss(trainer_logp, sampler_logp, advantages, mask, clip_ratio_low=epsilon,
                     clip_ratio_high=high, reduction="seq-mean-token-sum")


VESPO_LOG_W_MIN = math.log(1e-8)
r"""$\log 10^{-8}$: the floor of VESPO's $\log w$ in TRL's ``get_gamma_weights``."""


def vespo_loss(trainer_logp, sampler_logp, advantages, mask, *, k_pos=2.0, lambda_pos=3.0,
               k_neg=3.0, lambda_neg=2.0, reduction="token-mean"):
    r"""VESPO (TRL): a detached gamma weight of the sequence ratio times the log-likelihood.

    With $(k, \lambda)$ by the sign of $A$ ($A \ge 0$: $k_+, \lambda_+$) and

    $$
    \log w = \mathrm{clamp}\Big(\sum_t \mathrm{clamp}(\log \rho_t, -20, 20),\,
    \log 10^{-8},\, 20\Big),
    $$

    $$
    \varphi = \exp\big(\lambda + k \log w - \lambda w\big), \qquad
    L_t = -\mathrm{sg}(\varphi)\, A \log \pi_\theta(y_t), \qquad
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} = -\varphi A :
    $$

    with ``reduction="sum"`` the weight of [opd_literate.mismatch.estimators.vespo][] times
    $-A$ (where the clamps do not bind). TRL ``loss_type="vespo"`` (``get_gamma_weights``;
    ``vespo_k_pos`` 2, ``vespo_lambda_pos`` 3, ``vespo_k_neg`` 3, ``vespo_lambda_neg`` 2;
    $\lambda$ floored at $10^{-4}$ there, required $> 0$ here), reduced over the tokens of the
    batch (``num_items_in_batch``: ``"token-mean"`` on one process without accumulation).
    Here the sampler is the anchor; TRL's anchor is its own recomputation, with the vLLM
    ratio folded into $\log w$ (see the numpy estimator).

    Examples
    --------
    Two tokens with $\rho_t = 1.25$ each, $A = 1$: $w = 1.5625$, $\varphi = 1.5625^2
    e^{3 (1 - 1.5625)} = 0.4516$ on both:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.4, 0.4]], dtype=torch.float64))
    >>> loss, _ = vespo_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 2),
    ...                      reduction="sum")
    >>> loss.backward()
    >>> [round(g, 4) for g in trainer.grad[0].tolist()]
    [-0.4516, -0.4516]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    k_pos, k_neg = (check_finite_number(n, v, low=0.0) for n, v in (("k_pos", k_pos),
                                                                  ("k_neg", k_neg)))
    lambda_pos, lambda_neg = (check_finite_number(n, v, positive=True) for n, v in (
        ("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)))
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    with torch.no_grad():  # phi scales the gradient; it carries none
        log_w = log_rho_t.clamp(-SAFETY_BOUND, SAFETY_BOUND).sum(dim=1, keepdim=True)
        log_w = log_w.clamp(VESPO_LOG_W_MIN, SAFETY_BOUND).expand_as(A)  # (B, T)
        positive = A >= 0
        k = torch.where(positive, torch.full_like(A, k_pos), torch.full_like(A, k_neg))
        lam = torch.where(positive, torch.full_like(A, lambda_pos),
                          torch.full_like(A, lambda_neg))
        # log phi = lambda + k log w - lambda w
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    per_token = -phi * A * select(mask, trainer_logp.to(dtype))
    loss = aggregate(select(mask, per_token), mask, reduction)
    return loss, {"actor/ppo_kl": _ppo_kl(log_rho_t, mask)}


def _batch_covariance(trainer_logp, A, mask, dtype):
    r"""verl's $(A_t - \bar A)(\log \pi(y_t) - \overline{\log \pi})$, the means over the batch's
    valid tokens; detached, 0 off the mask."""
    log_pi = select(mask, trainer_logp.detach().to(dtype))
    cov = (A - masked_mean(A, mask)) * (log_pi - masked_mean(log_pi, mask))
    return select(mask, cov)


def _check_clip_cov(clip_cov_ratio, clip_cov_lb, clip_cov_ub):
    share = check_finite_number("clip_cov_ratio", clip_cov_ratio, positive=True)
    lb = check_finite_number("clip_cov_lb", clip_cov_lb, allow_inf=True)
    ub = check_finite_number("clip_cov_ub", clip_cov_ub, allow_inf=True)
    if not lb < ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {lb!r} >= {ub!r}")
    return share, lb, ub


def _clip_cov_kept(trainer_logp, A, mask, dtype, clip_taken, share, lb, ub):
    r"""Clip-Cov's expected share kept: $1 - q$ on the eligible tokens (the covariance band
    among those PPO's clip leaves, ``clip_taken`` False), 1 elsewhere; with $q$ and $n_e$."""
    cov = _batch_covariance(trainer_logp, A, mask, dtype)
    eligible = mask & ~clip_taken & (cov > lb) & (cov < ub)
    n_eligible = int(eligible.sum())
    k = max(int(share * int(mask.sum())), 1)  # verl's clip_num
    q = min(k, n_eligible) / n_eligible if n_eligible else 0.0
    return torch.where(eligible, torch.full_like(A, 1.0 - q), torch.ones_like(A)), q, n_eligible


def clip_cov_loss(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
                  clip_ratio_low=None, clip_ratio_high=None, clip_cov_ratio=2e-4,
                  clip_cov_lb=1.0, clip_cov_ub=5.0, reduction="token-mean"):
    r"""Clip-Cov: PPO's clipped loss with a share of the high-covariance tokens removed,
    averaged over verl's random choice of them; the sampler as the anchor.

    With $c_t = (A_t - \bar A)(\log \pi_\theta(y_t) - \overline{\log \pi_\theta})$ over the
    batch's $N$ valid tokens, the *eligible* tokens are those PPO's clip leaves with
    $l < c_t < u$; verl sets the loss of $k = \max(\lfloor r N \rfloor, 1)$ of the $n_e$
    eligible ones, drawn with ``torch.randperm``, to 0. This loss is the expectation over that
    draw: each eligible token's PPO term times $1 - q$, $q = \min(k, n_e) / n_e$,

    $$
    L_t = \max\big(-A r_t,\ -A\, \mathrm{clip}(r_t, 1 - \varepsilon_l, 1 + \varepsilon_h)
    \big)\, \big(1 - q\, \mathbb{1}[t \text{ eligible}]\big),
    $$

    equal to verl's where $k \ge n_e$ (no draw) and its mean over the draws otherwise: its
    gradient with ``reduction="sum"`` on the toy's enumerated batch is the weight of
    [opd_literate.mismatch.estimators.clip_cov][] with ``statistics="enumerated"`` times $-A$.
    verl ``loss_mode: clip_cov`` (``compute_policy_loss_clip_cov``): the actor's
    ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` and ``policy_loss``'s
    ``clip_cov_ratio`` $r$ (0.0002), ``clip_cov_lb`` $l$ (1.0), ``clip_cov_ub`` $u$ (5.0); no
    dual clip. The batch is the one the loss is called with. verl does not clamp the
    log-ratio (here $\pm 20$).

    Returns
    -------
    loss : torch.Tensor
    metrics : dict
        ``actor/pg_clipfrac`` (here the expected share of valid tokens removed, $q n_e / N$;
        verl logs the drawn one, the same where $k \ge n_e$) and ``actor/ppo_kl``.

    Examples
    --------
    Two tokens, $\rho_t = 1.6, 0.4$, $A = 0.5, -0.5$, $\varepsilon = 0.7$ (nothing clipped):
    $c_t = 0.5 \log 2 = 0.347$ for both. With $l = 0.3$ both are eligible and $k = 1$ of them is
    removed: each keeps half its gradient.

    >>> trainer = torch.log(torch.tensor([[0.8, 0.2]], dtype=torch.float64)).requires_grad_()
    >>> sampler = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    >>> loss, m = clip_cov_loss(trainer, sampler, torch.tensor([[0.5, -0.5]]), torch.ones(1, 2),
    ...                         clip_ratio=0.7, clip_cov_lb=0.3, reduction="sum")
    >>> loss.backward()
    >>> [round(g, 6) for g in trainer.grad[0].tolist()], m["actor/pg_clipfrac"]
    ([-0.4, 0.1], 0.5)
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    share, lb, ub = _check_clip_cov(clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    ratio = _exp_safe(log_rho_t)
    unclipped = -A * ratio
    clipped = -A * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    with torch.no_grad():
        keep, q, n_eligible = _clip_cov_kept(trainer_logp, A, mask, dtype,
                                             clipped > unclipped, share, lb, ub)
    per_token = torch.maximum(unclipped, clipped) * keep
    loss = aggregate(select(mask, per_token), mask, reduction)
    metrics = {"actor/pg_clipfrac": q * n_eligible / max(int(mask.sum()), 1),
               "actor/ppo_kl": _ppo_kl(log_rho_t, mask)}
    return loss, metrics


def _ratio_passes_gradient(log_rho_t):
    """Where ``exp(clamp(log_rho, -20, 20))`` has a derivative: in the clamp, bounds included."""
    return (log_rho_t >= -SAFETY_BOUND) & (log_rho_t <= SAFETY_BOUND)


def sapo_weights(trainer_logp, sampler_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05):
    r"""The per-token weight of SAPO's gradient: ``sapo_loss`` as a REINFORCE weight.

    The gradient of [opd_literate.mismatch.correction.sapo_loss][]'s token $t$ is
    $-w_t A_t \nabla \log \pi_\theta(y_t)$ with

    $$
    w_t = r_t\, \mathrm{sech}^2\Big(\frac{\tau (r_t - 1)}{2}\Big), \qquad
    \tau = \tau_+ \text{ where } A_t > 0, \ \tau_- \text{ elsewhere},
    $$

    ($w_t = 0$ where the log-ratio is clamped, beyond $\pm 20$: no gradient passes there).
    So REINFORCE with these weights detached ([opd_literate.mismatch.correction.reinforce_loss][])
    has SAPO's gradient at the same ``reduction``, to rounding
    (``tests/mismatch/test_bypass_weights.py``: $10^{-12}$ in float64). The advantages choose
    $\tau$ only. Detached, in the compute dtype, 0 off the mask.

    Examples
    --------
    $\rho = 2.5$ with $A < 0$ gives $2.5\, \mathrm{sech}^2(0.7875) = 1.4209$ (``sapo_loss``'s
    example); $\rho = 1$ gives 1, whatever the sign:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.3]], dtype=torch.float64))
    >>> sampler = torch.log(torch.tensor([[0.2, 0.3]], dtype=torch.float64))
    >>> w = sapo_weights(trainer, sampler, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    >>> [round(x, 4) for x in w[0].tolist()]
    [1.4209, 1.0]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    tau_pos = check_finite_number("tau_pos", tau_pos, positive=True)
    tau_neg = check_finite_number("tau_neg", tau_neg, positive=True)
    A = _check_advantages(advantages, mask, dtype)
    with torch.no_grad():
        log_rho_t = _token_log_ratio(trainer_logp.detach(), sampler_logp, mask, dtype)
        ratio = _exp_safe(log_rho_t)
        tau = torch.where(A > 0, torch.full_like(A, tau_pos), torch.full_like(A, tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0))
        # sech^2(x / 2) = 4 sigma(x) (1 - sigma(x)): the derivative of (4 / tau) sigma(tau (r - 1))
        weights = 4.0 * gate * (1.0 - gate) * ratio
        passes = mask & _ratio_passes_gradient(log_rho_t)
        return torch.where(passes, weights, torch.zeros_like(weights))


def gspo_weights(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio_low=3e-4,
                 clip_ratio_high=4e-4):
    r"""The per-token weight of GSPO's gradient: ``gspo_loss`` as a REINFORCE weight.

    The gradient of [opd_literate.mismatch.correction.gspo_loss][]'s token $t$ is
    $-w_t A_t \nabla \log \pi_\theta(y_t)$ with $w_t = s$, the response's geometric ratio,
    unless PPO's clip takes it ($s > 1 + \varepsilon_h$ with $A_t > 0$, $s < 1 - \varepsilon_l$
    with $A_t < 0$), where $w_t = 0$, as it is where $\log s_t$ is clamped. REINFORCE with these
    weights detached has GSPO's gradient at the same ``reduction``
    (``tests/mismatch/test_bypass_weights.py``: $10^{-12}$ in float64). In float32 a token whose
    $s$ lies within rounding of a clip's edge can differ: the loss clips
    $\exp(\log s + \log \pi - \log \pi)$, computed, and these weights $\exp(\log s)$; and
    where its two terms round to the same value ``torch.maximum`` gives each half the gradient,
    these weights the unclipped one. A bound of ``None`` is 0, as in ``gspo_loss``. Detached, in
    the compute dtype, 0 off the mask.

    Examples
    --------
    ``gspo_loss``'s example: $s = 1.25$, clipped with $A > 0$, kept with $A < 0$:

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    >>> sampler = torch.log(torch.tensor([[0.8, 0.2], [0.8, 0.2]], dtype=torch.float64))
    >>> w = gspo_weights(trainer, sampler, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    >>> w.round(decimals=9).tolist()
    [[0.0, 0.0], [1.25, 1.25]]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    eps_low, eps_high = _clip_range(0.0, clip_ratio_low, clip_ratio_high)
    A = _check_advantages(advantages, mask, dtype)
    with torch.no_grad():
        log_rho_t = _token_log_ratio(trainer_logp.detach(), sampler_logp, mask, dtype)
        log_s = _level_log_ratio(log_rho_t, mask, "geometric")
        seq_ratio = _exp_safe(log_s)
        clipped = (-A * torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)) > (-A * seq_ratio)
        passes = mask & ~clipped & _ratio_passes_gradient(log_s)
        return torch.where(passes, seq_ratio, torch.zeros_like(seq_ratio))


def clip_cov_weights(trainer_logp, sampler_logp, advantages, mask, *, clip_ratio=0.2,
                     clip_ratio_low=None, clip_ratio_high=None, clip_cov_ratio=2e-4,
                     clip_cov_lb=1.0, clip_cov_ub=5.0):
    r"""The per-token weight of Clip-Cov's gradient: ``clip_cov_loss`` as a REINFORCE weight.

    The gradient of [opd_literate.mismatch.correction.clip_cov_loss][]'s token $t$ is
    $-w_t A_t \nabla \log \pi_\theta(y_t)$ with

    $$
    w_t = r_t\, \mathbb{1}[\text{PPO's clip leaves } t]\,
    \big(1 - q\, \mathbb{1}[t \text{ eligible}]\big),
    $$

    $q$ and the eligible tokens as there (the covariance band $l < c_t < u$ among the tokens
    the clip leaves), and $w_t = 0$ where the log-ratio is clamped. The clip leaves $t$ unless
    its clipped term exceeds the unclipped one: $r_t > 1 + \varepsilon_h$ with $A_t > 0$, or
    $r_t < 1 - \varepsilon_l$ with $A_t < 0$. REINFORCE with these weights detached has
    Clip-Cov's gradient at the same ``reduction`` (``tests/mismatch/test_bypass_weights.py``:
    $10^{-12}$ in float64). In float32, where the clipped and unclipped terms of a token round to
    the same value (a ratio within rounding of the clip's edge), ``torch.maximum`` gives each half
    the gradient and these weights the unclipped one. Detached, in the compute dtype, 0 off the
    mask.

    Examples
    --------
    ``clip_cov_loss``'s example: both tokens eligible, one of the two removed in expectation,
    so each keeps half its ratio. With both advantages 0.5 the covariances are 0 (nothing
    eligible), and at $\varepsilon = 0.2$ the clip takes the first ($\rho = 1.6 > 1.2$ with
    $A > 0$) and leaves the second ($\rho = 0.4$ with $A > 0$):

    >>> trainer = torch.log(torch.tensor([[0.8, 0.2]], dtype=torch.float64))
    >>> sampler = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    >>> clip_cov_weights(trainer, sampler, torch.tensor([[0.5, -0.5]]), torch.ones(1, 2),
    ...                  clip_ratio=0.7, clip_cov_lb=0.3).round(decimals=9).tolist()
    [[0.8, 0.2]]
    >>> clip_cov_weights(trainer, sampler, torch.tensor([[0.5, 0.5]]), torch.ones(1, 2),
    ...                  clip_cov_lb=0.3).round(decimals=9).tolist()
    [[0.0, 0.4]]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    share, lb, ub = _check_clip_cov(clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    A = _check_advantages(advantages, mask, dtype)
    with torch.no_grad():
        log_rho_t = _token_log_ratio(trainer_logp.detach(), sampler_logp, mask, dtype)
        ratio = _exp_safe(log_rho_t)
        # the same comparison as clip_cov_loss: where the clipped term is the larger, its
        # (constant) value is the loss and no gradient passes
        clipped = (-A * torch.clamp(ratio, 1.0 - low, 1.0 + high)) > (-A * ratio)
        kept, _, _ = _clip_cov_kept(trainer_logp, A, mask, dtype, clipped, share, lb, ub)
        passes = mask & ~clipped & _ratio_passes_gradient(log_rho_t)
        return torch.where(passes, ratio * kept, torch.zeros_like(ratio))


def kl_cov_loss(trainer_logp, sampler_logp, advantages, mask, *, kl_cov_ratio=2e-4,
                ppo_kl_coef=0.1, reduction="token-mean"):
    r"""KL-Cov: the unclipped ratio loss, plus $\beta |\log \rho_t|$ on the tokens of largest
    covariance; the sampler as the anchor.

    $$
    L_t = -A r_t + \beta\, \mathbb{1}[t \text{ selected}]\, |\log \rho_t|, \qquad
    \frac{\partial L_t}{\partial \log \pi_\theta(y_t)} = -A r_t
    + \beta\, \mathbb{1}[t \text{ selected}]\, \mathrm{sign}(\log \rho_t),
    $$

    the selected tokens the $\max(\lfloor r N \rfloor, 1)$ of largest
    $c_t = (A_t - \bar A)(\log \pi_\theta(y_t) - \overline{\log \pi_\theta})$ among the
    batch's $N$ valid tokens (``torch.topk``, as verl). The penalty's gradient does not scale
    with $A$: this is the estimate of [opd_literate.mismatch.estimators.kl_cov][] (with
    ``statistics="enumerated"``), which has no weight $w_t$. verl ``loss_mode: kl_cov``
    (``compute_policy_loss_kl_cov``): ``policy_loss.kl_cov_ratio`` $r$ (0.0002) and
    ``ppo_kl_coef`` $\beta$ (0.1 in its composed config). No clip; verl does not clamp the
    log-ratio (here $r_t$ from the clamp at $\pm 20$, $|\log \rho_t|$ unclamped).

    Examples
    --------
    Three tokens, $\rho_t = 2, 1/3, 1$, $A = 1, 0, 0$: $c = (0.41, 0.26, -0.05)$. With
    $r = 0.5$ ($k = 1$) token 0 alone gets the penalty, $-A \rho + \beta = -2 + 1$; with
    $r = 0.67$ ($k = 2$) token 1 too, whose $A = 0$: its gradient is
    $\beta\, \mathrm{sign}(\log \tfrac13) = -1$.

    >>> trainer = torch.log(torch.tensor([[0.8, 0.2, 0.5]], dtype=torch.float64))
    >>> sampler = torch.log(torch.tensor([[0.4, 0.6, 0.5]], dtype=torch.float64))
    >>> A = torch.tensor([[1.0, 0.0, 0.0]])
    >>> for r in (0.5, 0.67):
    ...     x = trainer.clone().requires_grad_()
    ...     kl_cov_loss(x, sampler, A, torch.ones(1, 3), kl_cov_ratio=r, ppo_kl_coef=1.0,
    ...                 reduction="sum")[0].backward()
    ...     print([round(g, 4) for g in x.grad[0].tolist()])
    [-1.0, 0.0, 0.0]
    [-1.0, -1.0, 0.0]
    """
    mask, dtype = _check_batch(trainer_logp, sampler_logp, mask)
    share = check_finite_number("kl_cov_ratio", kl_cov_ratio, positive=True)
    beta = check_finite_number("ppo_kl_coef", ppo_kl_coef, low=0.0)
    check_reduction(reduction)
    A = _check_advantages(advantages, mask, dtype)
    log_rho_t = _token_log_ratio(trainer_logp, sampler_logp, mask, dtype)
    with torch.no_grad():
        cov = _batch_covariance(trainer_logp, A, mask, dtype)
        valid = cov[mask]  # the valid tokens, row by row, as verl flattens them
        k = max(1, int(valid.numel() * share))
        top = torch.topk(valid, min(k, valid.numel()), largest=True).indices
        flags = torch.zeros_like(valid, dtype=torch.bool)
        flags[top] = True
        selected = torch.zeros_like(mask)
        selected[mask] = flags
    per_token = -A * _exp_safe(log_rho_t) + torch.where(
        selected, beta * log_rho_t.abs(), torch.zeros_like(log_rho_t))
    loss = aggregate(select(mask, per_token), mask, reduction)
    return loss, {"actor/ppo_kl": float(masked_mean(log_rho_t.detach().abs(), mask))}


def kl_penalty(trainer_logp, ref_logp, mask, kind="k1"):
    r"""Per-token KL estimators, with verl's straight-through ``"k1+"`` and ``"k3+"``.

    ``"k1"``, ``"k2"``, ``"k3"`` are the estimates of
    $\mathrm{KL}(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$ of [opd_literate.opd.kl_estimator][].
    A ``"+"`` keeps the *value* of k1 or k3 and takes the *gradient* of $k_2 = \frac12 d^2$,
    with $d = \log \pi_\theta(y) - \log \pi_{\mathrm{ref}}(y)$:

    $$
    k^{+} = k_2 - \mathrm{sg}(k_2) + \mathrm{sg}(k), \qquad
    \frac{\partial k^{+}}{\partial \log \pi_\theta(y)} = d,
    $$

    whose expectation over $y \sim \pi_\theta$ is the gradient of the reverse KL (k1 and k3 as
    losses have the expected gradients 0 and $\nabla \mathrm{KL}(\pi_{\mathrm{ref}} \,\|\,
    \pi_\theta)$). verl's ``kl_penalty`` (``actor.kl_loss_type``, e.g. ``"k3+"``; there
    ``"k2+"`` is ``"k2"``) computes these since commit ``7e80ab0`` (PR #6058, April 2026): before
    it, e.g. at b178a3c, verl passed the suffixed name on and every ``"+"`` name raised
    ``NotImplementedError``. verl's k3 clamps $-d$ to $\pm 20$ and the value to $\pm 10$; this
    one is [opd_literate.opd.kl_estimator][]'s, unclamped, so it refuses (``ValueError``) a
    k3 whose value $e^{-d} - 1 + d$ overflows the compute dtype; and where ``trainer_logp`` is
    narrower than the compute dtype, the backward pass refuses a gradient that overflows
    ``trainer_logp``'s own dtype, in which autograd returns it (k3's $1 - e^{-d}$ times the
    upstream gradient: past about $e^{11.1}$ in float16 at a unit upstream gradient), rather
    than return an infinity.

    Returns
    -------
    torch.Tensor
        ``(B, T)``, 0 in value and gradient where ``mask`` is 0.

    Examples
    --------
    $d = 0.5$: the value of k3 is $e^{-0.5} - 1 + 0.5 = 0.1065$, the gradient that of $k_2$,
    $d = 0.5$:

    >>> logp = torch.tensor([[0.0]], requires_grad=True)
    >>> k = kl_penalty(logp, torch.tensor([[-0.5]]), torch.ones(1, 1), "k3+")
    >>> k.sum().backward()
    >>> round(k.item(), 4), logp.grad.item()
    (0.1065, 0.5)
    """
    if kind not in KL_PENALTIES:
        raise ValueError(f"kind must be one of {KL_PENALTIES}, got {kind!r}")
    mask, dtype = _check_batch(trainer_logp, ref_logp, mask, "ref_logp")
    zeros = torch.zeros((), dtype=dtype, device=trainer_logp.device)
    widened = trainer_logp.to(dtype)
    if dtype != trainer_logp.dtype and trainer_logp.requires_grad and torch.is_grad_enabled():
        # autograd returns the gradient in trainer_logp's own dtype, which can be narrower than
        # the compute dtype (a bf16 trainer beside a float64 ref): k3's 1 - e^{-d} times the
        # upstream gradient can overflow it there, which only the backward pass can see
        widened = _WidenChecked.apply(trainer_logp, dtype, kind)
    trainer = torch.where(mask, widened, zeros)
    ref = torch.where(mask, ref_logp.detach().to(dtype), zeros)
    value = kl_estimator(trainer, ref, kind.rstrip("+"))
    if kind.endswith("+"):
        k2 = kl_estimator(trainer, ref, "k2")
        # straight through: the value of k, the gradient of k2
        value = k2 - k2.detach() + value.detach()
    _check_kl_fits(value, trainer, ref, mask, kind)
    return select(mask, value)


def _check_kl_fits(value, trainer, ref, mask, kind):
    """Refuse a KL estimate that overflows its dtype (k3's e^{-d} beyond e^88 in float32)."""
    bad = mask & ~torch.isfinite(value.detach())
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"kl_penalty {kind!r} overflows {value.dtype} at position ({b}, {t}): "
            f"d = trainer_logp - ref_logp = {(trainer[b, t] - ref[b, t]).item()!r}; "
            "use float64 inputs, or k1 or k2 (which grow like d and d^2, not e^{-d})")


class _WidenChecked(torch.autograd.Function):
    """``x.to(dtype)``, whose backward refuses a finite gradient that overflows ``x``'s own
    (narrower) dtype when cast back to it, instead of returning an infinity."""

    @staticmethod
    def forward(ctx, x, dtype, kind):
        ctx.source, ctx.kind = x.dtype, kind
        return x.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        narrow = grad.to(ctx.source)
        bad = torch.isfinite(grad) & ~torch.isfinite(narrow)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"kl_penalty {ctx.kind!r}'s gradient {grad[where].item():.4g} overflows "
                f"trainer_logp's {ctx.source} at position {where} (autograd returns it in that "
                "dtype): use float32 trainer log-probs, a smaller loss scale, or 'k3+'")
        return narrow, None, None


# ---------------------------------------------------------------------------------------------
# Kept masses: the log-ratio when the engine cuts (top-k, top-p, min-p)
# ---------------------------------------------------------------------------------------------
class KeptMassRatio(NamedTuple):
    """What [opd_literate.mismatch.correction.kept_mass_log_ratio][] returns, each ``(B, T)``
    in the compute dtype and 0 where ``mask`` is 0."""

    log_ratio: torch.Tensor
    r"""$\log \pi'(y_t) - \log \mu'(y_t)$; it carries the gradient of ``trainer_logp``."""
    trainer_logp: torch.Tensor
    r"""$\log \pi'(y_t)$, the trainer's log-probability; its gradient is the score."""
    sampler_logp: torch.Tensor
    r"""$\log \mu'(y_t)$, the reported log-probability with its correction; detached."""


def kept_mass_log_ratio(trainer_logits, sampler_logp, tokens, kept, mask, *, temperature,
                        reported="processed", kept_mass=None, trainer_mask=False,
                        sampler_log_kept=None):
    r"""The per-token log-ratio of each reported log-prob and kept-mass correction, on a batch.

    The torch form of the options ``reported``, ``kept_mass`` and ``trainer_mask`` of
    [opd_literate.mismatch.engine.engine_toy][] (the engine module's docstring derives what
    each ratio is unbiased for). An engine samples position $t$ from its tempered distribution
    $\mu_\tau$ renormalised on the kept set $S_t$ that its top-$k$, top-$p$ and min-$p$ leave,
    $\mu(v) = \mu_\tau(v)\, \mathbb{1}[v \in S_t] / \mu_\tau(S_t)$, and reports
    $\log \ell(y_t)$ of the written token, with $\ell$ the processed $\mu$, the raw
    $\mathrm{softmax}(z)$ or the tempered $\mu_\tau$ (SGLang's default). The trainer holds its
    logits $\theta_t$, the policy $\pi_\tau = \mathrm{softmax}(\theta_t / \tau)$, and the
    engine's $S_t$ (SGLang's ``return_sampling_mask``, the kept ids of vLLM's); its kept mass,
    held fixed (not differentiated), is

    $$
    \log K_t = \log \pi_\tau(S_t) = \operatorname{logsumexp}_{v \in S_t} \frac{\theta_{t,v}}{\tau}
    - \operatorname{logsumexp}_{v} \frac{\theta_{t,v}}{\tau} .
    $$

    The trainer's log-prob is the full vocabulary's, or with the engine's mask replayed
    (``trainer_mask=True``) that of the truncated policy $\pi_S = \pi_\tau\, \mathbb{1}_{S_t} /
    K_t$:

    $$
    \log \pi'(y_t) = \log \pi_\tau(y_t) \quad \text{or} \quad
    \log \pi_S(y_t) = \log \pi_\tau(y_t) - \log K_t ,
    $$

    and the reported log-prob is used as it comes (``kept_mass=None``), renormalised on the kept
    set (``"sampler"``), or put on the trainer's full vocabulary (``"trainer"``, TRL's pull
    request #7269):

    $$
    \log \mu'(y_t) = \log \ell(y_t), \qquad \log \ell(y_t) - \log \ell(S_t), \qquad
    \log \ell(y_t) + \log K_t .
    $$

    The log-ratio is $\log \pi'(y_t) - \log \mu'(y_t)$. Renormalised, the tempered log-probs
    are the processed ones, $\log \mu_\tau(y_t) - \log \mu_\tau(S_t) = \log \mu(y_t)$; the
    processed ones have $\ell(S_t) = 1$ and stay. With the trainer's kept mass the ratio is
    $\pi_S(y_t) / \mu(y_t)$, the replayed mask's value, but the gradient of $\log \pi'(y_t)$
    stays the full vocabulary's score $(e_{y_t} - \pi_{\tau, t}) / \tau$; the replayed mask's
    is $(e_{y_t} - \pi_{S, t}) / \tau$ (``engine_toy``'s ``score``). A trainer that does not
    divide by the temperature is ``temperature=1.0`` here (``trainer_temperature=False`` of
    ``engine_toy``): the temperature acts on the trainer's logits only, as the engine's
    side arrives in its reported log-probs and kept sets.

    On the engine toy's enumerated batch each option gives ``engine_toy``'s ``logp_train -
    logp_sampler`` to $10^{-12}$ and its ``score`` as the gradient of ``trainer_logp``
    (``tests/mismatch/test_kept_mass_torch.py``).

    Parameters
    ----------
    trainer_logits : torch.Tensor
        ``(B, T, V)`` floating: the trainer's logits before the temperature; ``-inf`` for an
        impossible token, never NaN or ``+inf`` where ``mask`` is 1; finite at the written
        token.
    sampler_logp : torch.Tensor
        ``(B, T)`` floating: the engine's reported $\log \ell(y_t)$, finite where ``mask`` is 1.
    tokens : torch.Tensor
        ``(B, T)`` integer: the written tokens $y_t$, in ``[0, V)`` where ``mask`` is 1
        (anything elsewhere, such as a padding id of -100).
    kept : torch.Tensor
        ``(B, T, V)`` bool: the engine's kept set $S_t$ of each position; it holds the written
        token where ``mask`` is 1.
    mask : torch.Tensor
        ``(B, T)`` in {0, 1}.
    temperature : float
        $\tau > 0$, by which the trainer divides its logits (the engine's sampling temperature).
    reported : {"processed", "raw", "tempered"}
        Which log-probs ``sampler_logp`` holds (``engine.REPORTED``).
    kept_mass : {None, "sampler", "trainer"}
        The correction (``engine.KEPT_MASS``); ``"trainer"`` is refused with ``trainer_mask``,
        which would count $K_t$ twice.
    trainer_mask : bool
        Whether the trainer renormalises its softmax on $S_t$ (the engine's mask replayed).
    sampler_log_kept : torch.Tensor, optional
        ``(B, T)`` floating, finite where ``mask`` is 1: $\log \ell(S_t)$, the reported
        distribution's mass on the kept set (the engine's log-probs summed over $S_t$). Needed
        by ``kept_mass="sampler"`` with ``reported`` ``"raw"`` or ``"tempered"`` only, and
        refused elsewhere (the processed log-probs have mass 1 on $S_t$).

    Returns
    -------
    KeptMassRatio
        ``log_ratio``, ``trainer_logp`` and ``sampler_logp``, ``(B, T)``, in the compute dtype
        (float32 for half-precision inputs) on the device of ``trainer_logits``, 0 where
        ``mask`` is 0; only ``trainer_logp`` and ``log_ratio`` carry a gradient.

    Examples
    --------
    ``engine_toy``'s example: one position of three tokens, trainer and engine equal, top-p 0.7
    keeps tokens 0 and 1 (mass 0.8). Two responses write one each; the processed log-probs are
    $\log(0.5 / 0.8)$ and $\log(0.3 / 0.8)$. Their ratio is the kept mass 0.8; with the
    trainer's kept mass added, or the mask replayed, it is 1:

    >>> logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]] * 2, dtype=torch.float64))
    >>> tokens, ones = torch.tensor([[0], [1]]), torch.ones(2, 1)
    >>> kept = torch.tensor([[[True, True, False]]] * 2)
    >>> processed = torch.log(torch.tensor([[0.625], [0.375]], dtype=torch.float64))
    >>> def ratios(sampler_logp, **choice):
    ...     out = kept_mass_log_ratio(logits, sampler_logp, tokens, kept, ones,
    ...                               temperature=1.0, **choice)
    ...     return [round(r, 12) for r in out.log_ratio.exp().flatten().tolist()]
    >>> ratios(processed), ratios(processed, kept_mass="trainer")
    ([0.8, 0.8], [1.0, 1.0])
    >>> ratios(processed, trainer_mask=True)
    [1.0, 1.0]

    SGLang's tempered log-probs ($\log 0.5$, $\log 0.3$ at $\tau = 1$) hide the kept mass;
    renormalised by it ($\log \ell(S_t) = \log 0.8$) they are the processed ones:

    >>> tempered = torch.log(torch.tensor([[0.5], [0.3]], dtype=torch.float64))
    >>> log_kept = torch.log(torch.tensor([[0.8], [0.8]], dtype=torch.float64))
    >>> ratios(tempered, reported="tempered")
    [1.0, 1.0]
    >>> ratios(tempered, reported="tempered", kept_mass="sampler", sampler_log_kept=log_kept)
    [0.8, 0.8]

    The score of token 0: $e_0 - \pi = (0.5, -0.3, -0.2)$ on the full vocabulary (the
    trainer's kept mass leaves it so), $e_0 - \pi_S = (0.375, -0.375, 0)$ with the mask:

    >>> theta = logits.clone().requires_grad_(True)
    >>> for choice in (dict(kept_mass="trainer"), dict(trainer_mask=True)):
    ...     out = kept_mass_log_ratio(theta, processed, tokens, kept, ones, temperature=1.0,
    ...                               **choice)
    ...     (score,) = torch.autograd.grad(out.trainer_logp[0, 0], theta)
    ...     print([round(g, 12) for g in score[0, 0].tolist()])
    [0.5, -0.3, -0.2]
    [0.375, -0.375, 0.0]
    """
    mask, dtype, temperature, correct_by = _check_kept_mass_batch(
        trainer_logits, sampler_logp, tokens, kept, mask, temperature, reported, kept_mass,
        trainer_mask, sampler_log_kept)
    keep = mask[..., None]  # (B, T, 1)
    # Padding rows become zeros that keep every token, before any arithmetic: whatever they
    # held (NaN, -inf, an empty kept set) reaches neither the value nor the gradient.
    z = torch.where(keep, trainer_logits.to(dtype), torch.zeros((), dtype=dtype,
                                                                device=trainer_logits.device))
    kept = torch.where(keep, kept, torch.ones_like(kept))
    y = torch.where(mask, tokens, torch.zeros_like(tokens)).to(torch.int64)  # (B, T), in [0, V)
    # theta / tau, shifted by each row's largest logit (a constant the softmax ignores), so
    # that a small temperature cannot overflow it to +inf
    z = (z - z.amax(dim=-1, keepdim=True).detach()) / temperature  # (B, T, V)
    cut = torch.full_like(z, -math.inf)
    lse = torch.logsumexp(z, dim=-1)  # (B, T)
    lse_kept = torch.logsumexp(torch.where(kept, z, cut), dim=-1)  # (B, T), S_t holds y_t
    z_y = z.gather(-1, y[..., None])[..., 0]  # (B, T)
    # log pi_tau(y_t) = z_y - logsumexp(z); log pi_S(y_t) = z_y - logsumexp over S_t
    trainer_logp = z_y - (lse_kept if trainer_mask else lse)
    log_kept_trainer = (lse_kept - lse).detach()  # log K_t = log pi_tau(S_t), held fixed
    reported_logp = sampler_logp.detach().to(dtype)
    if correct_by == "sampler_log_kept":  # log l(y_t) - log l(S_t)
        reported_logp = reported_logp - sampler_log_kept.detach().to(dtype)
    elif correct_by == "trainer":  # log mu(y_t) + log K_t
        reported_logp = reported_logp + log_kept_trainer
    trainer_logp = select(mask, trainer_logp)
    reported_logp = select(mask, reported_logp)
    log_ratio = select(mask, trainer_logp - reported_logp)
    bad = mask & ~torch.isfinite(log_ratio.detach())
    if bool(bad.any()):  # finite inputs whose log-probs or difference leave the dtype's range
        b, t = _first(bad)
        raise ValueError(
            f"the log-ratio at position ({b}, {t}) overflows {dtype}: trainer log-prob "
            f"{trainer_logp[b, t].item()!r} (trainer_logits / temperature at "
            f"temperature={temperature!r}), sampler log-prob {reported_logp[b, t].item()!r}")
    return KeptMassRatio(log_ratio, trainer_logp, reported_logp)


def _check_kept_mass_batch(trainer_logits, sampler_logp, tokens, kept, mask, temperature,
                           reported, kept_mass, trainer_mask, sampler_log_kept):
    """Validate kept_mass_log_ratio's inputs; return the bool mask, the compute dtype, the
    temperature and the correction to apply (None, "sampler_log_kept" or "trainer")."""
    check_float_tensor("trainer_logits", trainer_logits, 3)
    B, T, V = trainer_logits.shape
    if V == 0:
        raise ValueError(f"trainer_logits must have a vocabulary of at least 1 entry, got shape "
                         f"{(B, T, V)} (V = 0)")
    check_float_tensor("sampler_logp", sampler_logp, 2)
    if tuple(sampler_logp.shape) != (B, T):
        raise ValueError(f"sampler_logp must have the shape (B, T) = {(B, T)} of "
                         f"trainer_logits {(B, T, V)}, got {tuple(sampler_logp.shape)}")
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"tokens must have an integer dtype (token ids), got {tokens.dtype}")
    if tuple(tokens.shape) != (B, T):
        raise ValueError(f"tokens must have the shape (B, T) = {(B, T)} of trainer_logits "
                         f"{(B, T, V)}, got {tuple(tokens.shape)}")
    if not isinstance(kept, torch.Tensor):
        raise TypeError(f"kept must be a torch.Tensor, got {type(kept).__name__}")
    if kept.dtype != torch.bool:
        raise TypeError(f"kept must be a bool tensor (True: the engine kept the token), got "
                        f"{kept.dtype}")
    if tuple(kept.shape) != (B, T, V):
        raise ValueError(f"kept must have the shape of trainer_logits {(B, T, V)}, got "
                         f"{tuple(kept.shape)}")
    for name, x in (("sampler_logp", sampler_logp), ("tokens", tokens), ("kept", kept),
                    ("mask", mask)):
        if isinstance(x, torch.Tensor) and x.device != trainer_logits.device:
            raise ValueError(f"{name} must be on the device of trainer_logits "
                             f"({trainer_logits.device}), got {x.device}")
    mask = check_mask(mask, "sampler_logp", (B, T))
    temperature = check_finite_number("temperature", temperature, positive=True)
    check_choice("reported", reported, REPORTED)
    check_choice("kept_mass", kept_mass, KEPT_MASS, allow_none=True)
    if not isinstance(trainer_mask, bool):
        raise TypeError(f"trainer_mask must be True or False, got {trainer_mask!r}")
    if kept_mass == "trainer" and trainer_mask:
        raise ValueError("kept_mass='trainer' with trainer_mask=True counts the trainer's kept "
                         "mass twice: the replayed mask already renormalises the trainer on "
                         "the kept set")
    needs_log_kept = kept_mass == "sampler" and reported != "processed"
    if needs_log_kept and sampler_log_kept is None:
        raise ValueError(f"kept_mass='sampler' with reported={reported!r} needs "
                         "sampler_log_kept, the log of the reported distribution's mass on the "
                         "kept set, (B, T)")
    if not needs_log_kept and sampler_log_kept is not None:
        raise ValueError(f"sampler_log_kept is read only by kept_mass='sampler' with reported "
                         f"'raw' or 'tempered', got kept_mass={kept_mass!r}, "
                         f"reported={reported!r} (the processed log-probs have mass 1 on the "
                         "kept set)")
    if needs_log_kept:
        check_float_tensor("sampler_log_kept", sampler_log_kept, 2)
        check_same_shape("sampler_logp", sampler_logp, "sampler_log_kept", sampler_log_kept)
        if sampler_log_kept.device != trainer_logits.device:
            raise ValueError(f"sampler_log_kept must be on the device of trainer_logits "
                             f"({trainer_logits.device}), got {sampler_log_kept.device}")
    dtype = compute_dtype(trainer_logits, sampler_logp,
                          *([sampler_log_kept] if needs_log_kept else []))
    if 1.0 / temperature > torch.finfo(dtype).max:  # theta / tau would overflow in dtype
        raise ValueError(f"temperature must be at least 1 / (the largest {dtype} number), got "
                         f"{temperature!r}")
    _check_kept_mass_values(trainer_logits.detach(), sampler_logp.detach(), tokens, kept, mask,
                            sampler_log_kept.detach() if needs_log_kept else None)
    correct_by = ("sampler_log_kept" if needs_log_kept
                  else "trainer" if kept_mass == "trainer" else None)
    return mask, dtype, temperature, correct_by


def _first(bad):
    """(b, t) of the first True entry of a (B, T) bool tensor."""
    return tuple(int(i) for i in bad.nonzero()[0])


def _check_kept_mass_values(logits, sampler_logp, tokens, kept, mask, sampler_log_kept):
    """The values kept_mass_log_ratio reads, where ``mask`` is 1: each error names the argument
    and the first position that breaks it."""
    V = logits.shape[-1]
    outside = mask & ((tokens < 0) | (tokens >= V))
    if bool(outside.any()):
        b, t = _first(outside)
        raise ValueError(f"tokens must be token ids in [0, {V}) where mask is 1, got "
                         f"{int(tokens[b, t])} at position ({b}, {t})")
    for what, bad in (("NaN", torch.isnan(logits)), ("+inf", logits == math.inf)):
        bad = mask & bad.any(dim=-1)
        if bool(bad.any()):
            b, t = _first(bad)
            raise ValueError(f"trainer_logits must not hold {what} where mask is 1 (a logit is "
                             f"a number, or -inf for an impossible token), got {what} at "
                             f"position ({b}, {t})")
    y = torch.where(mask, tokens, torch.zeros_like(tokens)).to(torch.int64)[..., None]
    written = logits.gather(-1, y)[..., 0]
    bad = mask & ~torch.isfinite(written)
    if bool(bad.any()):
        b, t = _first(bad)
        raise ValueError(f"trainer_logits must be finite at the written token where mask is 1 "
                         f"(the trainer gives it probability 0 otherwise), got "
                         f"{written[b, t].item()!r} at position ({b}, {t}), token "
                         f"{int(tokens[b, t])}")
    bad = mask & ~kept.gather(-1, y)[..., 0]
    if bool(bad.any()):
        b, t = _first(bad)
        raise ValueError(f"kept must hold the written token where mask is 1 (the engine writes "
                         f"only kept tokens), got False at position ({b}, {t}) for token "
                         f"{int(tokens[b, t])}")
    for name, x in (("sampler_logp", sampler_logp), ("sampler_log_kept", sampler_log_kept)):
        if x is None:
            continue
        bad = mask & ~torch.isfinite(x)
        if bool(bad.any()):
            b, t = _first(bad)
            raise ValueError(f"{name} must be finite where mask is 1 (the written token has a "
                             f"probability > 0), got {x[b, t].item()!r} at position ({b}, {t})")
        bad = mask & (x > 0)
        if bool(bad.any()):
            b, t = _first(bad)
            raise ValueError(f"{name} must be <= 0 where mask is 1 (the log of a probability), "
                             f"got {x[b, t].item()!r} at position ({b}, {t})")
    if sampler_log_kept is not None:
        # a kept set of one token gives the two the same value, to its rounding
        slack = 8 * torch.finfo(sampler_logp.dtype).eps * (1 + sampler_log_kept.abs())
        bad = mask & (sampler_logp > sampler_log_kept + slack)
        if bool(bad.any()):
            b, t = _first(bad)
            raise ValueError(f"sampler_logp must be <= sampler_log_kept where mask is 1 (the "
                             f"written token is one of the kept set's tokens), got "
                             f"{sampler_logp[b, t].item()!r} > {sampler_log_kept[b, t].item()!r} "
                             f"at position ({b}, {t})")


# ---------------------------------------------------------------------------------------------
# Group baselines under a rejection
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards, kept, baseline, eps=VERL_EPSILON):
    r"""The torch form of [opd_literate.mismatch.groups.group_advantages][]: the advantages of
    groups of answers, where a rejection keeps some of them, 0 for the rejected ones.

    With $S$ the answers the statistics run over (every answer of the group for the ``_all``
    choices, the kept ones for ``_kept``) and $n = |S|$: ``grpo`` $A_i = R_i - \bar R_S$,
    ``grpo_std`` $A_i = (R_i - \bar R_S) / (\sigma_S + \varepsilon)$ with the sample standard
    deviation (divisor $n - 1$, as ``torch.std``), ``rloo`` $A_i = (n R_i - \sum_S R) / (n - 1)$,
    the reward less the mean of the others; a set of one answer has mean 0 and deviation 1,
    as verl's one-answer prompt. verl's ``compute_grpo_outcome_advantage`` and
    ``compute_rloo_outcome_advantage`` compute the ``_all`` choices
    ([opd_literate.mismatch.groups.VERL_CHOICES][]: its rejection masks the loss, not the
    group's statistics); [opd_literate.mismatch.groups][] gives each choice's exact bias.

    Parameters
    ----------
    rewards : torch.Tensor
        ``(..., G)`` floating, finite; the last dimension is the group. Half precision is
        computed in float32.
    kept : torch.Tensor
        ``(..., G)`` bool, the shape of ``rewards``: True where the rejection keeps the answer.
    baseline : str
        One of [opd_literate.mismatch.groups.BASELINES][].
    eps : float
        $\varepsilon > 0$ of the ``grpo_std`` choices (verl's ``epsilon``, 1e-6).

    Returns
    -------
    torch.Tensor
        ``(..., G)`` in the compute dtype, on the device of ``rewards``, detached; 0 where
        ``kept`` is False.

    Examples
    --------
    Rewards $(1, 0, 1, 0)$, the last answer rejected. RLOO over all four gives answer 1 the
    baseline $(0 + 1 + 0) / 3$; over the three kept, $(0 + 1) / 2$:

    >>> r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    >>> kept = torch.tensor([True, True, True, False])
    >>> group_advantages(r, kept, "rloo_all").round(decimals=4).tolist()
    [0.6667, -0.6667, 0.6667, 0.0]
    >>> group_advantages(r, kept, "rloo_kept").round(decimals=4).tolist()
    [0.5, -1.0, 0.5, 0.0]
    >>> group_advantages(r, kept, "grpo_std_all").round(decimals=4).tolist()  # 0.5 / sqrt(1/3)
    [0.866, -0.866, 0.866, 0.0]
    """
    check_float_tensor("rewards", rewards, None)
    if rewards.ndim < 1 or rewards.shape[-1] < 1:
        raise ValueError(f"rewards must have shape (..., G) with G >= 1, got "
                         f"{tuple(rewards.shape)}")
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool:
        raise TypeError(f"kept must be a bool torch.Tensor, got "
                        f"{getattr(kept, 'dtype', type(kept).__name__)}")
    check_same_shape("rewards", rewards, "kept", kept)
    if kept.device != rewards.device:
        raise ValueError(f"kept must be on the device of rewards ({rewards.device}), got "
                         f"{kept.device}")
    if not isinstance(baseline, str) or baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    eps = check_finite_number("eps", eps, positive=True)
    r = rewards.detach().to(compute_dtype(rewards))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite, got a NaN or inf")
    family, over = baseline.rsplit("_", 1)  # "grpo" | "grpo_std" | "rloo", "all" | "kept"
    member = kept if over == "kept" else torch.ones_like(kept)  # the set S of the statistics
    n = member.sum(dim=-1, keepdim=True).to(r.dtype)  # |S|, (..., 1)
    total = torch.where(member, r, torch.zeros_like(r)).sum(dim=-1, keepdim=True)
    alone = n <= 1  # verl's one-answer prompt: mean 0, std 1
    many = torch.clamp(n, min=2)  # a divisor that is never 0 or 1 where it is used
    if family == "rloo":
        # R_i - mean of the others in S = (n R_i - sum_S R) / (n - 1)
        advantage = torch.where(alone, r, (n * r - total) / (many - 1))
    else:
        mean = torch.where(alone, torch.zeros_like(total), total / many)
        advantage = r - mean
        if family == "grpo_std":
            deviation = torch.where(member, (r - mean) ** 2, torch.zeros_like(r))
            std = torch.where(alone, torch.ones_like(n),
                              torch.sqrt(deviation.sum(dim=-1, keepdim=True) / (many - 1)))
            if not bool(torch.isfinite(std).all()):  # A / inf would be a silent 0
                raise ValueError(f"the advantages overflow {r.dtype}: rewards up to "
                                 f"{float(r.abs().max()):.3g} are too large for the group's "
                                 "squared deviations")
            advantage = advantage / (std + eps)
    advantage = select(kept, advantage)  # a rejected answer trains nothing
    if not bool(torch.isfinite(advantage).all()):
        raise ValueError(f"the advantages overflow {r.dtype}: rewards up to "
                         f"{float(r.abs().max()):.3g} are too large for the group's sums")
    return advantage
