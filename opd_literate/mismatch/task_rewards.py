r"""OPD with task rewards: one gradient for the reward and the teacher, and which estimates of it
are unbiased.

verl's on-policy distillation trainer adds the task's policy gradient to the distillation loss
(``use_task_rewards: true`` with ``distillation_loss_coef`` $\lambda = 1$ in the config its
trainer composes, ``VERL_DISTILLATION``), and KDRL-style training mixes GRPO with a reverse KL
to the teacher. The objective they ascend is

$$
F_\lambda(\theta) = J(\theta) - \lambda\, \mathcal{K}(\theta), \qquad
J = \mathbb{E}_\pi[R], \qquad \mathcal{K} = \mathrm{KL}(\pi(y) \,\|\, \pi_T(y)),
$$

the expected reward minus $\lambda$ times the sequence reverse KL to the teacher, with the exact
gradient $\nabla F_\lambda = \nabla J - \lambda \nabla \mathcal{K}$ (``true_grad`` and
``kl_grad`` of [opd_literate.mismatch.opd_mismatch.add_teacher][]). Each estimator below is the
task's REINFORCE term $\sum_t (R - b)\, s_t$ minus $\lambda$ times one way of estimating the
teacher's part from the same sampled response, with $d_t = \log \pi(y_t) - \log \pi_T(y_t)$ (the
trainer's log-probs) and the score $s_t = \nabla \log \pi(y_t)$:

* ``k1_reward``: the per-token OPD reward $-d_t$ with discount 0, $\sum_t d_t s_t$ (sampled-token
  OPD, and verl's ``use_policy_gradient: true`` with ``loss_mode: k1``). Backpropagating $k_2 =
  \frac12 d_t^2$ as a loss gives the same estimate, sample for sample.
* ``k1_return``: the same reward summed to the end of the response (discount 1),
  $\sum_t \bigl(\sum_{k \ge t} d_k\bigr) s_t$.
* ``k3_reward``: $k_3 = e^{-d_t} - 1 + d_t$ as the per-token cost, $\sum_t k_{3,t}\, s_t$
  (``loss_mode: k3`` with ``use_policy_gradient: true``, the defaults of verl's
  ``DistillationLossConfig`` dataclass built without the YAML, ``DATACLASS_DISTILLATION``).
* ``k3_loss``: $k_3$ backpropagated as a loss, whose gradient is $\sum_t (1 - e^{-d_t})\, s_t$:
  what a stock ``python -m verl.trainer.main_ppo`` run computes (``loss_mode: k3``,
  ``use_policy_gradient: false`` in the composed config, ``VERL_KIND``).
* ``full_vocab``: the exact gradient of the per-state reverse KL at each visited state,
  $\sum_t \nabla_\theta \mathrm{KL}(\pi(\cdot \mid y_{<t}) \,\|\, \pi_T(\cdot \mid y_{<t}))$, the
  full-vocabulary loss of [opd_literate.opd.full_vocab_reverse_kl][].

**What they estimate, exactly.** On-policy ($\mu = \pi$), with the per-state gradient
$\nabla^{\mathrm{state}} \mathcal{K} = \mathbb{E}_\pi[\sum_t d_t s_t]$ (``kl_grad_per_state``),

$$
\mathbb{E}[\hat g_{\texttt{k1\_return}}] = \nabla J - \lambda \nabla \mathcal{K}, \qquad
\mathbb{E}[\hat g_{\texttt{k1\_reward}}] = \mathbb{E}[\hat g_{\texttt{full\_vocab}}]
= \nabla J - \lambda \nabla^{\mathrm{state}} \mathcal{K}.
$$

So only the reward summed to the end of the response is unbiased for $\nabla F_\lambda$ at every
$\lambda$; discount 0 and the full-vocabulary loss leave out how a token changes the states after
it, a bias of exactly $\lambda \lVert \nabla \mathcal{K} - \nabla^{\mathrm{state}} \mathcal{K}
\rVert$, growing linearly with the mixing weight (0 for independent positions, where the two
gradients are equal). They are unbiased for the per-state objective instead, the full-vocabulary
one with less variance. ``k3_loss`` estimates the per-state **forward** KL's gradient and
``k3_reward`` no KL gradient at all (the OPD chapter's table of $k_1, k_2, k_3$), so both are
biased at every $\lambda > 0$. At $\lambda = 0$ every estimator is REINFORCE on the task reward,
unbiased on-policy. Under a mismatched sampler none of them is unbiased without a correction.

The sums run over the response's tokens (the ``seq-mean-token-sum`` reduction); the other
reductions reweight the tokens (the mismatch chapter's table of reductions).

**Checks.** A toy must carry a teacher (``add_teacher``): its log-probabilities ``(M, T)`` of the
shape of ``toy["Y"]``, finite and $\le 0$ at the response's tokens (padding may hold anything),
the score of the shape ``(M,) + theta.shape``, finite ``theta`` and ``phi`` of one shape; a
mixing weight is a finite number $\ge 0$, a batch size an integer $\ge 1$, and ``kinds`` and
``coefs`` are sequences (a bare string or number is a ``TypeError``).
"""

