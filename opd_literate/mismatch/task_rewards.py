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
  ``use_policy_gradient: false`` in the composed config, ``VERL_KIND``) wherever
  $k_{3,t} \le 10$ at every token (verl's clamps, below).
* ``full_vocab``: the exact gradient of the per-state reverse KL at each visited state,
  $\sum_t \nabla_\theta \mathrm{KL}(\pi(\cdot \mid y_{<t}) \,\|\, \pi_T(\cdot \mid y_{<t}))$, the
  full-vocabulary loss of [opd_literate.opd.full_vocab_reverse_kl][].

**verl's clamps.** verl 0.9.1's ``kl_penalty_forward`` (``verl/trainer/ppo/core_algos.py``,
lines 2242 and 2245) clamps $-d_t$ to $[-20, 20]$, then $k_3$ to $[-10, 10]$. As $k_3 \ge 0$ is
convex in $d_t$ with $k_3 > 10$ wherever $|d_t| \ge 20$, verl's cost is exactly
$\min(k_{3,t}, 10)$, and its gradient with respect to $\log \pi(y_t)$ is $1 - e^{-d_t}$ where
$k_{3,t} \le 10$ (torch's clamp passes the gradient at its bound) and 0 beyond. So both $k_3$
kinds are verl's exactly where $d_- \le d_t \le d_+$ at every token, $d_- \approx -2.61087$ and
$d_+ \approx 10.99998$ (the roots of $k_3 = 10$), as on the chapter's toy (largest $k_3$ 1.67);
``verl_clamps=True`` computes verl's arithmetic at every $d_t$ instead (the cost
$\min(k_{3,t}, 10)$ for ``k3_reward``, the factor 0 beyond the clamp for ``k3_loss``). verl's
``k1`` and ``k2`` are not clamped, so the other kinds are verl's at every $d_t$, with or without
the option. Without the clamps a gap $d_t < -709.78$ makes $e^{-d_t}$ overflow float64: the
$k_3$ kinds then raise a ``ValueError`` rather than return an infinite estimate.

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
gradients are equal). They are unbiased for the per-state objective instead; neither has the
smaller variance in general. At $\lambda = 0$ they are the same estimator; on the chapter's toy
the full-vocabulary one has the smaller variance at every $\lambda > 0$ of its table, and on one
position with $\pi = (0.7, 0.3)$, $\pi_T = (0.4, 0.6)$, $R = (1, 0)$, $\lambda = 1$, $b = 0.5$
the sampled one has (variance 0.00578 against 0.0168: its $d_t$ offsets the task's advantage,
while the full-vocabulary term is the same for every response). Unclamped, ``k3_loss`` estimates the
per-state **forward** KL's gradient and ``k3_reward`` no KL gradient at all (the OPD chapter's
table of $k_1, k_2, k_3$), so both are biased at every $\lambda > 0$. At $\lambda = 0$ every
estimator is REINFORCE on the task reward, unbiased on-policy. Under a mismatched sampler none of
them is unbiased without a correction.

