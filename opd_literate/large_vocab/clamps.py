r"""verl's top-k forward KL and its clamps, exactly: when a step is clamped, and what it loses.

verl's on-policy distillation trainer (``loss_mode="forward_kl_topk"``, verl 0.9.1,
``verl/trainer/distillation/fsdp/losses.py`` and ``losses.py``) asks the teacher for its top-$k$
log-probabilities $\log q_v$, $v \in S$ ($k$ = ``topk``, 128 by default), and computes at each
position the forward approximation (c) of the ``topk`` module, "ignore the entries outside
$S$", with two clamps:

$$
\ell = \min\Bigl(\max\Bigl(\sum_{v \in S} e^{\bar t_v} (\bar t_v - \bar s_v),\ 0\Bigr),\ M\Bigr),
\qquad \bar t_v = \max(\log q_v, c), \quad \bar s_v = \max(\log p_v, c),
$$

with $p$ the student's full softmax, $c$ = ``log_prob_min_clamp`` (default $-10$) and $M$ =
``loss_max_clamp`` (default 10). The $\max(\cdot, 0)$ is there because (c) can be negative;
a clamped position sends **no gradient**.

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
``overlap_ratio``, ``overlap_token_advantage``). ``tests/integration/test_verl.py`` calls verl's
own ``compute_forward_kl_topk`` on the same inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._numerics import check_finite_number, check_float_tensor, check_mask, compute_dtype
from .topk import topk_kl, zipf_pair

__all__ = ["LOG_PROB_MIN_CLAMP", "LOSS_MAX_CLAMP", "TOPK", "verl_forward_kl_topk",
           "topk_diagnostics", "clamp_study", "weighted_clamp_study"]

LOG_PROB_MIN_CLAMP = -10.0
"""verl 0.9.1's default ``distillation_loss.log_prob_min_clamp`` (``DistillationLossConfig``)."""

LOSS_MAX_CLAMP = 10.0
"""verl 0.9.1's default ``distillation_loss.loss_max_clamp``."""

TOPK = 128
"""verl 0.9.1's default ``distillation_loss.topk``."""


def _check_report(student_logits, teacher_topk_logp, teacher_topk_ids):
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
    if bool(((teacher_topk_ids < 0) | (teacher_topk_ids >= V)).any()):
        raise ValueError(f"teacher_topk_ids must lie in [0, V) = [0, {V})")
    if bool(student_logits.isnan().any()) or bool((student_logits == math.inf).any()):
        raise ValueError("student_logits must be finite or -inf (no NaN, no +inf)")
    if bool(teacher_topk_logp.isnan().any()) or bool((teacher_topk_logp > 0).any()):
        raise ValueError("teacher_topk_logp must hold log-probabilities (<= 0, not NaN)")


def _clamp_option(name, value, sign):
    if value is None:
        return None
    return check_finite_number(name, value, low=0.0 if sign > 0 else None,
                               high=0.0 if sign < 0 else None)


def _clamped_terms(student_logits, teacher_topk_logp, teacher_topk_ids, log_prob_min_clamp):
    """``(s, t, s_bar, t_bar)``: the student's log-probabilities on the report before and after
    the clamp, and the teacher's; in the compute dtype (float32 at least, as verl's)."""
    dtype = compute_dtype(student_logits, teacher_topk_logp)
    log_p = F.log_softmax(student_logits.to(dtype), dim=-1)
    s = torch.gather(log_p, -1, teacher_topk_ids.long())
    t = teacher_topk_logp.to(dtype)
    if log_prob_min_clamp is None:
        return s, t, s, t
    return s, t, s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)


def _token_terms(s_bar, t_bar):
    r"""$e^{\bar t_v} (\bar t_v - \bar s_v)$ for each reported token, 0 where the teacher reports
    a probability of 0 (no clamp: $0 \cdot (-\infty)$ would be NaN)."""
    weight = t_bar.exp()
    return torch.where(weight > 0, weight * (t_bar - s_bar), torch.zeros_like(weight))