from __future__ import annotations

import numpy as np

from .._numerics import check_finite_number
from .estimators import weighted_score
from .opd_mismatch import add_teacher, opd_estimate  # noqa: F401 (the examples use add_teacher)
from .toy import (  # noqa: F401 (the examples use make_ar_toy and toy_from_logits)
    check_toy,
    estimator_moments,
    log_softmax,
    make_ar_toy,
    response_mask,
    toy_from_logits,
)

__all__ = ["MIXED_ESTIMATORS", "VERL_DISTILLATION", "DATACLASS_DISTILLATION", "VERL_KINDS",
           "VERL_KIND", "DATACLASS_KIND", "teacher_estimate", "mixed_estimate", "mixed_targets",
           "mixed_table"]

MIXED_ESTIMATORS = ("k1_reward", "k1_return", "k3_reward", "k3_loss", "full_vocab")
"""The ways of estimating the teacher's part of the gradient (module docstring)."""

VERL_DISTILLATION = {"loss_mode": "k3", "use_policy_gradient": False, "use_task_rewards": True,
                     "distillation_loss_coef": 1.0}
"""verl 0.9.1's ``distillation.distillation_loss`` as its trainer composes it
(``verl/trainer/config/distillation/distillation.yaml``): what ``python -m
verl.trainer.main_ppo`` gets unless the user sets it."""

DATACLASS_DISTILLATION = {"loss_mode": "k3", "use_policy_gradient": True, "use_task_rewards": True,
                          "distillation_loss_coef": 1.0}
"""The defaults of verl 0.9.1's ``DistillationLossConfig`` dataclass
(``verl/workers/config/distillation.py``), which the composed config overrides."""

VERL_KINDS = {("k3", False): "k3_loss", ("k3", True): "k3_reward", ("k1", True): "k1_reward",
              ("k2", False): "k1_reward"}
"""verl's ``(loss_mode, use_policy_gradient)`` and the estimate of the teacher's part it makes:
the per-token loss backpropagated (``False``) or its negative as the advantage (``True``)."""

VERL_KIND = VERL_KINDS[VERL_DISTILLATION["loss_mode"], VERL_DISTILLATION["use_policy_gradient"]]
"""``"k3_loss"``: the teacher's part of a stock verl run."""

DATACLASS_KIND = VERL_KINDS[DATACLASS_DISTILLATION["loss_mode"],
                            DATACLASS_DISTILLATION["use_policy_gradient"]]
"""``"k3_reward"``: the teacher's part with the dataclass's defaults."""


def _check_kind(kind):
    if kind not in MIXED_ESTIMATORS:
        raise ValueError(f"kind must be one of {MIXED_ESTIMATORS}, got {kind!r}")
    return kind


def _check_coef(coef):
    return check_finite_number("coef", coef, low=0.0)


def _check_sequence(name, values):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence, got {type(values).__name__} {values!r}")
    values = list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    return values


def _check_real(name, value, shape):
    array = np.asarray(value)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"toy[{name!r}] must hold real numbers, got dtype {array.dtype}")
    if shape is not None and array.shape != tuple(shape):
        raise ValueError(f"toy[{name!r}] must have shape {tuple(shape)}, got {array.shape}")
    return array