The sums run over the response's tokens (the ``seq-mean-token-sum`` reduction); the other
reductions reweight the tokens (the mismatch chapter's table of reductions).

**Checks.** A toy must carry a teacher (``add_teacher``): its log-probabilities ``(M, T)`` of the
shape of ``toy["Y"]``, finite and $\le 0$ at the response's tokens (padding may hold anything),
a finite score of the shape ``(M,) + theta.shape``, finite ``theta`` and ``phi`` of one shape,
and for ``full_vocab`` on the autoregressive toy integer ``prev`` rows in ``[0, V + 1)`` at the
response's tokens; ``mixed_targets`` wants finite ``true_grad``, ``kl_grad`` and
``kl_grad_per_state`` of one shape (nothing is broadcast). A mixing weight is a finite number
$\ge 0$, a batch size an integer in $[1, 2^{53}]$ (exact as a float), ``verl_clamps`` a bool,
and ``kinds`` and ``coefs`` are sequences (a bare string or number is a ``TypeError``). A finite
input whose estimate overflows float64 raises a ``ValueError``; no NaN or infinity comes out.
"""

from __future__ import annotations

import numpy as np

from .._numerics import check_finite_number, check_sequence
from .estimators import weighted_score
from .opd_mismatch import add_teacher, opd_estimate  # noqa: F401 (the examples use add_teacher)
from .toy import (  # noqa: F401 (the examples use make_ar_toy, make_toy, toy_from_logits)
    check_toy,
    estimator_moments,
    log_softmax,
    make_ar_toy,
    make_toy,
    response_mask,
    toy_from_logits,
)

__all__ = ["MIXED_ESTIMATORS", "VERL_DISTILLATION", "DATACLASS_DISTILLATION", "VERL_KINDS",
           "VERL_KIND", "DATACLASS_KIND", "VERL_K3_CLAMP", "MAX_BATCH", "teacher_estimate",
           "mixed_estimate", "mixed_targets", "mixed_table"]

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


VERL_K3_CLAMP = 10.0
"""verl 0.9.1's bound on its $k_3$ cost, ``torch.clamp(kld, min=-10, max=10)``
(``verl/trainer/ppo/core_algos.py`` line 2245; the clamp of $-d$ to $[-20, 20]$ at line 2242 only
acts where this one already does)."""

MAX_BATCH = 2**53
"""The largest batch size ``mixed_table`` takes: every integer up to it is exact as a float."""


def _check_kind(kind):
    if kind not in MIXED_ESTIMATORS:
        raise ValueError(f"kind must be one of {MIXED_ESTIMATORS}, got {kind!r}")
    return kind


def _check_coef(coef):
    return check_finite_number("coef", coef, low=0.0)


def _check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _check_finite_result(what, array, hint):
    if not np.isfinite(array).all():
        raise ValueError(f"{what} overflows float64 (not representable); {hint}")
    return array


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
    score = _check_real("score", toy["score"], M_T[:1] + theta.shape)
    if not np.isfinite(score).all():
        raise ValueError("toy['score'] must be finite")
    real = response_mask(toy)
    if real.shape != M_T or not np.isin(real, (0.0, 1.0)).all():
        raise ValueError(f"toy['mask'] must be 0/1 of the shape of toy['Y'] {M_T}")
    for name in ("logp_train", "logp_teacher"):
        logp = _check_real(name, toy[name], M_T)
        inside = logp[real > 0]
        if np.isnan(inside).any() or (inside > 0).any() or np.isinf(inside).any():
            raise ValueError(f"toy[{name!r}] must hold finite log-probabilities (<= 0) at the "
                             f"response's tokens")


def _per_token(values, score, real):
    """(M, T) per-token factors times the score, (M, T, V) or (M, T, V + 1, V), 0 at padding."""
    shape = values.shape + (1,) * (np.ndim(score) - 2)
    with np.errstate(over="ignore", invalid="ignore"):
        product = values.reshape(shape) * score
    # selected, not multiplied by 0: whatever a padded position's row holds reaches no estimate
    return np.where(real.reshape(shape), product, 0.0)


def _check_prev(toy, rows):
    """The AR toy's ``prev`` (M, T): integer rows of the parameters in ``[0, rows)`` where real."""
    check_toy(toy, keys=("prev",))
    prev = np.asarray(toy["prev"])
    if prev.shape != np.shape(toy["Y"]) or not np.issubdtype(prev.dtype, np.integer):
        raise ValueError(f"toy['prev'] must be integers of the shape of toy['Y'] "
                         f"{np.shape(toy['Y'])}, got {prev.dtype} {prev.shape}")
    inside = prev[response_mask(toy) > 0]
    if ((inside < 0) | (inside >= rows)).any():
        raise ValueError(f"toy['prev'] must hold rows in [0, {rows}) at the response's tokens, "
                         f"got values in [{inside.min()}, {inside.max()}]")
    return prev


def _full_vocab_gradients(toy):
    r"""Per sequence, the sum over its states of $\nabla_\theta \mathrm{KL}(\pi \| \pi_T)$ there.

    For a softmax row, $\partial \mathrm{KL} / \partial \theta_v = \pi_v (\log \pi_v - \log q_v
    - \mathrm{KL})$; a state's gradient lands in its own row of the parameters.
    """
    log_pi, log_q = log_softmax(np.asarray(toy["theta"])), log_softmax(np.asarray(toy["phi"]))
    pi = np.exp(log_pi)
    kl_rows = (pi * (log_pi - log_q)).sum(axis=-1, keepdims=True)
    row_gradients = pi * (log_pi - log_q - kl_rows)  # (T, V) or (T, V + 1, V)
    M, T = np.shape(toy["Y"])
    real = response_mask(toy) > 0
    if row_gradients.ndim == 2:  # independent positions: every response visits its real rows
        return np.where(real[..., None], row_gradients[None], 0.0)
    prev = _check_prev(toy, row_gradients.shape[1])
    estimate = np.zeros((M,) + row_gradients.shape)
    m, t = np.nonzero(real)
    estimate[m, t, prev[m, t]] = row_gradients[t, prev[m, t]]
    return estimate


def _k3_factor(d, kind, verl_clamps):
    """Per-token factor of the score: the cost $k_3$ or its derivative $1 - e^{-d}$."""
    with np.errstate(over="ignore"):
        k3 = np.expm1(-d) + d  # e^{-d} - 1 + d with expm1 (no cancellation at small d); inf on
        #                        overflow, never NaN (d is finite)
        slope = -np.expm1(-d)
    if verl_clamps:
        inside = k3 <= VERL_K3_CLAMP  # torch's clamp passes the gradient at its bound
        if kind == "k3_reward":
            return np.where(inside, k3, VERL_K3_CLAMP)
        return np.where(inside, slope, 0.0)
    factor = k3 if kind == "k3_reward" else slope
    if not np.isfinite(factor).all():
        raise ValueError(f"{kind}: e^(-d) overflows float64 at d = {float(d.min()):.6g} "
                         "(d = log pi - log pi_T < -709.78 is not representable); "
                         "verl_clamps=True gives verl's clamped, finite value")
    return factor


def teacher_estimate(toy, kind="k1_reward", verl_clamps=False):
    r"""Per-sequence estimate of the teacher's part, $\nabla \mathcal{K}$ or what stands for it.

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.opd_mismatch.add_teacher][].
    kind : str
        One of ``MIXED_ESTIMATORS`` (module docstring).
    verl_clamps : bool
        Whether the $k_3$ kinds clamp the cost at ``VERL_K3_CLAMP`` as verl 0.9.1 does (module
        docstring, "verl's clamps"); the other kinds do not depend on it.

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

    verl's clamp: a trainer log-probability of -5 where the teacher's is -1 is a gap $d = -4$,
    $k_3 = e^4 - 5 > 10$; unclamped, ``k3_loss``'s factor of the score is $1 - e^4$, verl's
    gradient there is 0 (and its ``k3_reward`` cost 10):

    >>> far = dict(toy, logp_train=np.array([[-5.0], [-5.0]]),
    ...            logp_teacher=np.array([[-1.0], [-1.0]]))
    >>> s = far["score"][0, 0, 0]  # 0.3, the score's first entry of response 0
    >>> print(round(teacher_estimate(far, "k3_loss")[0, 0, 0] / s, 4), round(1 - np.e**4, 4))
    -53.5982 -53.5982
    >>> print(teacher_estimate(far, "k3_loss", verl_clamps=True)[0, 0, 0],
    ...       round(teacher_estimate(far, "k3_reward", verl_clamps=True)[0, 0, 0] / s, 12))
    0.0 10.0
    """
    _check_teacher_toy(toy)
    kind = _check_kind(kind)
    verl_clamps = _check_flag("verl_clamps", verl_clamps)
    real = response_mask(toy) > 0
    # padding is selected away before any arithmetic: whatever it holds reaches no estimate
    toy = dict(toy, **{name: np.where(real, np.asarray(toy[name], dtype=np.float64), 0.0)
                       for name in ("logp_train", "logp_teacher")})
    if kind in ("k1_reward", "k1_return"):
        with np.errstate(over="ignore", invalid="ignore"):  # checked below, by name
            estimate = opd_estimate(toy, "trainer", "none", gamma=float(kind == "k1_return"))
    elif kind == "full_vocab":
        estimate = _full_vocab_gradients(toy)
    else:  # k3_reward: the cost k3 as the reward; k3_loss: d k3 / d log pi(y_t) = 1 - e^{-d}
        d = toy["logp_train"] - toy["logp_teacher"]  # 0 at padding (selected above)
        factor = np.where(real, _k3_factor(d, kind, verl_clamps), 0.0)
        estimate = _per_token(factor, np.asarray(toy["score"]), real)
    return _check_finite_result(f"teacher_estimate({kind!r})", estimate,
                                "a finite factor times the score went beyond float64's range")


def mixed_estimate(toy, coef, kind="k1_reward", baseline=0.0, verl_clamps=False):
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
    verl_clamps : bool
        As in ``teacher_estimate``.

    Returns
    -------
    numpy.ndarray
        The shape of ``toy["score"]``.
    """
    coef = _check_coef(coef)
    teacher = teacher_estimate(toy, kind, verl_clamps)
    task = weighted_score(toy, np.ones(len(toy["Y"])), baseline)
    return _mix(task, coef, teacher)


def _mix(task, coef, teacher):
    with np.errstate(over="ignore", invalid="ignore"):
        mixed = task - coef * teacher
    return _check_finite_result("task - coef * teacher", mixed,
                                f"coef = {coef!r} times the teacher's part is too large")


def mixed_targets(toy, coef):
    r"""``{"sequence": ∇J - λ∇K, "per_state": ∇J - λ∇^state K}``, the two exact gradients.

    ``true_grad``, ``kl_grad`` and ``kl_grad_per_state`` must be finite real arrays of one shape:
    nothing is broadcast.

    Examples
    --------
    >>> toy = add_teacher(make_toy(T=1, V=2, mismatch=0.0))
    >>> t = mixed_targets(toy, 2.0)
    >>> bool(np.allclose(t["sequence"], toy["true_grad"] - 2 * toy["kl_grad"], rtol=0, atol=0))
    True
    """
    check_toy(toy, keys=("true_grad", "kl_grad", "kl_grad_per_state"))
    coef = _check_coef(coef)
    grads = {}
    for name in ("true_grad", "kl_grad", "kl_grad_per_state"):
        grads[name] = _check_real(name, toy[name], None if name == "true_grad"
                                  else np.shape(grads["true_grad"]))
        if not np.isfinite(grads[name]).all():
            raise ValueError(f"toy[{name!r}] must be finite")
    return {"sequence": _mix(grads["true_grad"], coef, grads["kl_grad"]),
            "per_state": _mix(grads["true_grad"], coef, grads["kl_grad_per_state"])}


def mixed_table(toy, coefs, kinds=MIXED_ESTIMATORS, N=64, baseline=0.0, verl_clamps=False):
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
        Batch size for ``rel_rmse``, in ``[1, MAX_BATCH]``.
    baseline : float
        $b$ of the task's advantage.
    verl_clamps : bool
        As in ``teacher_estimate``.

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
    kinds = [_check_kind(kind) for kind in check_sequence("kinds", kinds)]
    coefs = [_check_coef(coef) for coef in check_sequence("coefs", coefs)]
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1:
        raise ValueError(f"N must be an integer >= 1, got {N!r}")
    if N > MAX_BATCH:
        shown = f"an int of {len(str(int(N)))} digits" if N > 10**20 else repr(N)
        raise ValueError(f"N must be <= 2**53 (MAX_BATCH, exact as a float), got {shown}")
    verl_clamps = _check_flag("verl_clamps", verl_clamps)
    rows = []
    task = weighted_score(toy, np.ones(len(toy["Y"])), baseline)  # the same for every kind
    for kind in kinds:
        teacher = teacher_estimate(toy, kind, verl_clamps)
        for coef in coefs:
            targets = mixed_targets(toy, coef)
            estimate = _mix(task, coef, teacher)
            sequence = estimator_moments(dict(toy, true_grad=targets["sequence"]), estimate)
            state = estimator_moments(dict(toy, true_grad=targets["per_state"]), estimate)
            rows.append(dict(kind=kind, coef=coef, rel_bias=sequence["rel_bias"],
                             rel_bias_per_state=state["rel_bias"], var=sequence["var"],
                             rel_rmse=sequence["rel_rmse"](N)))
    return rows
