r"""verl's top-k forward KL and its clamps, exactly: when a step is clamped, and what it loses.

verl's on-policy distillation trainer (``loss_mode="forward_kl_topk"``, verl 0.9.1,
``verl/trainer/distillation/fsdp/losses.py`` and ``losses.py``) asks the teacher for its top-$k$
log-probabilities $\log q_v$, $v \in S$ ($k$ = ``topk``), and computes at each position the
forward approximation (c) of the ``topk`` module, "ignore the entries outside $S$", with up to
three clamps:

$$
\ell = \min\Bigl(\max\Bigl(\sum_{v \in S} e^{\bar t_v} (\bar t_v - \bar s_v),\ 0\Bigr),\ M\Bigr),
\qquad \bar t_v = \max(\log q_v, c), \quad \bar s_v = \max(\log p_v, c),
$$

with $p$ the student's full softmax, $c$ = ``log_prob_min_clamp`` and $M$ = ``loss_max_clamp``.
The $\max(\cdot, 0)$ is applied always (``losses.py``, ``compute_forward_kl_topk``: "divergences
can be negative"); $c$ only when ``log_prob_min_clamp`` is set (``fsdp/losses.py``), $M$ only
when ``loss_max_clamp`` is set (``losses.py``, ``distillation_loss``, as ``clamp(-M, M)``,
whose lower side a value $\ge 0$ never reaches). A position clamped by either side of the
value sends **no gradient**.

**Which defaults.** ``python -m verl.trainer.main_ppo`` composes its config with Hydra from
``verl/trainer/config/ppo_trainer.yaml``, which takes the ``distillation`` section from
``distillation/distillation.yaml``: ``topk: 32``, ``log_prob_min_clamp: null``,
``loss_max_clamp: null`` (``VERL_TOPK``, ``VERL_LOG_PROB_MIN_CLAMP``, ``VERL_LOSS_MAX_CLAMP``),
with ``loss_mode: k3``: a run that enables distillation and leaves its loss alone uses no top-$k$
loss at all, and one that sets ``loss_mode=forward_kl_topk`` gets the top-32 value clamped at 0
and nowhere else. The ``DistillationLossConfig`` dataclass, built in Python without the YAML,
has other defaults: ``topk=128``, ``log_prob_min_clamp=-10.0``, ``loss_max_clamp=10.0``
(``DATACLASS_TOPK``, ``DATACLASS_LOG_PROB_MIN_CLAMP``, ``DATACLASS_LOSS_MAX_CLAMP``); beside its
$c = -10$ each term is at most $10\, q_v$, so the value is at most $10\, Q \le 10$ and its
$M = 10$ never binds: a report's probabilities sum to $Q \le 1$, and one whose sum exceeds 1
by more than the rounding ``topk`` allows ($\sqrt{\varepsilon}$ of float32, $3.5 \cdot
10^{-4}$) is a ``ValueError`` (within it, $M$ binds by at most $10 (Q - 1)$). The functions
below default to the composed config; pass the dataclass's clamps to study them.
``tests/integration/test_verl_config.py`` composes the trainer's config with
Hydra as the trainer does, checks the constants against it and against the dataclass, and runs
verl's loss with it.

**When (c) is negative.** With the captured masses $Q = \sum_{v \in S} q_v$ and
$P = \sum_{v \in S} p_v$, the log-sum inequality gives

$$
\sum_{v \in S} q_v \log \frac{q_v}{p_v} \ \ge\ Q \log \frac{Q}{P},
$$

so without the log-probability clamp (c) $< 0$ needs $P > Q$: the student puts more mass on
the teacher's top-$k$ than the teacher does. $Q \ge P$ rules the clamp out; $P > Q$ does not
force it (the inequality is an equality only when $p \propto q$ on $S$). The tail bucket (b)
of the ``topk`` module is a KL over $k + 1$ outcomes, never negative, and needs no clamp.

:func:`clamp_study` measures, on the ``topk`` module's Zipf-like pairs, how often the clamp is
active and how much of the true gradient a clamped position loses; :func:`topk_diagnostics`
returns the quantities verl logs (``distillation/student_mass``, ``teacher_mass``,
``overlap_ratio``, ``overlap_token_advantage``). ``tests/integration/test_verl_distillation.py``
calls verl's own ``compute_forward_kl_topk`` on the same inputs.

**Conventions.** An optional ``mask`` over the leading shape selects the positions that count:
a masked-out position may hold anything (``-inf`` rows, NaN), is replaced by ``torch.where``
before any arithmetic, and gives exactly 0 in every per-position output and in the gradient.
At a masked-in position NaN or $+\infty$ in ``student_logits``, a row of logits that are all
$-\infty$, a NaN or positive ``teacher_topk_logp``, a report whose log-probabilities are all
$-\infty$ (it holds no probability, $Q = 0$), and a repeated or out-of-range id are each a
``ValueError``. A $-\infty$ student logit at a reported id (an impossible token the teacher
gives probability $q_v > 0$) makes the unclamped value $+\infty$, its true value, with a zero
gradient at that position; a reported $\log q_v = -\infty$ contributes 0. Finite logits whose
spread within a position overflows the compute dtype (a finite logit of log-probability
$-\infty$) are a ``ValueError``, as in ``topk.topk_kl``. Half precision is computed in float32,
where verl 0.9.1 takes the student's ``log_softmax`` in the logits' own dtype: on bfloat16
logits verl's value carries bfloat16's rounding (0.1 to 0.4 % of the largest value on
``(T, V, k) = (64, 512, 32)``), this module's float32's (below $10^{-6}$), so the two agree to
float32 rounding only for float32 and float64 logits
(``tests/integration/test_verl_distillation.py``).

**Rounding.** The studies count a clamp, a cap and $P > Q$ only beyond the rounding of the
compute dtype ($\varepsilon$ its epsilon), so that a value that is exactly 0 (a report of the
whole vocabulary and $p = q$) computed as $-10^{-17}$ is not a clamp. A log-probability
$s_v = z_v - m - \log \sum e^{z - m}$ is rounded by about $\varepsilon (|s_v| + 2)$ plus the
rounding of the sum of $V$ exponentials, taken as $\sqrt V \varepsilon$ (the size of $V$
independent roundings; the worst case of a recursive sum is $V \varepsilon$), and a sum of $k$
terms adds $k \varepsilon$ of their size. Hence, for one position and report:

* the value before its clamps counts as negative where it is below

    $$-3 \varepsilon \sum_{v \in S} \bar q_v (1 + |\bar t_v| + |\bar s_v| + \sqrt V + k)
    (1 + |\bar t_v - \bar s_v|),$$

    and as capped where it exceeds $M$ by as much;
* $P > Q$ where $P - Q$ exceeds

    $$\varepsilon \sum_{v \in S} [p_v (|s_v| + \sqrt V + 2 + k) +
    q_v (|t_v| + \sqrt V + 2 + k)];$$

* the position has no gradient where $\lVert p - q \rVert \le 6 \varepsilon (1 + \sqrt V)$
  (each of $p$ and $q$ is rounded by at most $\varepsilon (\sqrt V / e + \sqrt V + \log V + 3)$
  in norm). There the relative gradient error has no denominator: it is 0 where the estimate is
  exact to rounding as well, $\lVert \hat g - g \rVert \le 12 \varepsilon (1 + \sqrt V) +
  k \varepsilon$ ((c) at $k = V$; (b) wherever $p = q$), and $+\infty$ elsewhere ((c) at
  $k < V$ and $p = q$ sends $Q p - q \mathbb{1}_S \ne 0$ where the true gradient is 0), and
  such a position carries no weight in ``lost``.

``tests/large_vocab/test_clamps.py`` checks each bound against the float64 computation of
float32 inputs, at random and at near-ties.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .._numerics import (
    check_finite_number,
    check_float_tensor,
    check_mask,
    check_reported_mass,
    check_sequence,
    compute_dtype,
    select,
)
from .topk import topk_kl, zipf_pair

__all__ = ["VERL_TOPK", "VERL_LOG_PROB_MIN_CLAMP", "VERL_LOSS_MAX_CLAMP", "DATACLASS_TOPK",
           "DATACLASS_LOG_PROB_MIN_CLAMP", "DATACLASS_LOSS_MAX_CLAMP", "verl_forward_kl_topk",
           "topk_diagnostics", "clamp_study", "weighted_clamp_study"]

VERL_TOPK = 32
"""``distillation.distillation_loss.topk`` in the config verl 0.9.1's trainer composes
(``verl/trainer/config/distillation/distillation.yaml``): what ``python -m
verl.trainer.main_ppo`` gets unless the user sets it."""

VERL_LOG_PROB_MIN_CLAMP = None
"""``distillation_loss.log_prob_min_clamp`` in the composed config: ``null``, no clamp."""

VERL_LOSS_MAX_CLAMP = None
"""``distillation_loss.loss_max_clamp`` in the composed config: ``null``, no clamp."""

DATACLASS_TOPK = 128
"""The default of ``topk`` in verl 0.9.1's ``DistillationLossConfig`` dataclass
(``verl/workers/config/distillation.py``), which the trainer's composed config overrides."""