def verl_forward_kl_topk(student_logits, teacher_topk_logp, teacher_topk_ids, *,
                         log_prob_min_clamp=LOG_PROB_MIN_CLAMP, loss_max_clamp=LOSS_MAX_CLAMP):
    r"""verl's per-position ``forward_kl_topk`` loss, with both clamps (no reduction).

    $$
    \ell = \min\Bigl(\max\Bigl(\sum_{v \in S} e^{\bar t_v} (\bar t_v - \bar s_v),\ 0\Bigr),
    \ M\Bigr)
    $$

    (module docstring). ``None`` for a clamp leaves it out, as in verl. Reduce with
    ``opd.aggregate_loss`` and the actor's ``loss_agg_mode``.

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(..., V)``, finite or ``-inf``.
    teacher_topk_logp : torch.Tensor
        ``(..., k)``, the teacher's log-probabilities (of its full softmax) at ``teacher_topk_ids``.
    teacher_topk_ids : torch.Tensor
        ``(..., k)`` integer ids in ``[0, V)``.
    log_prob_min_clamp : float or None
        $c \le 0$ (verl's default $-10$).
    loss_max_clamp : float or None
        $M \ge 0$ (verl's default 10).

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
    """
    _check_report(student_logits, teacher_topk_logp, teacher_topk_ids)
    low = _clamp_option("log_prob_min_clamp", log_prob_min_clamp, -1)
    high = _clamp_option("loss_max_clamp", loss_max_clamp, +1)
    _, _, s_bar, t_bar = _clamped_terms(student_logits, teacher_topk_logp, teacher_topk_ids, low)
    value = _token_terms(s_bar, t_bar).sum(-1).clamp_min(0.0)
    return value if high is None else value.clamp_max(high)