def _check_teacher_toy(toy):
    """Raise unless ``toy`` carries a teacher with consistent shapes and log-probabilities."""
    check_toy(toy, keys=("Y", "logp_train", "logp_teacher", "score", "phi", "theta"))
    theta = _check_real("theta", toy["theta"], None)
    _check_real("phi", toy["phi"], theta.shape)
    for name in ("theta", "phi"):
        if not np.isfinite(np.asarray(toy[name])).all():
            raise ValueError(f"toy[{name!r}] must be finite")
    M_T = np.shape(toy["Y"])
    _check_real("score", toy["score"], M_T[:1] + theta.shape)
    real = response_mask(toy)
    if real.shape != M_T or not np.isin(real, (0.0, 1.0)).all():
        raise ValueError(f"toy['mask'] must be 0/1 of the shape of toy['Y'] {M_T}")
    for name in ("logp_train", "logp_teacher"):
        logp = _check_real(name, toy[name], M_T)
        inside = logp[real > 0]
        if np.isnan(inside).any() or (inside > 0).any() or np.isinf(inside).any():
            raise ValueError(f"toy[{name!r}] must hold finite log-probabilities (<= 0) at the "
                             f"response's tokens")


def _per_token(values, score):
    """(M, T) per-token factors times the score, (M, T, V) or (M, T, V + 1, V)."""
    extra = (1,) * (np.ndim(score) - 2)
    return values.reshape(values.shape + extra) * score


def _full_vocab_gradients(toy):
    r"""Per sequence, the sum over its states of $\nabla_\theta \mathrm{KL}(\pi \| \pi_T)$ there.

    For a softmax row, $\partial \mathrm{KL} / \partial \theta_v = \pi_v (\log \pi_v - \log q_v
    - \mathrm{KL})$; a state's gradient lands in its own row of the parameters.
    """
    log_pi, log_q = log_softmax(np.asarray(toy["theta"])), log_softmax(np.asarray(toy["phi"]))
    pi = np.exp(log_pi)
    kl_rows = (pi * (log_pi - log_q)).sum(axis=-1, keepdims=True)
    row_gradients = pi * (log_pi - log_q - kl_rows)  # (T, V) or (T, V + 1, V)
    M, T = toy["Y"].shape
    if row_gradients.ndim == 2:  # independent positions: every response visits every row
        return np.broadcast_to(row_gradients, (M,) + row_gradients.shape).copy()
    real = response_mask(toy) > 0
    estimate = np.zeros((M,) + row_gradients.shape)
    m, t = np.nonzero(real)
    estimate[m, t, toy["prev"][m, t]] = row_gradients[t, toy["prev"][m, t]]
    return estimate


def teacher_estimate(toy, kind="k1_reward"):
    r"""Per-sequence estimate of the teacher's part, $\nabla \mathcal{K}$ or what stands for it.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.opd_mismatch.add_teacher][].
    kind : str
        One of ``MIXED_ESTIMATORS`` (module docstring).

    Returns
    -------
    numpy.ndarray
        The shape of ``toy["score"]``: $\hat k_m$, to be subtracted ($\lambda$ times) from the
        task's estimate.

    Examples
    --------
    One position, two tokens, on-policy: every kind but ``k3_loss`` and ``k3_reward`` averages
    to the reverse KL's gradient (positions are independent, so the per-state gradient is the
    sequence one):

    >>> logits = np.log([[0.7, 0.3]])
    >>> toy = add_teacher(toy_from_logits(logits, logits), phi=np.log([[0.4, 0.6]]))
    >>> for kind in MIXED_ESTIMATORS:
    ...     mean = toy["p_sampler"] @ teacher_estimate(toy, kind).reshape(2, -1)
    ...     print(kind, np.allclose(mean, toy["kl_grad"].ravel(), atol=1e-15))
    k1_reward True
    k1_return True
    k3_reward False
    k3_loss False
    full_vocab True
    """
    _check_teacher_toy(toy)
    kind = _check_kind(kind)
    real = response_mask(toy) > 0
    # padding is selected away before any arithmetic: whatever it holds reaches no estimate
    toy = dict(toy, **{name: np.where(real, toy[name], 0.0)
                       for name in ("logp_train", "logp_teacher")})
    if kind == "k1_reward":
        return opd_estimate(toy, "trainer", "none", gamma=0.0)
    if kind == "k1_return":
        return opd_estimate(toy, "trainer", "none", gamma=1.0)
    if kind == "full_vocab":
        return _full_vocab_gradients(toy)
    mask = response_mask(toy) > 0
    d = np.where(mask, toy["logp_train"] - toy["logp_teacher"], 0.0)
    if kind == "k3_reward":
        # k3 = e^{-d} - 1 + d, computed with expm1 (no cancellation at small d)
        return _per_token(np.where(mask, np.expm1(-d) + d, 0.0), toy["score"])
    # k3_loss: d k3 / d log pi(y_t) = 1 - e^{-d}
    return _per_token(np.where(mask, -np.expm1(-d), 0.0), toy["score"])