DATACLASS_LOG_PROB_MIN_CLAMP = -10.0
"""The dataclass's default ``log_prob_min_clamp`` (not the trainer's: see ``VERL_TOPK``)."""

DATACLASS_LOSS_MAX_CLAMP = 10.0
"""The dataclass's default ``loss_max_clamp`` (not the trainer's)."""


def _check_report(student_logits, teacher_topk_logp, teacher_topk_ids, mask):
    """Validate a report; return the mask as bool (None: every position counts)."""
    check_float_tensor("student_logits", student_logits, None)
    check_float_tensor("teacher_topk_logp", teacher_topk_logp, None)
    if student_logits.ndim < 1 or student_logits.shape[-1] < 1:
        raise ValueError(f"student_logits must have a last (vocabulary) dimension of size >= 1, "
                         f"got shape {tuple(student_logits.shape)}")
    if (not isinstance(teacher_topk_ids, torch.Tensor) or teacher_topk_ids.is_floating_point()
            or teacher_topk_ids.is_complex() or teacher_topk_ids.dtype == torch.bool):
        raise TypeError(f"teacher_topk_ids must be an integer torch.Tensor, got "
                        f"{getattr(teacher_topk_ids, 'dtype', type(teacher_topk_ids).__name__)}")
    if (teacher_topk_logp.ndim != student_logits.ndim
            or teacher_topk_logp.shape[:-1] != student_logits.shape[:-1]):
        raise ValueError(f"teacher_topk_logp must have shape (..., k) with the leading shape of "
                         f"student_logits {tuple(student_logits.shape[:-1])}, got "
                         f"{tuple(teacher_topk_logp.shape)}")
    if teacher_topk_ids.shape != teacher_topk_logp.shape:
        raise ValueError(f"teacher_topk_ids must have the shape of teacher_topk_logp "
                         f"{tuple(teacher_topk_logp.shape)}, got {tuple(teacher_topk_ids.shape)}")
    V, k = student_logits.shape[-1], teacher_topk_ids.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"the report must hold 1 <= k <= V = {V} tokens, got k = {k}")
    keep = None if mask is None else check_mask(
        mask, "the leading shape of student_logits", tuple(student_logits.shape[:-1]))
    rows = torch.ones(student_logits.shape[:-1], dtype=torch.bool,
                      device=student_logits.device) if keep is None else keep
    where = "" if keep is None else " at a position that the mask selects"

    def bad(condition):  # condition (..., n): True somewhere in a masked-in row
        return bool((condition.any(-1) & rows).any())

    if bad((teacher_topk_ids < 0) | (teacher_topk_ids >= V)):
        raise ValueError(f"teacher_topk_ids must lie in [0, V) = [0, {V}){where}")
    ordered = teacher_topk_ids.sort(-1).values
    if bad(ordered[..., 1:] == ordered[..., :-1]):
        raise ValueError(f"teacher_topk_ids must not repeat an id within a position{where} "
                         f"(a top-k report names k different tokens)")
    if bad(student_logits.isnan() | (student_logits == math.inf)):
        raise ValueError(f"student_logits must be finite or -inf (no NaN, no +inf){where}")
    if bool(((student_logits == -math.inf).all(-1) & rows).any()):
        raise ValueError(f"student_logits must not be -inf at every token of a position{where} "
                         f"(the softmax of such a row is NaN)")
    if bad(teacher_topk_logp.isnan() | (teacher_topk_logp > 0)):
        raise ValueError(f"teacher_topk_logp must hold log-probabilities (<= 0, not NaN){where}")
    if bool(((teacher_topk_logp == -math.inf).all(-1) & rows).any()):
        raise ValueError(f"teacher_topk_logp must not be -inf at every reported token of a "
                         f"position{where} (a report that holds no probability, Q = 0)")
    # Q <= 1 (to the rounding topk allows), at the positions that count: a masked-out one is
    # read as a report of nothing. Beyond 1 the bound (c) <= -c Q <= -c would not hold.
    check_reported_mass(torch.where(rows[..., None], teacher_topk_logp,
                                     torch.full_like(teacher_topk_logp, -math.inf)),
                         compute_dtype(student_logits, teacher_topk_logp), False)
    return keep