def topk_diagnostics(student_logits, teacher_topk_logp, teacher_topk_ids, mask, *,
                     log_prob_min_clamp=LOG_PROB_MIN_CLAMP):
    r"""What verl logs beside ``forward_kl_topk``, per position and as its batch metrics.

    Per position: the student's and the teacher's mass on the report, $P$ and $Q$; the number
    of reported ids that are also among the student's own top-$k$ (``overlap_count``); and the
    mean of $-\bar q_v (\bar t_v - \bar s_v)$ over those ids (``overlap_token_advantage``, 0
    where there are none). What they say about the step:

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
    mask : torch.Tensor
        0/1 over the leading shape: which positions count in the batch metrics.
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
    _check_report(student_logits, teacher_topk_logp, teacher_topk_ids)
    keep = check_mask(mask, "the leading shape of student_logits", student_logits.shape[:-1])
    low = _clamp_option("log_prob_min_clamp", log_prob_min_clamp, -1)
    s, t, s_bar, t_bar = _clamped_terms(student_logits, teacher_topk_logp, teacher_topk_ids, low)
    k = teacher_topk_ids.shape[-1]
    student_top = torch.topk(student_logits, k=k, dim=-1).indices
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    token_kl = _token_terms(s_bar, t_bar)
    advantage = torch.where(overlap, -token_kl, torch.zeros_like(token_kl)).sum(-1)
    advantage = torch.where(count > 0, advantage / count.clamp_min(1), torch.zeros_like(advantage))
    student_mass, teacher_mass = s.exp().sum(-1), t.exp().sum(-1)
    any_kept = bool(keep.any())

    def stat(x, how):
        if not any_kept:
            return math.nan
        return float(getattr(x[keep], how)())

    with_overlap = keep & (count > 0)
    metrics = {
        "student_mass": stat(student_mass, "mean"),
        "student_mass_min": stat(student_mass, "min"),
        "student_mass_max": stat(student_mass, "max"),
        "teacher_mass": stat(teacher_mass, "mean"),
        "teacher_mass_min": stat(teacher_mass, "min"),
        "teacher_mass_max": stat(teacher_mass, "max"),
        "overlap_ratio": stat(count.to(student_mass.dtype), "mean") / k,
        "overlap_token_advantage": (float(advantage[with_overlap].mean())
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


def clamp_study(V=4096, exponent=1.1, temperatures=(0.7, 1.0), noises=(0.5, 1.0, 2.0),
                ks=(1, 8, 32, TOPK), positions=64, seed=0):
    r"""How often verl's clamp is active, and what a clamped position loses, on Zipf-like pairs.

    Each position is one ``topk.zipf_pair`` (seeds ``seed`` to ``seed + positions - 1``): a
    Zipf teacher over $V$ ranks and a student that adds Gaussian noise to its logits. For each
    temperature, noise and $k$ (the teacher's top-$k$ as the report), in float64 and exactly
    (no sampling of tokens), the row holds:

    * ``clamped``: the fraction of positions where verl's loss is clamped to 0 (its value
      before ``max(., 0)`` is negative), with the default ``log_prob_min_clamp``;
    * ``p_above_q``: the fraction with $P > Q$ (necessary for a clamp without the
      log-probability clamp, module docstring);
    * ``lost``: $\sum_{\text{clamped}} \lVert \nabla \mathrm{KL} \rVert \big/ \sum_{\text{all}}
      \lVert \nabla \mathrm{KL} \rVert$, the share of the true gradients' size that the
      clamped positions carry and do not send (0 when none is clamped);
    * ``c_grad_error`` and ``b_grad_error``: the mean relative gradient error
      $\lVert \hat g - g \rVert / \lVert g \rVert$ of verl's clamped (c) and of the tail bucket
      (b), against the full forward KL's gradient $g = p - q$ with respect to the student's
      logits.

    Returns
    -------
    list of dict
        One row per (temperature, noise, k), with those keys and ``temperature``, ``noise``,
        ``k``.
    """
    rows = []
    for temperature in temperatures:
        for noise in noises:
            pairs = [zipf_pair(V, exponent, temperature, noise, seed + i)
                     for i in range(positions)]
            student = torch.stack([pair[0] for pair in pairs])  # (positions, V)
            teacher = torch.stack([pair[1] for pair in pairs])
            weights = torch.ones(positions, dtype=student.dtype, device=student.device)
            for row in weighted_clamp_study(student, teacher, weights, ks):
                rows.append({"temperature": temperature, "noise": noise, **row})
    return rows


def weighted_clamp_study(student_logits, teacher_logits, weights, ks=(1, 8, 32, TOPK)):
    r""":func:`clamp_study`'s measurements on given states, each with a weight.

    Each row $i$ is one position: the student's and the teacher's full logits there, and its
    probability $w_i$ of being visited (a state distribution: the fractions and means are
    $\sum_i w_i x_i / \sum_i w_i$). The teacher reports its top-$k$ log-probabilities.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(N, V)``, finite.
    weights : torch.Tensor
        ``(N,)``, non-negative and not all 0.
    ks : sequence of int
        The report sizes, each in ``[1, V]``.

    Returns
    -------
    list of dict
        One row per $k$: ``k``, ``clamped``, ``p_above_q``, ``lost``, ``c_grad_error``,
        ``b_grad_error`` (as in :func:`clamp_study`, weighted).

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
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
            raise ValueError(f"every k must be an integer in [1, V] = [1, {V}], got {k!r}")
    dtype = compute_dtype(student_logits, teacher_logits)
    student, w = student_logits.to(dtype), weights.to(dtype)
    log_q = F.log_softmax(teacher_logits.to(dtype), -1)
    g = F.softmax(student, -1) - log_q.exp()  # the forward KL's gradient, p - q
    norm = g.norm(dim=-1)

    def mean(x):
        return float((w * x.to(dtype)).sum() / w.sum())

    rows = []
    for k in ks:
        report, ids = log_q.topk(k, -1)
        s, t, s_bar, t_bar = _clamped_terms(student, report, ids, LOG_PROB_MIN_CLAMP)
        clamped = _token_terms(s_bar, t_bar).sum(-1) < 0
        g_c = _row_gradients(lambda z, r=report, i=ids: verl_forward_kl_topk(
            z, r, i, loss_max_clamp=None), student)
        g_b = _row_gradients(lambda z, r=report, i=ids: topk_kl(z, r, i, "tail", "forward"),
                             student)
        # a state where student and teacher agree exactly has g = 0: no relative error there
        moved = norm > 0
        safe = torch.where(moved, norm, torch.ones_like(norm))
        rows.append({
            "k": k,
            "clamped": mean(clamped),
            "p_above_q": mean(s.exp().sum(-1) > t.exp().sum(-1)),
            "lost": float((w * norm * clamped).sum() / (w * norm).sum()) if bool(
                (w * norm).sum() > 0) else 0.0,
            "c_grad_error": mean(torch.where(moved, (g_c - g).norm(dim=-1) / safe,
                                             torch.zeros_like(norm))),
            "b_grad_error": mean(torch.where(moved, (g_b - g).norm(dim=-1) / safe,
                                             torch.zeros_like(norm))),
        })
    return rows