def mixed_estimate(toy, coef, kind="k1_reward", baseline=0.0):
    r"""Per-sequence estimate of $\nabla F_\lambda$: $\sum_t (R - b)\, s_t - \lambda \hat k$.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.opd_mismatch.add_teacher][].
    coef : float
        $\lambda \ge 0$ (verl's ``distillation_loss_coef``).
    kind : str
        How the teacher's part is estimated (``MIXED_ESTIMATORS``).
    baseline : float
        $b$ of the task's advantage.

    Returns
    -------
    numpy.ndarray
        The shape of ``toy["score"]``.
    """
    coef = _check_coef(coef)
    task = weighted_score(toy, np.ones(len(toy["Y"])), baseline)
    return task - coef * teacher_estimate(toy, kind)


def mixed_targets(toy, coef):
    r"""``{"sequence": ∇J - λ∇K, "per_state": ∇J - λ∇^state K}``, the two exact gradients."""
    check_toy(toy, keys=("true_grad", "kl_grad", "kl_grad_per_state"))
    coef = _check_coef(coef)
    return {"sequence": toy["true_grad"] - coef * toy["kl_grad"],
            "per_state": toy["true_grad"] - coef * toy["kl_grad_per_state"]}


def mixed_table(toy, coefs, kinds=MIXED_ESTIMATORS, N=64, baseline=0.0):
    r"""Exact bias and error of every mixed estimator at every mixing weight.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.opd_mismatch.add_teacher][].
    coefs : sequence of float
        The mixing weights $\lambda \ge 0$.
    kinds : sequence of str
        From ``MIXED_ESTIMATORS``.
    N : int
        Batch size for ``rel_rmse``.
    baseline : float
        $b$ of the task's advantage.

    Returns
    -------
    list of dict
        One row per (kind, coef): ``rel_bias`` against $\nabla F_\lambda$ (the sequence KL),
        ``rel_bias_per_state`` against $\nabla J - \lambda \nabla^{\mathrm{state}}
        \mathcal{K}$, ``var`` (one sample) and ``rel_rmse`` at ``N`` against $\nabla F_\lambda$.

    Examples
    --------
    >>> toy = add_teacher(make_ar_toy(mismatch=0.0))
    >>> rows = mixed_table(toy, [0.0, 1.0], kinds=["k1_return", "k1_reward"])
    >>> [(r["kind"], r["coef"]) for r in rows if r["rel_bias"] > 1e-12]  # the biased ones
    [('k1_reward', 1.0)]
    """
    kinds = [_check_kind(kind) for kind in _check_sequence("kinds", kinds)]
    coefs = [_check_coef(coef) for coef in _check_sequence("coefs", coefs)]
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1:
        raise ValueError(f"N must be an integer >= 1, got {N!r}")
    rows = []
    task = weighted_score(toy, np.ones(len(toy["Y"])), baseline)  # the same for every kind
    for kind in kinds:
        teacher = teacher_estimate(toy, kind)
        for coef in coefs:
            targets = mixed_targets(toy, coef)
            estimate = task - coef * teacher
            sequence = estimator_moments(dict(toy, true_grad=targets["sequence"]), estimate)
            state = estimator_moments(dict(toy, true_grad=targets["per_state"]), estimate)
            rows.append(dict(kind=kind, coef=coef, rel_bias=sequence["rel_bias"],
                             rel_bias_per_state=state["rel_bias"], var=sequence["var"],
                             rel_rmse=sequence["rel_rmse"](N)))
    return rows