def _clamp_option(name, value, sign):
    if value is None:
        return None
    return check_finite_number(name, value, low=0.0 if sign > 0 else None,
                               high=0.0 if sign < 0 else None)


def _selected(keep, student_logits, teacher_topk_logp, teacher_topk_ids):
    """The inputs with every masked-out position replaced (zeros, ids 0..k-1) before any
    arithmetic: whatever such a position holds reaches neither a value nor a gradient."""
    if keep is None:
        return student_logits, teacher_topk_logp, teacher_topk_ids
    rows = keep[..., None]
    ids = torch.arange(teacher_topk_ids.shape[-1], device=teacher_topk_ids.device,
                       dtype=teacher_topk_ids.dtype).expand_as(teacher_topk_ids)
    return (torch.where(rows, student_logits, torch.zeros_like(student_logits)),
            torch.where(rows, teacher_topk_logp, torch.zeros_like(teacher_topk_logp)),
            torch.where(rows, teacher_topk_ids, ids))


def _clamped_terms(student_logits, teacher_topk_logp, teacher_topk_ids, log_prob_min_clamp):
    """``(s, t, s_bar, t_bar)``: the student's log-probabilities on the report before and after
    the clamp, and the teacher's; in the compute dtype (float32 at least, as verl's)."""
    dtype = compute_dtype(student_logits, teacher_topk_logp)
    logits = student_logits.to(dtype)
    log_p = F.log_softmax(logits, dim=-1)
    # a finite logit whose log-probability is -inf: its distance to the row's largest logit
    # overflowed the dtype (a spread above 3.4e38 in float32); topk_kl refuses it the same way
    if bool(((log_p == -math.inf) & (logits > -math.inf)).any()):
        raise ValueError(f"student_logits span more than the range of {dtype} within a "
                         "position: log_softmax overflows (shift or rescale them)")
    s = torch.gather(log_p, -1, teacher_topk_ids.long())
    t = teacher_topk_logp.to(dtype)
    if log_prob_min_clamp is None:
        return s, t, s, t
    return s, t, s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)


def _token_terms(s_bar, t_bar):
    r"""$e^{\bar t_v} (\bar t_v - \bar s_v)$ for each reported token: 0 where the teacher reports
    a probability of 0 ($0 \cdot (-\infty)$ would be NaN), $+\infty$ where the student's is 0
    and the teacher's is not (with a zero gradient: no finite step makes it finite)."""
    weight = t_bar.exp()
    reported = weight > 0
    impossible = reported & (s_bar == -math.inf)
    finite = reported & ~impossible
    s_safe = torch.where(finite, s_bar, torch.zeros_like(s_bar))
    t_safe = torch.where(finite, t_bar, torch.zeros_like(t_bar))
    terms = torch.where(finite, weight * (t_safe - s_safe), torch.zeros_like(weight))
    return torch.where(impossible, torch.full_like(weight, math.inf), terms)


def _value(student_logits, teacher_topk_logp, teacher_topk_ids, low, high):
    """The per-position value and the value before the clamps of the value."""
    _, _, s_bar, t_bar = _clamped_terms(student_logits, teacher_topk_logp, teacher_topk_ids, low)
    raw = _token_terms(s_bar, t_bar).sum(-1)
    # an infinite value is a constant: the position's finite terms send no gradient either
    infinite = raw == math.inf
    value = torch.where(infinite, torch.zeros_like(raw), raw).clamp_min(0.0)
    if high is not None:
        value = value.clamp_max(high)
    top = torch.full_like(raw, math.inf if high is None else high)
    return torch.where(infinite, top, value), raw


def verl_forward_kl_topk(student_logits, teacher_topk_logp, teacher_topk_ids, mask=None, *,
                         log_prob_min_clamp=VERL_LOG_PROB_MIN_CLAMP,
                         loss_max_clamp=VERL_LOSS_MAX_CLAMP):
    r"""verl's per-position ``forward_kl_topk`` loss, with its clamps (no reduction).

    $$
    \ell = \min\Bigl(\max\Bigl(\sum_{v \in S} e^{\bar t_v} (\bar t_v - \bar s_v),\ 0\Bigr),
    \ M\Bigr)
    $$

    (module docstring). ``None`` for a clamp leaves it out, as in verl; the defaults are the
    config verl's trainer composes (no clamp but the $\max(\cdot, 0)$), and
    ``DATACLASS_LOG_PROB_MIN_CLAMP`` and ``DATACLASS_LOSS_MAX_CLAMP`` are the dataclass's.
    Reduce with ``opd.aggregate_loss`` and the actor's ``loss_agg_mode``.

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(..., V)``, finite or ``-inf``, not ``-inf`` everywhere.
    teacher_topk_logp : torch.Tensor
        ``(..., k)``, the teacher's log-probabilities (of its full softmax) at ``teacher_topk_ids``.
    teacher_topk_ids : torch.Tensor
        ``(..., k)`` integer ids in ``[0, V)``, different at each position.
    mask : torch.Tensor or None
        0/1 over the leading shape ``(...)``: the positions computed; the others are 0, with
        zero gradient, whatever they hold. ``None``: every position.
    log_prob_min_clamp : float or None
        $c \le 0$, or ``None`` (the composed config's; the dataclass's is $-10$).
    loss_max_clamp : float or None
        $M \ge 0$, or ``None`` (the composed config's; the dataclass's is 10).

    Returns
    -------
    torch.Tensor
        ``(...)`` in the compute dtype (float32 for half-precision inputs).

    Examples
    --------
    A two-token report where the student is the sharper one on it, $P = 0.9 > Q = 0.75$: the
    value $0.5 \log\frac{0.5}{0.8} + 0.25 \log\frac{0.25}{0.1} = -0.0059$ is clamped to 0.

    >>> student = torch.log(torch.tensor([0.8, 0.1, 0.1]))
    >>> teacher = torch.log(torch.tensor([0.5, 0.25]))
    >>> verl_forward_kl_topk(student, teacher, torch.tensor([0, 1])).item()
    0.0
    >>> round(verl_forward_kl_topk(torch.zeros(3), teacher, torch.tensor([0, 1])).item(), 4)
    0.1308

    $0.5 \log 1.5 + 0.25 \log 0.75 = 0.1308$. A masked-out position gives 0, whatever it holds:

    >>> rows = torch.stack([torch.zeros(3), torch.full((3,), -math.inf)])
    >>> verl_forward_kl_topk(rows, teacher.expand(2, 2), torch.tensor([[0, 1], [0, 1]]),
    ...                      torch.tensor([1, 0])).tolist()
    [0.13081..., 0.0]
    """
    keep = _check_report(student_logits, teacher_topk_logp, teacher_topk_ids, mask)
    low = _clamp_option("log_prob_min_clamp", log_prob_min_clamp, -1)
    high = _clamp_option("loss_max_clamp", loss_max_clamp, +1)
    value, _ = _value(*_selected(keep, student_logits, teacher_topk_logp, teacher_topk_ids),
                      low, high)
    return select(keep, value)


def topk_diagnostics(student_logits, teacher_topk_logp, teacher_topk_ids, mask=None, *,
                     log_prob_min_clamp=VERL_LOG_PROB_MIN_CLAMP):
    r"""What verl logs beside ``forward_kl_topk``, per position and as its batch metrics.

    Per position: the student's and the teacher's mass on the report, $P$ and $Q$; the number
    of reported ids that are also among the student's own top-$k$ (``overlap_count``); and the
    mean of $-\bar q_v (\bar t_v - \bar s_v)$ over those ids (``overlap_token_advantage``, 0
    where there are none). The student's top-$k$ is taken among the tokens it can emit
    ($p_v > 0$): where it has fewer than $k$, verl's ``topk`` of the logits would also name
    tokens of logit $-\infty$, whose advantage $-q_v \log(q_v / 0)$ is $-\infty$ (and NaN in
    verl's masked sum); here they are not in the overlap, and every output is finite. What
    they say about the step:

    * $Q$ near 1: the report holds the teacher's distribution, and (c) is close to the
      forward KL (its exact bias is $-(1 - Q)\bigl[\log\frac{1 - Q}{1 - P} +
      \mathrm{KL}(\hat q \,\|\, \hat p)\bigr]$, $\hat q, \hat p$ the tails renormalised);
    * $P > Q$: the student is more concentrated on the report than the teacher, the only case
      in which (without the log-probability clamp) the value can be clamped to 0;
    * a low ``overlap_ratio``: the student's likely tokens are not where the teacher is asked.

    Parameters
    ----------
    student_logits, teacher_topk_logp, teacher_topk_ids
        As for :func:`verl_forward_kl_topk`.
    mask : torch.Tensor or None
        0/1 over the leading shape: which positions count in the batch metrics (verl's
        ``response_mask``); the per-position outputs are 0 at the others, whatever they hold.
        ``None``: every position.
    log_prob_min_clamp : float or None
        As for :func:`verl_forward_kl_topk`.

    Returns
    -------
    dict
        ``student_mass``, ``teacher_mass``, ``overlap_count``, ``overlap_token_advantage``:
        ``(...)`` tensors; ``metrics``: verl's names (without ``distillation/``) to floats, the
        means, minima and maxima over the masked positions and ``overlap_ratio`` (mean count
        over $k$); ``nan`` where no position is masked in.

    Examples
    --------
    >>> student = torch.log(torch.tensor([[0.8, 0.15, 0.05], [0.2, 0.3, 0.5]]))
    >>> teacher = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]]))
    >>> ids = torch.tensor([[0, 1], [0, 1]])
    >>> d = topk_diagnostics(student, teacher, ids, torch.ones(2))
    >>> [round(v, 4) for v in d["student_mass"].tolist()], d["overlap_count"].tolist()
    ([0.95, 0.5], [2, 1])
    >>> round(d["metrics"]["overlap_ratio"], 4), round(d["metrics"]["teacher_mass"], 4)
    (0.75, 0.75)
    """
    keep = _check_report(student_logits, teacher_topk_logp, teacher_topk_ids, mask)
    low = _clamp_option("log_prob_min_clamp", log_prob_min_clamp, -1)
    student_logits, teacher_topk_logp, teacher_topk_ids = _selected(
        keep, student_logits, teacher_topk_logp, teacher_topk_ids)
    if keep is None:
        keep = torch.ones(student_logits.shape[:-1], dtype=torch.bool,
                          device=student_logits.device)
    s, t, s_bar, t_bar = _clamped_terms(student_logits, teacher_topk_logp, teacher_topk_ids, low)
    k = teacher_topk_ids.shape[-1]
    student_top = torch.topk(student_logits, k=k, dim=-1).indices
    possible = torch.gather(student_logits, -1, student_top) > -math.inf
    overlap = ((teacher_topk_ids.unsqueeze(-1) == student_top.unsqueeze(-2))
               & possible.unsqueeze(-2)).any(-1)
    count = torch.where(keep, overlap.sum(-1), torch.zeros_like(overlap.sum(-1)))
    token_kl = _token_terms(s_bar, t_bar)
    advantage = torch.where(overlap, -token_kl, torch.zeros_like(token_kl)).sum(-1)
    advantage = torch.where(count > 0, advantage / count.clamp_min(1), torch.zeros_like(advantage))
    student_mass = select(keep, s.exp().sum(-1))
    teacher_mass = select(keep, t.exp().sum(-1))
    any_kept = bool(keep.any())

    def stat(x, how):
        if not any_kept:
            return math.nan
        return float(getattr(x.detach()[keep], how)())

    with_overlap = keep & (count > 0)
    metrics = {
        "student_mass": stat(student_mass, "mean"),
        "student_mass_min": stat(student_mass, "min"),
        "student_mass_max": stat(student_mass, "max"),
        "teacher_mass": stat(teacher_mass, "mean"),
        "teacher_mass_min": stat(teacher_mass, "min"),
        "teacher_mass_max": stat(teacher_mass, "max"),
        "overlap_ratio": stat(count.to(student_mass.dtype), "mean") / k,
        "overlap_token_advantage": (float(advantage.detach()[with_overlap].mean())
                                    if bool(with_overlap.any()) else 0.0),
    }
    return {"student_mass": student_mass, "teacher_mass": teacher_mass,
            "overlap_count": count, "overlap_token_advantage": advantage, "metrics": metrics}


def _row_gradients(fn, logits):
    """The gradient of each row's value of ``fn`` (rows are independent: one backward pass of
    the sum)."""
    z = logits.detach().clone().requires_grad_(True)
    fn(z).sum().backward()
    return z.grad


def _integer(value):
    """``value`` as an int if it is an integer (Python's, numpy's or a 0-d integer tensor), else
    None; a bool is not one (``k=True`` is a mistake, not a report of one token)."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 and not (value.is_floating_point() or value.is_complex()
                                    or value.dtype == torch.bool):
            return int(value.item())
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None  # numpy's integers are numbers.Integral, numpy's bool is not
    return int(value)


def _gradient_noise(V, dtype):
    r"""$6 \varepsilon (1 + \sqrt V)$: a bound of the rounding of $\lVert p - q \rVert$
    (module docstring, "Rounding")."""
    return 6 * torch.finfo(dtype).eps * (1 + math.sqrt(V))


def _value_noise(s_bar, t_bar, V):
    r"""$3 \varepsilon \sum_{v \in S} \bar q_v (1 + |\bar t_v| + |\bar s_v| + \sqrt V + k)
    (1 + |\bar t_v - \bar s_v|)$ per position: a bound of the rounding of (c) before its
    clamps (module docstring, "Rounding")."""
    k = s_bar.shape[-1]
    size = (1 + t_bar.abs() + s_bar.abs() + math.sqrt(V) + k) * (1 + (t_bar - s_bar).abs())
    return 3 * torch.finfo(s_bar.dtype).eps * (t_bar.exp() * size).sum(-1)


def _mass_noise(s, t, V):
    r"""$\varepsilon \sum_{v \in S} [p_v (|s_v| + \sqrt V + 2 + k) + q_v (|t_v| + \sqrt V + 2
    + k)]$ per position: a bound of the rounding of $P - Q$ (module docstring, "Rounding")."""
    k = s.shape[-1]
    extra = math.sqrt(V) + 2 + k
    return torch.finfo(s.dtype).eps * (s.exp() * (s.abs() + extra)
                                       + t.exp() * (t.abs() + extra)).sum(-1)


def clamp_study(V=4096, exponent=1.1, temperatures=(0.7, 1.0), noises=(0.5, 1.0, 2.0),
                ks=(1, 8, VERL_TOPK, DATACLASS_TOPK), positions=64, seed=0, *,
                log_prob_min_clamp=VERL_LOG_PROB_MIN_CLAMP, loss_max_clamp=VERL_LOSS_MAX_CLAMP):
    r"""How often verl's clamp is active, and what a clamped position loses, on Zipf-like pairs.

    Each position is one ``topk.zipf_pair`` (seeds ``seed`` to ``seed + positions - 1``): a
    Zipf teacher over $V$ ranks and a student that adds Gaussian noise to its logits. For each
    temperature, noise and $k$ (the teacher's top-$k$ as the report; verl's composed ``topk``
    32 and the dataclass's 128 among the defaults), in float64 and exactly (no sampling of
    tokens), the row holds:

    * ``clamped``: the fraction of positions where verl's loss is clamped to 0 (its value
      before ``max(., 0)`` is negative beyond its rounding, module docstring), with the given
      ``log_prob_min_clamp`` (by default none, as the trainer's composed config);
    * ``capped``: the fraction whose value exceeds ``loss_max_clamp`` beyond its rounding (0
      when it is ``None``);
    * ``p_above_q``: the fraction with $P > Q$ beyond rounding (necessary for a clamp without
      the log-probability clamp, module docstring);
    * ``lost``: $\sum_{\text{clamped or capped}} \lVert \nabla \mathrm{KL} \rVert \big/
      \sum_{\text{all}} \lVert \nabla \mathrm{KL} \rVert$, the share of the true gradients'
      size that the positions whose value is clamped carry and do not send (0 when none is);
    * ``c_grad_error`` and ``b_grad_error``: the mean relative gradient error
      $\lVert \hat g - g \rVert / \lVert g \rVert$ of verl's clamped (c) and of the tail bucket
      (b), against the full forward KL's gradient $g = p - q$ with respect to the student's
      logits; at a position where $g$ is 0 to rounding, 0 if $\hat g$ is too, else $+\infty$
      (module docstring, "Rounding"): with ``noises=(0.0,)`` (the student is the teacher)
      (c) has error $+\infty$ at $k < V$ and 0 at $k = V$, (b) 0 at every $k$.

    Returns
    -------
    list of dict
        One row per (temperature, noise, k), with those keys and ``temperature``, ``noise``,
        ``k``.

    Examples
    --------
    At $k = 1$ and without the log-probability clamp a position is clamped exactly where
    $P > Q$ ($q \log(q / p) < 0$ if and only if $p > q$):

    >>> [row] = clamp_study(V=64, temperatures=(1.0,), noises=(1.0,), ks=(1,), positions=16)
    >>> row["clamped"] == row["p_above_q"], row["capped"]
    (True, 0.0)
    """
    temperatures = check_sequence("temperatures", temperatures)
    noises = check_sequence("noises", noises)
    ks = check_sequence("ks", ks)
    if _integer(positions) is None or _integer(positions) < 1:
        raise ValueError(f"positions must be an integer >= 1, got {positions!r}")
    if _integer(seed) is None or _integer(seed) < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    positions, seed = _integer(positions), _integer(seed)
    rows = []
    for temperature in temperatures:
        for noise in noises:
            pairs = [zipf_pair(V, exponent, temperature, noise, seed + i)
                     for i in range(positions)]
            student = torch.stack([pair[0] for pair in pairs])  # (positions, V)
            teacher = torch.stack([pair[1] for pair in pairs])
            weights = torch.ones(positions, dtype=student.dtype, device=student.device)
            for row in weighted_clamp_study(student, teacher, weights, ks,
                                            log_prob_min_clamp=log_prob_min_clamp,
                                            loss_max_clamp=loss_max_clamp):
                rows.append({"temperature": temperature, "noise": noise, **row})
    return rows


def weighted_clamp_study(student_logits, teacher_logits, weights,
                         ks=(1, 8, VERL_TOPK, DATACLASS_TOPK), *,
                         log_prob_min_clamp=VERL_LOG_PROB_MIN_CLAMP,
                         loss_max_clamp=VERL_LOSS_MAX_CLAMP):
    r""":func:`clamp_study`'s measurements on given states, each with a weight.

    Each row $i$ is one position: the student's and the teacher's full logits there, and its
    probability $w_i$ of being visited (a state distribution: the fractions and means are
    $\sum_i w_i x_i / \sum_i w_i$, over the states of weight $w_i > 0$, with the weights
    divided by their largest first so that their sum does not overflow). The teacher reports
    its top-$k$ log-probabilities.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(N, V)``, finite.
    weights : torch.Tensor
        ``(N,)``, non-negative and not all 0.
    ks : sequence of int
        The report sizes, each in ``[1, V]``: Python or numpy integers or 0-d integer tensors,
        not bools.
    log_prob_min_clamp, loss_max_clamp : float or None
        verl's clamps, as for :func:`verl_forward_kl_topk` (by default the composed config's,
        none).

    Returns
    -------
    list of dict
        One row per $k$: ``k``, ``clamped``, ``capped``, ``p_above_q``, ``lost``,
        ``c_grad_error``, ``b_grad_error`` (as in :func:`clamp_study`, weighted).

    Examples
    --------
    A position that the student reaches with probability 0 does not count:

    >>> student = torch.log(torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.3, 0.5]], dtype=torch.float64))
    >>> teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]],
    ...                                  dtype=torch.float64))
    >>> [row["clamped"] for row in weighted_clamp_study(student, teacher,
    ...                                                 torch.tensor([1.0, 0.0]), ks=[2])]
    [1.0]
    >>> [row["clamped"] for row in weighted_clamp_study(student, teacher,
    ...                                                 torch.tensor([0.0, 1.0]), ks=[2])]
    [0.0]
    """
    check_float_tensor("student_logits", student_logits, 2)
    check_float_tensor("teacher_logits", teacher_logits, 2)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits must have the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    if not (bool(torch.isfinite(student_logits).all())
            and bool(torch.isfinite(teacher_logits).all())):
        raise ValueError("student_logits and teacher_logits must be finite")
    check_float_tensor("weights", weights, 1)
    if weights.shape != student_logits.shape[:1]:
        raise ValueError(f"weights must have shape (N,) = ({student_logits.shape[0]},), got "
                         f"{tuple(weights.shape)}")
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or not bool(
            (weights > 0).any()):
        raise ValueError("weights must be finite, >= 0 and not all 0")
    V = student_logits.shape[-1]
    ks = check_sequence("ks", ks)
    for i, k in enumerate(ks):
        if _integer(k) is None or not 1 <= _integer(k) <= V:
            raise ValueError(f"every k must be an integer in [1, V] = [1, {V}], got {k!r}")
        ks[i] = _integer(k)
    low = _clamp_option("log_prob_min_clamp", log_prob_min_clamp, -1)
    high = _clamp_option("loss_max_clamp", loss_max_clamp, +1)
    dtype = compute_dtype(student_logits, teacher_logits)
    student = student_logits.to(dtype)
    # by the largest weight first: finite weights whose sum overflows (3e38 + 3e38) still mean
    w = weights.to(dtype)
    w = w / w.max()
    log_q = F.log_softmax(teacher_logits.to(dtype), -1)
    g = F.softmax(student, -1) - log_q.exp()  # the forward KL's gradient, p - q
    norm = g.norm(dim=-1)
    # the rounding of g (module docstring, "Rounding"): a position with ||g|| at or below it
    # has no gradient to measure an error against, only the noise of computing p - q
    g_noise = _gradient_noise(V, dtype)
    moved = norm > g_noise
    moved_norm = torch.where(moved, norm, torch.zeros_like(norm))

    def mean(x):  # a state of weight 0 does not count, even where x is +inf there
        x = x.to(dtype)
        return float(torch.where(w > 0, w * x, torch.zeros_like(x)).sum() / w.sum())

    def relative_error(estimate, k):
        # ||g^ - g|| / ||g|| where g moves; where it does not, 0 if g^ is 0 to its own rounding
        # as well (exact, as (c) at k = V), else +inf: a gradient where the true one is 0
        error = (estimate - g).norm(dim=-1)
        still = torch.where(error <= 2 * g_noise + k * torch.finfo(dtype).eps,
                            torch.zeros_like(error),
                            torch.full_like(error, math.inf))
        return torch.where(moved, error / torch.where(moved, norm, torch.ones_like(norm)), still)

    rows = []
    for k in ks:
        report, ids = log_q.topk(k, -1)
        s, t, s_bar, t_bar = _clamped_terms(student, report, ids, low)
        _, raw = _value(student, report, ids, low, high)
        # a clamp (or cap) counts only beyond the rounding of the value before it: a true
        # value of 0 (k = V, p = q) computed as -1e-17 is not a clamp of the approximation
        value_noise = _value_noise(s_bar, t_bar, V)
        clamped = raw < -value_noise
        capped = (raw > high + value_noise if high is not None
                  else torch.zeros_like(clamped))
        # P > Q likewise beyond the rounding of the two sums
        p_above_q = s.exp().sum(-1) - t.exp().sum(-1) > _mass_noise(s, t, V)
        g_c = _row_gradients(lambda z, r=report, i=ids: _value(z, r, i, low, high)[0], student)
        g_b = _row_gradients(lambda z, r=report, i=ids: topk_kl(z, r, i, "tail", "forward"),
                             student)
        silent = clamped | capped
        total = (w * moved_norm).sum()
        rows.append({
            "k": k,
            "clamped": mean(clamped),
            "capped": mean(capped),
            "p_above_q": mean(p_above_q),
            "lost": float((w * moved_norm * silent).sum() / total) if bool(total > 0) else 0.0,
            "c_grad_error": mean(relative_error(g_c, k)),
            "b_grad_error": mean(relative_error(g_b, k)),
        })
    return rows
