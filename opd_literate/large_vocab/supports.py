r"""Which support: the token sets that top-k OPD is computed on, and what each one costs.

The ``topk`` module teaches the approximations of a KL on one support, the teacher's top-$k$.
The frameworks use others. At a position, with the student's full distribution $p$ (softmax of
its logits $z$) and the teacher's $q$, a **support rule** picks a set $S$ of token ids; the
loss is then a divergence between $p$ and $q$ seen through $S$ only. With the captured masses
$P = \sum_{v \in S} p_v$ and $Q = \sum_{v \in S} q_v$, the rules in use are:

* ``"teacher_topk"``: the teacher's $k$ most likely tokens (what a served teacher reports);
* ``"student_topk"``: the student's $k$ most likely tokens (needs the teacher's log-probability
  at ids of the student's choosing, so a local teacher);
* ``"union"``: the teacher's top-$k$ followed by the student's, each id once ($k$ to $2k$
  tokens; the slots of the student's ids that the teacher already holds are marked invalid);
* ``"sampled"``: the one token $x_t$ the student sampled at the position;
* ``"argmax"``: the student's most likely token;
* ``"teacher_top1_sampled"``, ``"teacher_top1_argmax"``: the teacher's most likely token and
  then $x_t$ (or the student's argmax), once if they coincide.

The divergence is the generalized JSD of [opd_literate.opd.generalized_jsd_per_position][], in
TRL's convention: with $m = \beta q + (1 - \beta) p$,

$$
D_\beta(p, q) = \beta\, \mathrm{KL}(q \,\|\, m) + (1 - \beta)\, \mathrm{KL}(p \,\|\, m),
\qquad D_0 = \mathrm{KL}(q \,\|\, p), \quad D_1 = \mathrm{KL}(p \,\|\, q)
$$

(forward at $\beta = 0$, reverse at $\beta = 1$). Two ways of seeing $p$ and $q$ through $S$:

* ``"renormalize"`` (a): $D_\beta(\tilde p, \tilde q)$ with $\tilde p = p / P$,
  $\tilde q = q / Q$ on $S$;
* ``"tail"`` (b): $D_\beta(Tp, Tq)$, where $T$ maps every token outside $S$ to one bucket, so
  that $Tp = (p_v)_{v \in S} \cup \{1 - P\}$, a distribution over $|S| + 1$ outcomes (TRL's
  ``_add_tail_bucket``, "a (K+1)-th tail element").

**What each framework chooses** (read in the sources named; the chapter's table has them all):

* TRL 1.16.0, ``IWOPDTrainer`` with ``distillation_objective="jsd"``
  (``trl/experimental/iw_opd/iw_opd_trainer.py``, ``generalized_jsd_loss``): the teacher's
  top-$k$ for $\beta = 0$, the student's for $\beta = 1$, the union for $0 < \beta < 1$, each
  with (b) (``loss_add_tail=True``, the default) or (a). But its defaults, $\beta = 1$ and
  ``loss_top_k=1``, take another path (``_compute_sparse_top_1_divergence_loss``): for
  $\beta > 0$ and $k = 1$ the support is $x_t$ (``reverse_kl_top_1_mode="sampled"``, the
  default, or the student's argmax with ``"argmax"``), joined by the teacher's top-1 when
  $\beta < 1$. ``ServerDistillationTrainer`` (``trl/experimental/server_distillation/``) has
  the same two paths with a served teacher: the teacher's top-$k$ at $\beta = 0$, the top-1
  path with ``"sampled"`` only (``"argmax"`` is refused, the server cannot score a token of the
  student's choosing) and $k = 1$ (required) for $\beta > 0$. :func:`trl_support_rule` is
  that dispatch. The default objective of ``IWOPDTrainer`` (``"iw_opd"``) uses no support: a
  sampled-token advantage.
* Tinker cookbook (thinking-machines-lab/tinker-cookbook at ``TINKER_COOKBOOK_COMMIT``,
  ``tinker_cookbook/distillation/sdft.py``, ``build_reverse_kl_datums`` and
  ``reverse_kl_custom_loss``, with ``reverse=True``): the teacher's top-$K$ (``topk``, 20 by
  default), both sides renormalised, the reverse KL in REINFORCE form
  (:func:`reinforce_reverse_kl`), the first ``skip_first_n_tokens`` (3) completion tokens left
  out (:func:`skip_first_tokens`).
* verl (``clamps`` module): the teacher's top-$k$, forward, the unrenormalised sum (c) with
  clamps.
* NeMo-RL (NVIDIA-NeMo/RL at ``NEMO_RL_COMMIT``, ``nemo_rl/algorithms/loss/loss_functions.py``,
  ``DistillationLossFn``): the teacher's top-$k$ (``topk_logits_k``, 64 by default), the
  teacher renormalised over it; the student renormalised too, (a), or with
  ``zero_outside_topk`` its full softmax against a teacher of probability $e^{-100}$ off $S$;
  ``kl_type`` forward, reverse or ``"mixed"`` (the default), $w$ times the forward KL plus
  $1 - w$ times the reverse ($w$ = ``mixed_kl_weight``, 0.5), a weighted sum and not the JSD
  (:func:`nemo_rl_topk_kl`, ``NEMO_CHOICES``).

**Bounds, proved.**

1. *The tail bucket is a lower bound, on every support and for every $\beta$:*
    $D_\beta(Tp, Tq) \le D_\beta(p, q)$. $T$ is a deterministic map of outcomes and is linear
    in the distribution, so $Tm = \beta\, Tq + (1 - \beta)\, Tp$: the bucketed JSD is the JSD
    of the bucketed pair, and each of its two KLs decreases under $T$ (data processing, or the
    log-sum inequality on the bucket). Exactly, by the chain rule of KL over $\{S, \bar S\}$
    applied to both terms,

    $$
    D_\beta(p, q) - D_\beta(Tp, Tq) = \beta\,(1 - Q)\, \mathrm{KL}(\hat q \,\|\, \hat m)
    + (1 - \beta)\,(1 - P)\, \mathrm{KL}(\hat p \,\|\, \hat m) \ \ge\ 0,
    $$

    with $\hat p, \hat q, \hat m$ the tails of $p, q, m$ renormalised (at $\beta = 0$ and $1$
    this is the ``topk`` module's $(1 - A)\,\mathrm{KL}(\hat a \,\|\, \hat b)$). TRL caps each
    log-mass at $-10^{-7}$ before the tail (``TAIL_MAX_LOG_MASS``): where $P$ or $Q$ exceeds
    $e^{-10^{-7}}$ its bucket holds $c = 1 - e^{-10^{-7}} \approx 10^{-7}$ instead of
    $1 - P$ (the bucketed "distribution" then sums to slightly more than 1); elsewhere TRL's
    (b) is this one. The cap can lift (b) above the KL, but by less than $c$: only the bucket's
    term $f(\alpha, \gamma) = \alpha \log(\alpha / \gamma)$ changes (first argument's tail
    $\alpha$, second's $\gamma$). Raising $\gamma$ lowers it. Raising $\alpha < c \le \gamma$
    to $c$ moves $g(x) = x \log(x / \gamma)$, convex with $g(0) = g(\gamma) = 0$: down if
    $c \le \gamma / e$, and otherwise up by at most $-\min g = \gamma / e < c$. Raising both to
    $c$ gives $f = 0$, up from $f(\alpha, \gamma) \ge -\gamma / e > -c$. For the JSD the tests
    find the same margin on random cases.
2. *Renormalising is no bound:* (a) is 0 whenever $\tilde p = \tilde q$, however different
    the masses, and can exceed the full divergence (``topk`` module, both directions). With one
    token ($|S| = 1$, as in TRL's top-1 rules with ``loss_add_tail=False``) it is identically 0,
    value and gradient.
3. *TRL's sampled top-1 with the tail is a lower bound for every sampled token:* at
    $\beta = 1$, $S = \{x\}$ and (b) is the binary KL

    $$
    \mathrm{kl}_2(p_x, q_x) = p_x \log\frac{p_x}{q_x} + (1 - p_x) \log\frac{1 - p_x}{1 - q_x}
    \le \mathrm{KL}(p \,\|\, q)
    $$

    by 1., so its mean over $x \sim p$ is one too. Its gradient is
    not the reverse KL's in expectation: with $\lambda_x = \mathrm{logit}\, p_x -
    \mathrm{logit}\, q_x$ and $\nabla_z p_x = p_x (e_x - p)$,

    $$
    \mathbb{E}_{x \sim p}\, \nabla_z \mathrm{kl}_2(p_x, q_x) = \sum_x p_x^2 \lambda_x (e_x - p),
    \qquad
    \nabla_z \mathrm{KL}(p \,\|\, q) = \sum_x p_x \log\frac{p_x}{q_x}\, (e_x - p),
    $$

    the second being what the sampled-token OPD advantage $\log p_x - \log q_x$ gives in
    expectation. Where $p_x$ and $q_x$ are small, $\lambda_x \approx \log(p_x / q_x)$: the
    bucketed loss weights each token's term by one more factor $p_x$. The TRL loss differentiates
    through $\log p_x$ only (the sampled $x$ is data), which is what
    :func:`expected_sampled_divergence` averages.
4. *Tinker's REINFORCE form is renormalising, exactly, in value and gradient:* the surrogate
    $\sum_{v \in S} \tilde p_v\, \mathrm{sg}[\log \tilde p_v - \log \tilde q_v]$ has the value
    $\mathrm{KL}(\tilde p \,\|\, \tilde q)$, and its gradient differs from that of
    $\mathrm{KL}(\tilde p \,\|\, \tilde q)$ by $\sum_v \tilde p_v \nabla \log \tilde p_v =
    \nabla \sum_v \tilde p_v = 0$. So it inherits 2.: no bound; by the chain rule

    $$
    \mathrm{KL}(\tilde p \,\|\, \tilde q) = \frac{\mathrm{KL}(p \,\|\, q) - \mathrm{kl}_2(P, Q)
    - (1 - P)\, \mathrm{KL}(\hat p \,\|\, \hat q)}{P}.
    $$

5. *Of the two KLs only the forward one has an upper bound; on the teacher's top-$k$ it is
    computed here.* On any support, the worst consistent tail of the forward KL puts all of
    $1 - Q$ on the student's least likely unreported token, $(1 - Q) \log((1 - Q) / \min_{v
    \notin S} p_v)$, finite for finite logits (the tail sum is convex on that simplex, so its
    maximum is at a vertex); the generalized JSD with $0 < \beta < 1$ is at most $h(\beta)$
    whatever the distributions. The teacher's top-$k$ report says more than the masses:
    every unreported token has
    $q_v \le \mu = \min_{v \in S} q_v$. Over the teacher tails consistent with the report,
    $\{0 \le q_v \le \mu,\ \sum_{v \notin S} q_v = 1 - Q\}$, the tail sum
    $\sum_{v \notin S} q_v \log(q_v / p_v)$ is convex, so its maximum is at a vertex: $n =
    \lfloor (1 - Q)/\mu \rfloor$ tokens at $\mu$ and one at the remainder. Every vertex has the
    same $\sum q_v \log q_v$, and $-\sum q_v \log p_v$ is largest (rearrangement inequality)
    when the largest $q_v$ sit on the smallest $p_v$. That vertex is a teacher consistent with
    the report, so :func:`forward_kl_upper_bound` is the least upper bound:
    (b) $\le \mathrm{KL}(q \,\|\, p) \le$ it. The reverse KL has none: a consistent teacher can
    put $q_v = 0$ on a tail token the student gives mass to (whenever the other $V - k - 1$
    tail tokens can hold $1 - Q$), and the reverse KL is then $+\infty$. With a local teacher
    every divergence is computable exactly, so a bound only matters for a served one.

**Memory.** :func:`build_support` selects the ids chunk by chunk of rows under
``torch.no_grad``: ``torch.topk`` runs on the logits as given (any dtype, no copy), and the
teacher's log-normaliser is computed in the compute dtype for one chunk of rows at a time, so
no ``(tokens, V)`` float32 tensor is formed (``benchmarks/bench_supports.py`` measures it).
:func:`support_divergence` then needs the student's log-softmax over the whole row for its
gradient, as every top-$k$ loss in these frameworks does.

**Conventions.** NaN or $+\infty$ in a logit that is read, a row of $-\infty$ only, or logits
whose spread overflows the compute dtype are a ``ValueError``; $-\infty$ is an impossible
token. A term $a_v > 0 = b_v$ makes a KL $+\infty$ (with a zero gradient); a side with no mass
on $S$ has no renormalised distribution, and its terms are 0. A support's teacher
log-probabilities are $\le 0$ and sum to at most 1 in probability (to $\sqrt{\varepsilon}$ of
their dtype, float32's at least), or it is a ``ValueError``. Positions masked out are selected
away (``torch.where``), never multiplied by 0: their value and gradient are exactly 0 whatever
they hold, their ids included. Rounding, in the tail bucket: the student's tail $1 - P$ is
summed from its own entries off $S$; where $S$ holds every token neither side has a tail; and
with ``max_log_mass=None`` the reverse KL takes a teacher tail $1 - Q$ below $K\varepsilon$
(the rounding of the sum $Q$) as $K\varepsilon$, as ``topk.topk_kl`` does, which keeps (b) a
lower bound and finite. Half precision is computed in float32; every tensor created takes its
device from the inputs.

Imports: torch (and matplotlib inside :func:`plot_support_bias` only, through ``_figures``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._figures import new_figure, svg_bytes
from .._numerics import check_finite_number, check_float_tensor, check_mask, compute_dtype, select
from ..opd import generalized_jsd_per_position
from .clamps import clamp_study, verl_forward_kl_topk
from .topk import zipf_pair

__all__ = [
    "SUPPORTS",
    "LOSSES_ON_SUPPORT",
    "TAIL_MAX_LOG_MASS",
    "TINKER_SKIP_FIRST_N_TOKENS",
    "TINKER_TOPK",
    "TRL_VERSION",
    "TINKER_COOKBOOK_COMMIT",
    "NEMO_RL_COMMIT",
    "NEMO_RL_KL_TYPES",
    "NEMO_RL_MIXED_KL_WEIGHT",
    "NEMO_RL_TOPK",
    "NEMO_RL_LOG_INFINITESIMAL",
    "Support",
    "Choice",
    "CHOICES",
    "NemoChoice",
    "NEMO_CHOICES",
    "trl_support_rule",
    "build_support",
    "support_divergence",
    "reinforce_reverse_kl",
    "skip_first_tokens",
    "nemo_rl_topk_kl",
    "expected_sampled_divergence",
    "forward_kl_upper_bound",
    "support_bias",
    "support_study",
    "format_support_table",
    "plot_support_bias",
]

SUPPORTS = ("teacher_topk", "student_topk", "union", "sampled", "argmax", "teacher_top1_sampled",
            "teacher_top1_argmax")
"""The support rules of :func:`build_support` (module docstring)."""

LOSSES_ON_SUPPORT = ("renormalize", "tail")
"""(a) renormalise both sides over $S$; (b) add one bucket for the mass outside $S$."""

TAIL_MAX_LOG_MASS = -1e-7
r"""TRL 1.16.0's cap on a captured log-mass before its tail bucket, $\log(1 - e^{\min(\log P,
-10^{-7})})$ (``_add_tail_bucket`` of ``server_distillation_trainer.py``, ``iw_opd_trainer.py``,
``async_distillation_trainer.py``; ``add_tail_bucket`` of ``sdft/loss_utils.py``)."""

TINKER_SKIP_FIRST_N_TOKENS = 3
"""Tinker cookbook's default ``skip_first_n_tokens`` of ``build_reverse_kl_datums``."""

TINKER_TOPK = 20
"""Tinker cookbook's default ``topk`` (``K``) of its SDFT ``Config``."""

TRL_VERSION = "1.16.0"
"""The TRL release every TRL statement of this module is read from (the ``trl`` extra's pin)."""

TINKER_COOKBOOK_COMMIT = "9dfcc3a2cf44432d621a01005073dc6d76a1e87a"
"""The thinking-machines-lab/tinker-cookbook commit read (2026-08-19)."""

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
"""The NVIDIA-NeMo/RL commit every NeMo-RL statement of this module is read from."""

NEMO_RL_KL_TYPES = ("forward", "reverse", "mixed")
"""NeMo-RL's ``loss_fn.kl_type`` values (``DistillationLossFn.__init__`` asserts one of them)."""

NEMO_RL_MIXED_KL_WEIGHT = 0.5
"""NeMo-RL's default ``mixed_kl_weight``, the forward KL's weight in ``"mixed"`` (the
``DistillationLossConfig`` dataclass and ``examples/configs/distillation_math.yaml``)."""

NEMO_RL_TOPK = 64
"""NeMo-RL's default ``distillation.topk_logits_k`` (``DistillationConfig`` and
``distillation_math.yaml``)."""

NEMO_RL_LOG_INFINITESIMAL = -100.0
"""NeMo-RL's ``log_infinitesimal``: the teacher's log-probability off its top-$k$ under
``zero_outside_topk`` (set in ``DistillationLossFn.__init__``, not configurable)."""

# The width K of each rule's support, for a given k
_WIDTH = {"teacher_topk": lambda k: k, "student_topk": lambda k: k, "union": lambda k: 2 * k,
          "sampled": lambda k: 1, "argmax": lambda k: 1, "teacher_top1_sampled": lambda k: 2,
          "teacher_top1_argmax": lambda k: 2}
_NEEDS_TOKENS = ("sampled", "teacher_top1_sampled")


class Support(NamedTuple):
    r"""A support at every position: ``ids`` and ``valid`` ``(..., K)``, and the teacher's
    log-probabilities ``teacher_logp`` ``(..., K)`` at ``ids`` under its full softmax
    (undefined where ``valid`` is False)."""

    ids: torch.Tensor
    valid: torch.Tensor
    teacher_logp: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def _check_logits(name, logits, keep=None, values=True):
    """Floating ``(..., V)``, V >= 1; with ``values``, no NaN or +inf and a finite entry in each
    row (of the kept rows)."""
    check_float_tensor(name, logits, None)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a last (vocabulary) dimension of size >= 1, got "
                         f"shape {tuple(logits.shape)}")
    if values:
        _check_values(name, logits if keep is None else logits[keep])


def _check_values(name, read):
    """No NaN or +inf in ``read`` ``(..., V)``, a finite entry in each row. Each test makes a
    bool tensor of ``read``'s shape: :func:`build_support` calls it one chunk at a time."""
    if bool(read.isnan().any()):
        raise ValueError(f"{name} holds NaN at a position that is read")
    if bool((read == math.inf).any()):
        raise ValueError(f"{name} holds +inf: a logit must be finite, or -inf for an "
                         "impossible token")
    if bool((read == -math.inf).all(dim=-1).any()):
        raise ValueError(f"{name} has a position whose logits are all -inf: at least one token "
                         "must be possible")


def _check_rule(rule, k, V):
    if rule not in SUPPORTS:
        raise ValueError(f"rule must be one of {SUPPORTS}, got {rule!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"k must be an int in [1, V] = [1, {V}], got {k!r}")


def _check_tokens(tokens, rule, lead, V):
    if rule not in _NEEDS_TOKENS:
        if tokens is not None:
            raise ValueError(f"tokens are read by the rules {_NEEDS_TOKENS} only, not {rule!r}")
        return
    if (not isinstance(tokens, torch.Tensor) or tokens.is_floating_point()
            or tokens.is_complex() or tokens.dtype == torch.bool):
        raise TypeError(f"rule {rule!r} needs tokens, an integer torch.Tensor of the sampled ids, "
                        f"got {getattr(tokens, 'dtype', type(tokens).__name__)}")
    if tuple(tokens.shape) != tuple(lead):
        raise ValueError(f"tokens must have the leading shape of the logits {tuple(lead)}, got "
                         f"{tuple(tokens.shape)}")
    if bool(((tokens < 0) | (tokens >= V)).any()):
        raise ValueError(f"tokens must lie in [0, V) = [0, {V}), got values from "
                         f"{tokens.min().item()} to {tokens.max().item()}")


def _check_beta_and_approximation(beta, approximation, max_log_mass):
    beta = check_finite_number("beta", beta, low=0.0, high=1.0)
    if approximation not in LOSSES_ON_SUPPORT:
        raise ValueError(f"approximation must be one of {LOSSES_ON_SUPPORT}, got "
                         f"{approximation!r}")
    if max_log_mass is not None:
        max_log_mass = check_finite_number("max_log_mass", max_log_mass, high=0.0)
    return beta, max_log_mass


def _check_support(student_logits, support, keep, names=("support.ids", "support.valid",
                                                         "support.teacher_logp")):
    """The support's three tensors against the student's ``(..., V)`` logits (kept rows only);
    ``names``: the arguments they came as (:func:`forward_kl_upper_bound`'s report)."""
    ids_name, valid_name, logp_name = names
    if not isinstance(support, tuple) or len(support) != 3:
        raise TypeError(f"support must be a Support (ids, valid, teacher_logp), got "
                        f"{type(support).__name__}")
    ids, valid, teacher_logp = support
    lead, V = tuple(student_logits.shape[:-1]), student_logits.shape[-1]
    if (not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex()
            or ids.dtype == torch.bool):
        raise TypeError(f"{ids_name} must be an integer torch.Tensor, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.ndim != student_logits.ndim or tuple(ids.shape[:-1]) != lead or ids.shape[-1] < 1:
        raise ValueError(f"{ids_name} must have shape (..., K), K >= 1, with the leading shape "
                         f"of student_logits {lead}, got {tuple(ids.shape)}")
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise TypeError(f"{valid_name} must be a bool torch.Tensor, got "
                        f"{getattr(valid, 'dtype', type(valid).__name__)}")
    check_float_tensor(logp_name, teacher_logp, None)
    for name, x in ((valid_name, valid), (logp_name, teacher_logp)):
        if x.shape != ids.shape:
            raise ValueError(f"{name} must have the shape of {ids_name} {tuple(ids.shape)}, "
                             f"got {tuple(x.shape)}")
    # the ids of a masked-out position are not read: range-checked where kept, gathered as 0
    read_ids = ids if keep is None else ids[keep]
    if bool(((read_ids < 0) | (read_ids >= V)).any()):
        raise ValueError(f"{ids_name} must lie in [0, V) = [0, {V}), got values from "
                         f"{read_ids.min().item()} to {read_ids.max().item()}")
    ids = ids.long() if keep is None else torch.where(keep.unsqueeze(-1), ids.long(),
                                                      torch.zeros_like(ids, dtype=torch.long))
    used = valid if keep is None else valid & keep.unsqueeze(-1)
    rows = torch.ones(lead, dtype=torch.bool, device=ids.device) if keep is None else keep
    if bool((~used.any(dim=-1) & rows).any()):
        raise ValueError(f"{valid_name} must mark at least one slot of every position that is "
                         "read")
    # distinct ids among the used slots: the unused ones get ids V, V + 1, ... of their own
    slot = torch.arange(ids.shape[-1], device=ids.device)
    distinct = torch.where(used, ids, V + slot).sort(dim=-1).values
    if bool((distinct.diff(dim=-1) == 0).any()):
        raise ValueError(f"{ids_name} must be distinct among the valid slots of a position (a "
                         "repeated id would count its probability twice)")
    read = teacher_logp[used]
    if bool(read.isnan().any()) or bool((read > 0).any()):
        raise ValueError(f"{logp_name} must hold log-probabilities (<= 0, not NaN) at "
                         "the valid slots")
    # ... of one distribution: at most 1 in all, to sqrt(eps) of their dtype (float32's at
    # least) and the rounding of the sum, as topk_kl's reports (far above their rounding)
    dtype = compute_dtype(student_logits, teacher_logp)
    report = max(torch.finfo(teacher_logp.dtype).eps, torch.finfo(torch.float32).eps)
    tolerance = math.sqrt(report) + 4 * ids.shape[-1] * torch.finfo(dtype).eps
    mass = _masked_logsumexp(torch.where(used, teacher_logp.detach().to(dtype),
                                         torch.full((), -math.inf, dtype=dtype,
                                                    device=teacher_logp.device)))[..., 0].exp()
    if bool((mass > 1.0 + tolerance).any()):
        index = tuple((mass > 1.0 + tolerance).nonzero()[0].tolist())
        raise ValueError(f"{logp_name} must be log-probabilities of one distribution: "
                         f"its valid slots sum to {mass[index].item():.6g} > 1 in probability "
                         f"at position {index}")
    return ids, valid, teacher_logp


def _log_softmax(logits, dtype, name):
    """``log_softmax`` in ``dtype``, refusing a spread that overflows it."""
    z = logits.to(dtype)
    log_p = F.log_softmax(z, dim=-1)
    if bool(((log_p == -math.inf) & (z > -math.inf)).any()):
        raise ValueError(f"{name} span more than the range of {dtype} within a position: "
                         "log_softmax overflows (shift or rescale them)")
    return log_p


# ---------------------------------------------------------------------------------------------
# TRL's dispatch
# ---------------------------------------------------------------------------------------------
def trl_support_rule(beta, loss_top_k, reverse_kl_top_1_mode="sampled", *, vocab_size):
    r"""The support TRL 1.16.0's ``IWOPDTrainer`` (``distillation_objective="jsd"``, local
    teacher) computes its loss on, as ``(rule, k)``; ``("full", V)`` for the full vocabulary.

    The dispatch of ``IWOPDTrainer.compute_loss``: $\beta > 0$ with ``loss_top_k == 1`` goes to
    ``_compute_local_sparse_top_1_divergence_loss`` (the sampled token, or the student's
    argmax, joined by the teacher's top-1 unless $\beta = 1$); anything else to
    ``generalized_jsd_loss``, whose support is the teacher's top-$k$ at $\beta = 0$, the
    student's at $\beta = 1$ and the union between, or the full vocabulary when
    ``loss_top_k`` is 0 or at least $V$ (its test is ``V > top_k``).

    Examples
    --------
    >>> trl_support_rule(1.0, 1, vocab_size=8)   # the config's defaults
    ('sampled', 1)
    >>> trl_support_rule(0.5, 1, "argmax", vocab_size=8), trl_support_rule(1.0, 4, vocab_size=8)
    (('teacher_top1_argmax', 1), ('student_topk', 4))
    >>> trl_support_rule(0.0, 1, vocab_size=8), trl_support_rule(0.5, 8, vocab_size=8)
    (('teacher_topk', 1), ('full', 8))
    """
    beta = check_finite_number("beta", beta, low=0.0, high=1.0)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if isinstance(loss_top_k, bool) or not isinstance(loss_top_k, int) or loss_top_k < 0:
        raise ValueError(f"loss_top_k must be an int >= 0, got {loss_top_k!r}")
    if reverse_kl_top_1_mode not in ("sampled", "argmax"):
        raise ValueError(f"reverse_kl_top_1_mode must be 'sampled' or 'argmax', got "
                         f"{reverse_kl_top_1_mode!r}")
    if beta > 0 and loss_top_k == 1:
        return (reverse_kl_top_1_mode if beta == 1 else f"teacher_top1_{reverse_kl_top_1_mode}",
                1)
    if loss_top_k == 0 or loss_top_k >= vocab_size:
        return "full", vocab_size
    rule = "teacher_topk" if beta == 0 else "student_topk" if beta == 1 else "union"
    return rule, loss_top_k


# ---------------------------------------------------------------------------------------------
# Building a support, chunk by chunk of rows
# ---------------------------------------------------------------------------------------------
def _support_ids(rule, k, z, w, x):
    r"""``(ids, valid)`` ``(c, K)`` of one chunk: student logits ``z`` and teacher logits ``w``
    ``(c, V)`` as given, sampled ids ``x`` ``(c,)`` or None."""
    if rule == "teacher_topk":
        ids = w.topk(k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if rule == "student_topk":
        ids = z.topk(k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if rule == "union":
        # the teacher's ids first, then the student's; a student id the teacher already holds
        # is a duplicate slot, marked invalid (TRL keeps the first occurrence)
        teacher, student = w.topk(k, dim=-1).indices, z.topk(k, dim=-1).indices  # (c, k) each
        duplicate = (student.unsqueeze(-1) == teacher.unsqueeze(-2)).any(dim=-1)  # (c, k)
        ids = torch.cat([teacher, student], dim=-1)  # (c, 2k)
        return ids, torch.cat([torch.ones_like(duplicate), ~duplicate], dim=-1)
    # the top-1 rules: TRL takes the argmax (torch.argmax picks the first of equal maxima)
    reverse = (x if rule in _NEEDS_TOKENS else z.argmax(dim=-1)).unsqueeze(-1)  # (c, 1)
    if rule in ("sampled", "argmax"):
        return reverse, torch.ones_like(reverse, dtype=torch.bool)
    top1 = w.argmax(dim=-1, keepdim=True)  # (c, 1)
    return torch.cat([top1, reverse], dim=-1), torch.cat([torch.ones_like(top1, dtype=torch.bool),
                                                          reverse != top1], dim=-1)


def build_support(rule, k, student_logits, teacher_logits, *, tokens=None, chunk_size=128):
    r"""The support of ``rule`` at every position, with the teacher's log-probabilities on it.

    Computed ``chunk_size`` rows at a time without autograd: per chunk, ``torch.topk`` (or
    ``argmax``) on the logits as they are, and the teacher's log-normaliser
    $\log \sum_v e^{w_v}$ over its row in the compute dtype (float32 for half precision). The
    chunks are independent, so the result does not depend on ``chunk_size``, bit for bit.

    Parameters
    ----------
    rule : str
        One of ``SUPPORTS``.
    k : int
        $1 \le k \le V$ (the top-1 rules ignore it beyond the check).
    student_logits, teacher_logits : torch.Tensor
        ``(..., V)`` floating, the same shape.
    tokens : torch.Tensor, optional
        ``(...)`` integer, the sampled ids $x_t$; required by ``"sampled"`` and
        ``"teacher_top1_sampled"``, refused by the others.
    chunk_size : int
        Rows per chunk.

    Returns
    -------
    Support
        ``ids`` (int64), ``valid`` (bool) and ``teacher_logp`` (compute dtype), ``(..., K)``
        with $K = k$, $2k$ (union), 1 or 2 (the top-1 rules).

    Examples
    --------
    The union of the teacher's top-2 $\{0, 1\}$ and the student's $\{2, 0\}$: token 0 once.

    >>> teacher = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    >>> student = torch.log(torch.tensor([0.3, 0.1, 0.5, 0.1]))
    >>> s = build_support("union", 2, student, teacher)
    >>> s.ids.tolist(), s.valid.tolist()
    ([0, 1, 2, 0], [True, True, True, False])
    >>> [round(v, 4) for v in s.teacher_logp.exp().tolist()[:3]]
    [0.5, 0.3, 0.1]
    """
    # the values are checked chunk by chunk below: a check of the whole (N, V) logits would
    # make an (N, V) bool tensor, a quarter of the float32 tensor this function avoids
    _check_logits("student_logits", student_logits, values=False)
    _check_logits("teacher_logits", teacher_logits, values=False)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits must have the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    lead, V = tuple(student_logits.shape[:-1]), student_logits.shape[-1]
    _check_rule(rule, k, V)
    _check_tokens(tokens, rule, lead, V)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype = compute_dtype(student_logits, teacher_logits)
    K = _WIDTH[rule](k)
    with torch.no_grad():
        z = student_logits.detach().reshape(-1, V)  # (N, V), a view: nothing copied
        w = teacher_logits.detach().reshape(-1, V)
        x = None if tokens is None else tokens.reshape(-1).long()
        N, device = z.shape[0], z.device
        ids = torch.zeros((N, K), dtype=torch.long, device=device)
        valid = torch.zeros((N, K), dtype=torch.bool, device=device)
        teacher_logp = torch.zeros((N, K), dtype=dtype, device=device)
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            _check_values("student_logits", z[rows])
            _check_values("teacher_logits", w[rows])
            ids_c, valid_c = _support_ids(rule, k, z[rows], w[rows],
                                          None if x is None else x[rows])
            # log q_v = w_v - log sum exp(w), in the one (chunk, V) buffer of the compute dtype:
            # a copy of the chunk, turned in place into exp(w - max w) once w_S is read
            teacher = w[rows].to(dtype, copy=True)  # (c, V)
            w_S = teacher.gather(-1, ids_c)  # (c, K)
            top = teacher.amax(dim=-1, keepdim=True)  # (c, 1), finite (checked above)
            log_sum = teacher.sub_(top).exp_().sum(dim=-1, keepdim=True).log_()
            # (w_S - top) - log_sum: top + log_sum first would round to top's ulp (0.004 at
            # 65,504), so that two log-probabilities of 1/2 summed to 1.0017 in probability
            log_q = (w_S - top) - log_sum
            del teacher
            if bool(((log_q == -math.inf) & (w_S > -math.inf)).any()):
                raise ValueError(f"teacher_logits span more than the range of {dtype} within a "
                                 "position: its log-softmax overflows (shift or rescale them)")
            ids[rows], valid[rows], teacher_logp[rows] = ids_c, valid_c, log_q
    return Support(ids.reshape(*lead, K), valid.reshape(*lead, K),
                   teacher_logp.reshape(*lead, K))


# ---------------------------------------------------------------------------------------------
# The divergence on a support
# ---------------------------------------------------------------------------------------------
def _masked_logsumexp(x):
    r"""$\log \sum e^x$ over the last axis (kept); $-\infty$ with a zero gradient for a row of
    $-\infty$ only (``torch.logsumexp`` has a NaN gradient there)."""
    empty = (x == -math.inf).all(dim=-1, keepdim=True)
    value = torch.logsumexp(torch.where(empty, torch.zeros_like(x), x), dim=-1, keepdim=True)
    return torch.where(empty, torch.full_like(value, -math.inf), value)


def _tail_log_mass(log_mass):
    r"""$\log(1 - A)$ from $\log A$, $-\infty$ with a zero gradient where the mass is 1 (or
    rounds above it)."""
    capped = log_mass.clamp(max=0.0)
    full = capped >= 0.0
    safe = torch.where(full, torch.full_like(capped, -1.0), capped)
    return torch.where(full, torch.full_like(capped, -math.inf), torch.log(-torch.expm1(safe)))


def _masked_kl(log_a, log_b):
    r"""$\sum a (\log a - \log b)$ over the last axis, with $0 \log 0 = 0$ and $+\infty$ (and a
    zero gradient) where $a > 0 = b$. Unused slots hold $-\infty$ in ``log_a``."""
    support = log_a > -math.inf
    both = support & (log_b > -math.inf)
    zeros = torch.zeros_like(log_a)
    la, lb = torch.where(both, log_a, zeros), torch.where(both, log_b, zeros)
    total = torch.where(both, la.exp() * (la - lb), zeros).sum(dim=-1)
    infinite = (support & ~both).any(dim=-1)
    return torch.where(infinite, torch.full_like(total, math.inf), total)


def _divergence(s, t, beta):
    r"""$D_\beta$ between the student's and the teacher's (sub)distributions ``exp(s)``,
    ``exp(t)`` over the last axis ($-\infty$: an unused slot)."""
    if beta == 0.0:
        return _masked_kl(t, s)  # forward KL(q || p)
    if beta == 1.0:
        return _masked_kl(s, t)  # reverse KL(p || q)
    # log m = log(beta q + (1 - beta) p); an outcome empty on both sides stays empty
    empty = (s == -math.inf) & (t == -math.inf)
    zeros = torch.zeros_like(s)
    log_m = torch.logaddexp(torch.where(empty, zeros, t) + math.log(beta),
                            torch.where(empty, zeros, s) + math.log1p(-beta))
    log_m = torch.where(empty, torch.full_like(log_m, -math.inf), log_m)
    # beta KL(q || m) + (1 - beta) KL(p || m)
    return beta * _masked_kl(t, log_m) + (1.0 - beta) * _masked_kl(s, log_m)


def _sparse_divergence(s, t, valid, beta, approximation, max_log_mass, rest=None):
    r"""The divergence seen through the support: ``s``, ``t`` ``(..., K)`` are $\log p_v$ and
    $\log q_v$ at the slots (full softmaxes), ``valid`` which slots count.

    ``rest``: ``(student_tail, covers)`` ``(..., 1)``, the student's exact $\log(1 - P)$ (its
    own entries off $S$ summed) and where $S$ holds every token; None: the tails from $\log P$
    and $\log Q$ alone (:func:`expected_sampled_divergence`, whose $S_x$ are one or two ids)."""
    # unused slots hold no mass on either side (their values, garbage or not, are not read)
    s = torch.where(valid, s, torch.full_like(s, -math.inf))
    t = torch.where(valid, t, torch.full_like(t, -math.inf))
    log_P, log_Q = _masked_logsumexp(s), _masked_logsumexp(t)  # (..., 1) each
    if approximation == "renormalize":
        # (a): p / P and q / Q on S. A side with no mass on S (log mass -inf) keeps -inf
        # everywhere: -inf - (-inf) would be NaN, so it is divided by 1 instead.
        s = s - torch.where(log_P > -math.inf, log_P, torch.zeros_like(log_P))
        t = t - torch.where(log_Q > -math.inf, log_Q, torch.zeros_like(log_Q))
        return _divergence(s, t, beta)
    # (b): one more outcome, the tail, of mass 1 - P (student) and 1 - Q (teacher)
    student_tail, teacher_tail = _tail_log_mass(log_P), _tail_log_mass(log_Q)
    if rest is not None:
        # 1 - P from P (a sum rounded to 1 - 1e-16, or to 1) would read rounding as tail mass,
        # or lose a real one: the student's tail is summed from its own entries off S, and
        # where S holds every token neither side has a tail (as topk_kl at k = V).
        student_tail, covers = rest
        teacher_tail = torch.where(covers, torch.full_like(teacher_tail, -math.inf),
                                   teacher_tail)
    if max_log_mass is None:
        if beta == 1.0:
            # the reverse bucket (1 - P) log((1 - P) / (1 - Q)) is +inf where 1 - Q rounds to 0
            # but the true KL is finite: a teacher tail below K eps (the rounding of the sum Q)
            # is taken as K eps, at least the true one, so (b) stays a lower bound (topk_kl's)
            floor = math.log(s.shape[-1] * torch.finfo(t.dtype).eps)
            teacher_tail = torch.where(student_tail > -math.inf, teacher_tail.clamp_min(floor),
                                       teacher_tail)
    else:
        # TRL's log(1 - e^min(log A, c)) = max(log(1 - A), log(1 - e^c))
        cap = math.log(-math.expm1(max_log_mass)) if max_log_mass < 0 else -math.inf
        student_tail, teacher_tail = student_tail.clamp_min(cap), teacher_tail.clamp_min(cap)
    s = torch.cat([s, student_tail], dim=-1)
    t = torch.cat([t, teacher_tail], dim=-1)
    return _divergence(s, t, beta)


def _inputs(student_logits, support, mask):
    """Check the inputs of a loss on a support; return ``(keep, ids, valid, teacher_logp)``."""
    check_float_tensor("student_logits", student_logits, None)
    if student_logits.ndim < 1 or student_logits.shape[-1] < 1:
        raise ValueError(f"student_logits must have a last (vocabulary) dimension of size >= 1, "
                         f"got shape {tuple(student_logits.shape)}")
    keep = None if mask is None else check_mask(
        mask, "the leading shape of student_logits", tuple(student_logits.shape[:-1]))
    _check_logits("student_logits", student_logits, keep)
    ids, valid, teacher_logp = _check_support(student_logits, support, keep)
    return keep, ids, valid, teacher_logp


def _slots(student_logits, ids, valid, teacher_logp, keep):
    """``(log_p, s, t, valid)``: the student's full log-softmax, and the student's and the
    teacher's log-probabilities at the slots with the rows masked out made harmless: zero
    logits, the teacher equal to the student on the first slot only (a divergence of 0, finite
    gradients)."""
    dtype = compute_dtype(student_logits, teacher_logp)
    z = student_logits
    if keep is not None:
        z = torch.where(keep.unsqueeze(-1), z, torch.zeros_like(z))
    log_p = _log_softmax(z, dtype, "student_logits")  # (..., V)
    s = log_p.gather(-1, ids)  # (..., K)
    t = teacher_logp.detach().to(dtype)
    if keep is not None:
        first = torch.zeros_like(valid)
        first[..., 0] = True
        valid = torch.where(keep.unsqueeze(-1), valid, first)
        t = torch.where(keep.unsqueeze(-1), t, s.detach())
    return log_p, s, t, valid


def _in_support(log_p, ids, valid):
    """``(..., V)`` bool: the tokens held by a valid slot. A count, as a duplicate slot of the
    union is invalid (a scatter of ``valid`` could let its False overwrite the valid slot's
    True)."""
    count = torch.zeros_like(log_p, dtype=torch.long).scatter_add_(-1, ids, valid.long())
    return count > 0


def _gathered(student_logits, ids, valid, teacher_logp, keep, tails=False):
    """``(s, t, valid)`` of :func:`_slots`; with ``tails``, also ``rest`` of
    :func:`_sparse_divergence` from the full log-softmax."""
    log_p, s, t, valid = _slots(student_logits, ids, valid, teacher_logp, keep)
    if not tails:
        return s, t, valid
    in_S = _in_support(log_p, ids, valid)
    student_tail = _masked_logsumexp(torch.where(in_S, torch.full_like(log_p, -math.inf), log_p))
    return s, t, valid, (student_tail, in_S.all(dim=-1, keepdim=True))


def support_divergence(student_logits, support, *, beta, approximation="tail", mask=None,
                       max_log_mass=TAIL_MAX_LOG_MASS):
    r"""$D_\beta$ seen through a support, at every position: (a) or (b) (module docstring).

    This is the per-token loss of TRL's ``generalized_jsd_loss`` and
    ``_compute_sparse_top_1_divergence_loss`` (with ``max_log_mass`` its cap, the default) on
    the support they choose (:func:`build_support`, :func:`trl_support_rule`), before TRL's
    reduction. ``max_log_mass=None`` is the exact tail bucket, a lower bound of $D_\beta$ on
    every support.

    A position whose teacher log-probabilities are $-\infty$ at every valid slot (a teacher
    that gives $S$ no mass) is no error: its side of (a) has no renormalised distribution and
    no terms, and (b) puts its whole mass in the bucket. The reverse KL ($\beta = 1$) is then
    $+\infty$ with a zero gradient where the student has mass on $S$; the forward KL is 0 with
    (a) and $-\log(1 - P)$ with (b) (``max_log_mass=None``); where the student has mass on $S$
    the JSD with (a) is the constant $-(1 - \beta) \log(1 - \beta)$, with a zero gradient.

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(..., V)`` floating, carrying the gradient.
    support : Support
        ``(..., K)`` ids, valid slots and the teacher's log-probabilities (treated as constants):
        at the valid slots of a position distinct ids in ``[0, V)`` and log-probabilities
        $\le 0$ whose probabilities sum to at most 1 (module docstring, "Conventions").
    beta : float
        $\beta \in [0, 1]$: 0 forward KL, 1 reverse KL, between the generalized JSD.
    approximation : str
        ``"tail"`` (TRL's default, ``loss_add_tail=True``) or ``"renormalize"``.
    mask : torch.Tensor, optional
        0/1 over the leading shape: 0 gives exactly 0 in value and gradient, and the row is not
        read.
    max_log_mass : float or None
        The cap $c \le 0$ on $\log P$ and $\log Q$ before the tail (TRL: $-10^{-7}$).

    Returns
    -------
    torch.Tensor
        ``(...)``, in the compute dtype.

    Examples
    --------
    The sampled token $x = 0$ with $p_x = 0.5$, $q_x = 0.25$: the reverse tail bucket is the
    binary KL $0.5 \log 2 + 0.5 \log\frac{0.5}{0.75} = 0.1438$; renormalised, one token is 0.

    >>> student = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    >>> one = Support(torch.tensor([0]), torch.tensor([True]), torch.log(torch.tensor([0.25])))
    >>> round(support_divergence(student, one, beta=1.0).item(), 4)
    0.1438
    >>> support_divergence(student, one, beta=1.0, approximation="renormalize").item()
    0.0
    """
    keep, ids, valid, teacher_logp = _inputs(student_logits, support, mask)
    beta, max_log_mass = _check_beta_and_approximation(beta, approximation, max_log_mass)
    s, t, valid, rest = _gathered(student_logits, ids, valid, teacher_logp, keep, tails=True)
    return select(keep, _sparse_divergence(s, t, valid, beta, approximation, max_log_mass,
                                           rest))


def reinforce_reverse_kl(student_logits, support, *, mask=None):
    r"""Tinker cookbook's reverse KL over a support, in REINFORCE form, at every position.

    $$
    \ell = \sum_{v \in S} \tilde p_v\, \mathrm{sg}\bigl[\log \tilde p_v - \log \tilde q_v\bigr],
    \qquad \tilde p = p / P, \quad \tilde q = q / Q,
    $$

    as ``reverse_kl_custom_loss`` of ``tinker_cookbook/distillation/sdft.py`` computes it on the
    datums of ``build_reverse_kl_datums`` (the teacher's top-$K$, $K$ = ``TINKER_TOPK``; the
    student's log-probabilities at those ids come from the Tinker service, whose code we did
    not read, and are taken here as the student's full log-softmax). Its value and gradient
    are those of $\mathrm{KL}(\tilde p \,\|\, \tilde q)$ (module docstring, 4.). A slot whose
    teacher log-probability is $-\infty$ is not in the support: Tinker packs $\tilde q$ into
    its ``weights`` and reads ``weights > 0`` as the slot mask. A position whose teacher
    log-probabilities are $-\infty$ at every valid slot has no slot left and adds exactly 0,
    value and gradient: Tinker's weights there are $-\infty - (-\infty)$, NaN (``sdft.py``
    line 583 at ``TINKER_COOKBOOK_COMMIT``), ``weights > 0`` is False at every slot and its
    position mask drops the position (lines 642 and 643). Reduce with a plain sum over the
    positions, as Tinker does, after :func:`skip_first_tokens`.

    Examples
    --------
    >>> student = torch.log(torch.tensor([0.4, 0.4, 0.2]))
    >>> top2 = Support(torch.tensor([0, 1]), torch.tensor([True, True]),
    ...                torch.log(torch.tensor([0.6, 0.2])))
    >>> # p~ = (1/2, 1/2), q~ = (3/4, 1/4): 1/2 log(2/3) + 1/2 log 2 = 0.1438
    >>> round(reinforce_reverse_kl(student, top2).item(), 4)
    0.1438
    """
    keep, ids, valid, teacher_logp = _inputs(student_logits, support, mask)
    s, t, valid = _gathered(student_logits, ids, valid, teacher_logp, keep)
    valid = valid & (t > -math.inf)  # weights > 0
    s = torch.where(valid, s, torch.full_like(s, -math.inf))
    t = torch.where(valid, t, torch.full_like(t, -math.inf))
    log_P = _masked_logsumexp(s)  # -inf if the student has no mass on S: p~ is then 0
    log_p = s - torch.where(log_P > -math.inf, log_P, torch.zeros_like(log_P))  # log p~
    # log q~ (a valid slot has t > -inf: finite). A teacher with no mass on S leaves no slot,
    # and its -inf - (-inf) = NaN is avoided by dividing by 1: the position adds exactly 0.
    log_Q = _masked_logsumexp(t)
    log_q = t - torch.where(log_Q > -math.inf, log_Q, torch.zeros_like(log_Q))
    # the advantage log p~ - log q~, a constant; 0 log 0 = 0 on slots the student cannot emit
    mass = valid & (log_p > -math.inf)
    advantage = torch.where(mass, log_p - log_q, torch.zeros_like(log_p)).detach()
    p = torch.where(mass, log_p, torch.zeros_like(log_p)).exp()
    terms = torch.where(mass, p * advantage, torch.zeros_like(p))
    return select(keep, terms.sum(dim=-1))


def skip_first_tokens(mask, n=TINKER_SKIP_FIRST_N_TOKENS):
    r"""The completion mask without the first ``n`` completion tokens of each sequence.

    Tinker cookbook's ``skip_first_n_tokens`` (3 by default, "matching the reference
    implementation"): the $t$-th position where ``mask`` is 1, counted from 0, enters the loss
    only if $t \ge n$.

    Parameters
    ----------
    mask : torch.Tensor
        ``(B, T)`` 0/1, the completion tokens.
    n : int
        How many to skip, $\ge 0$.

    Returns
    -------
    torch.Tensor
        ``(B, T)`` bool.

    Examples
    --------
    >>> skip_first_tokens(torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])).int().tolist()
    [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]]
    """
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        raise ValueError(f"mask must be a (B, T) torch.Tensor, got "
                         f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}")
    keep = check_mask(mask, "(B, T)", tuple(mask.shape))
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    # the 1-based count of completion tokens up to each position
    return keep & (keep.long().cumsum(dim=-1) > n)


# ---------------------------------------------------------------------------------------------
# NeMo-RL's top-k loss
# ---------------------------------------------------------------------------------------------
def nemo_rl_topk_kl(student_logits, support, *, kl_type="mixed",
                    mixed_kl_weight=NEMO_RL_MIXED_KL_WEIGHT, zero_outside_topk=False, mask=None):
    r"""NeMo-RL's distillation loss on the teacher's top-$k$, at every position.

    ``DistillationLossFn`` of ``nemo_rl/algorithms/loss/loss_functions.py`` (NVIDIA-NeMo/RL at
    ``NEMO_RL_COMMIT``, lines 1109 to 1182), on the log-probabilities that
    ``get_distillation_topk_logprobs_from_logits`` of ``nemo_rl/distributed/model_utils.py``
    gives it (lines 1856 to 2020). The teacher is always renormalised over its top-$k$ $S$,
    $\tilde q = q / Q$ (a ``log_softmax`` of its $k$ reported logits, line 2011). The student
    is renormalised too, $\tilde p = p / P$ (a ``log_softmax`` of its logits at $S$, line
    2003), unless ``zero_outside_topk``, where it keeps its full softmax $p$ (line 1973). With
    $w$ = ``mixed_kl_weight``:

    $$
    \ell_{\text{forward}} = \mathrm{KL}(\tilde q \,\|\, \tilde p), \quad
    \ell_{\text{reverse}} = \mathrm{KL}(\tilde p \,\|\, \tilde q), \quad
    \ell_{\text{mixed}} = w\, \ell_{\text{forward}} + (1 - w)\, \ell_{\text{reverse}},
    $$

    a weighted sum of the two KLs (no mixture distribution: not the JSD). With
    ``zero_outside_topk`` the teacher is $\tilde q$ on $S$ and $e^{\lambda}$ off it,
    $\lambda$ = ``NEMO_RL_LOG_INFINITESIMAL`` $= -100$ ("zero" outside its top-$k$), against
    the student's $p$:

    $$
    \ell_{\text{forward}} = \sum_{v \in S} \tilde q_v \log\frac{\tilde q_v}{p_v}, \qquad
    \ell_{\text{reverse}} = \sum_{v \in S} p_v \log\frac{p_v}{\tilde q_v}
    + \sum_{v \notin S} p_v\, (\log p_v - \lambda),
    $$

    and the mixed loss the same weighted sum. NeMo-RL adds the second sum of the reverse KL
    only when ``kl_type`` is not ``"forward"`` (line 1155), as
    $H_{\text{rest}} - \lambda P_{\text{rest}}$ with $H_{\text{rest}} = \sum_v p_v \log p_v -
    \sum_{v \in S} p_v \log p_v$ and $P_{\text{rest}} = 1 - P$ (lines 1156 to 1159), times
    $1 - w$ for ``"mixed"``; here it is summed from the student's entries off $S$, which is
    the same sum without the cancellation (exactly 0 where $S$ holds every token). The forward
    term off $S$ is $0$ (a teacher of probability 0 there), up to $e^{-100}$ per token.

    In terms of the full KLs (exact): with verl's unrenormalised sums
    $c_q = \sum_{v \in S} q_v \log(q_v / p_v)$ and $c_p = \sum_{v \in S} p_v \log(p_v / q_v)$,
    the renormalised losses are $c_q / Q - \log Q + \log P$ and $c_p / P - \log P + \log Q$;
    with ``zero_outside_topk`` the forward is $c_q / Q - \log Q$ and the reverse is

    $$
    \mathrm{KL}(p \,\|\, q) + P \log Q + \sum_{v \notin S} p_v\, (\log q_v - \lambda),
    $$

    above the reverse KL by about $(1 - P)(100 + \log q_v)$ wherever the student has mass off
    $S$ on tokens the teacher gives more than $e^{-100}$.

    At $k = V$ every option is the full divergence: $\mathrm{KL}(q \,\|\, p)$,
    $\mathrm{KL}(p \,\|\, q)$ or their weighted sum. ``mixed`` with $w = 1$ is ``forward`` and
    with $w = 0$ ``reverse``, exactly (an infinite term times a weight 0 is not read).

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(..., V)`` floating, carrying the gradient; divided by the sampling temperature
        first, as NeMo-RL's workers divide each model's logits by its own
        ``generation.temperature`` (1.0 in ``examples/configs/distillation_math.yaml``)
        before the top-$k$ and the loss.
    support : Support
        The teacher's top-$k$ (``build_support("teacher_topk", ...)``, $k$ =
        ``distillation.topk_logits_k``, ``NEMO_RL_TOPK`` = 64 shipped), checked as for
        :func:`support_divergence`. Only $\tilde q$ is read, so ``teacher_logp`` may be the
        full-softmax log-probabilities or NeMo-RL's ``log_softmax`` of the $k$ reported
        logits.
    kl_type : str
        One of ``NEMO_RL_KL_TYPES``; ``"mixed"`` by default, as ``DistillationLossConfig`` and
        ``distillation_math.yaml`` (the recipes under ``examples/configs/recipes/llm/`` set
        ``"reverse"``).
    mixed_kl_weight : float
        $w \in [0, 1]$, the weight of the forward KL in ``"mixed"`` (0.5 by default); read by
        ``"mixed"`` only.
    zero_outside_topk : bool
        ``False`` by default (both yaml and dataclass).
    mask : torch.Tensor, optional
        0/1 over the leading shape: 0 gives exactly 0 in value and gradient, and the row is not
        read.

    Returns
    -------
    torch.Tensor
        ``(...)``, in the compute dtype (float32 for half precision, as NeMo-RL casts the
        student's logits to float32). $+\infty$ with a zero gradient where a KL term is
        $a_v \log(a_v / 0)$, $a_v > 0$. A term of probability 0 (a student token that cannot
        be emitted, a teacher slot of log-probability $-\infty$) is NaN in NeMo-RL's form,
        $0 \cdot (-\infty)$, and its limit 0 here. NeMo-RL reduces
        the per-position values as $\sum_t m_t \ell_t / (N + 10^{-8})$, $N$ the number of
        valid tokens of the global batch (``masked_mean`` with ``global_valid_toks``, line
        1193).

    Examples
    --------
    The teacher's top-2 of $V = 3$, $q_S = (0.6, 0.2)$, so $\tilde q = (3/4, 1/4)$; the student
    $p = (0.4, 0.4, 0.2)$, $\tilde p = (1/2, 1/2)$:

    >>> student = torch.log(torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64))
    >>> top2 = Support(torch.tensor([0, 1]), torch.tensor([True, True]),
    ...                torch.log(torch.tensor([0.6, 0.2], dtype=torch.float64)))
    >>> # forward 3/4 log(3/2) + 1/4 log(1/2) = 0.1308; reverse 1/2 log(2/3) + 1/2 log 2 = 0.1438
    >>> [round(nemo_rl_topk_kl(student, top2, kl_type=t).item(), 4)
    ...  for t in ("forward", "reverse", "mixed")]
    [0.1308, 0.1438, 0.1373]

    With ``zero_outside_topk`` the reverse KL adds $0.2 (\log 0.2 + 100) = 19.68$ for the
    student's mass off $S$, to $0.4 \log\frac{0.4}{3/4} + 0.4 \log\frac{0.4}{1/4} = -0.0634$:

    >>> round(nemo_rl_topk_kl(student, top2, kl_type="reverse", zero_outside_topk=True).item(), 4)
    19.6147
    """
    keep, ids, valid, teacher_logp = _inputs(student_logits, support, mask)
    if kl_type not in NEMO_RL_KL_TYPES:
        raise ValueError(f"kl_type must be one of {NEMO_RL_KL_TYPES}, got {kl_type!r}")
    w = check_finite_number("mixed_kl_weight", mixed_kl_weight, low=0.0, high=1.0)
    if not isinstance(zero_outside_topk, bool):
        raise TypeError(f"zero_outside_topk must be a bool, got "
                        f"{type(zero_outside_topk).__name__} {zero_outside_topk!r}")
    # log p_v on S; a masked-out row has one slot, the teacher equal to the student (a loss of 0)
    log_p, s, t, valid = _slots(student_logits, ids, valid, teacher_logp, keep)
    s = torch.where(valid, s, torch.full_like(s, -math.inf))
    t = torch.where(valid, t, torch.full_like(t, -math.inf))
    # log q~ = t - log Q (line 2011); a teacher with no mass on S has no terms (divided by 1)
    log_Q = _masked_logsumexp(t)
    log_q = t - torch.where(log_Q > -math.inf, log_Q, torch.zeros_like(log_Q))
    if zero_outside_topk:
        log_s = s  # the student's full log-softmax at S (line 1973)
    else:
        # log p~ = s - log P (line 2003)
        log_P = _masked_logsumexp(s)
        log_s = s - torch.where(log_P > -math.inf, log_P, torch.zeros_like(log_P))
    forward = _masked_kl(log_q, log_s)  # sum_S q~ (log q~ - log p)
    reverse = _masked_kl(log_s, log_q)  # sum_S p (log p - log q~)
    if zero_outside_topk and kl_type != "forward":
        # the teacher's e^lambda off S: sum_{v not in S} p_v (log p_v - lambda), 0 log 0 = 0
        off = ~_in_support(log_p, ids, valid) & (log_p > -math.inf)
        lp = torch.where(off, log_p, torch.zeros_like(log_p))
        rest = torch.where(off, lp.exp() * (lp - NEMO_RL_LOG_INFINITESIMAL),
                           torch.zeros_like(lp))
        reverse = reverse + rest.sum(dim=-1)
    if kl_type == "forward" or (kl_type == "mixed" and w == 1.0):
        loss = forward
    elif kl_type == "reverse" or w == 0.0:
        loss = reverse
    else:
        # w KL_forward + (1 - w) KL_reverse (lines 1175 to 1180)
        loss = w * forward + (1.0 - w) * reverse
    return select(keep, loss)


def expected_sampled_divergence(student_logits, teacher_logits, *, beta,
                                approximation="tail", max_log_mass=TAIL_MAX_LOG_MASS):
    r"""TRL's top-1 loss with a sampled token, averaged exactly over the token $x \sim p$.

    $$
    \bar\ell = \sum_{x} \mathrm{sg}[p_x]\; \ell(z; S_x), \qquad
    S_x = \{x\} \ (\beta = 1), \quad \{\arg\max q, x\} \ (0 < \beta < 1),
    $$

    with $\ell$ = :func:`support_divergence` on $S_x$. The sampling weights are constants, as
    the sampled token is data to TRL: the value is the expected loss and the gradient the
    expected gradient of TRL's loss, its mean over an infinitely large batch of on-policy
    samples (module docstring, 3.). One sum over the $V$ tokens, no sampling.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(..., V)`` floating, the same shape.
    beta : float
        $0 < \beta \le 1$ (TRL's top-1 path is taken for $\beta > 0$ only).
    approximation, max_log_mass
        As for :func:`support_divergence`.

    Returns
    -------
    torch.Tensor
        ``(...)``, in the compute dtype.

    Examples
    --------
    A student sure of one token samples it always: the loss of that one support.

    >>> student = torch.tensor([0.0, -math.inf, -math.inf])
    >>> teacher = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    >>> round(expected_sampled_divergence(student, teacher, beta=1.0).item(), 4)  # log 2
    0.6931
    """
    _check_logits("student_logits", student_logits)
    _check_logits("teacher_logits", teacher_logits)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits must have the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    beta, max_log_mass = _check_beta_and_approximation(beta, approximation, max_log_mass)
    if beta == 0.0:
        raise ValueError("beta must be > 0: TRL takes its top-1 path for beta > 0 only (at "
                         "beta = 0 the support is the teacher's top-k)")
    dtype = compute_dtype(student_logits, teacher_logits)
    log_p = _log_softmax(student_logits, dtype, "student_logits")  # (..., V)
    log_q = _log_softmax(teacher_logits.detach(), dtype, "teacher_logits")
    V = log_p.shape[-1]
    x = torch.arange(V, device=log_p.device)  # every token, (V,)
    if beta == 1.0:
        s, t = log_p.unsqueeze(-1), log_q.unsqueeze(-1)  # (..., V, 1): S_x = {x}
        valid = torch.ones_like(s, dtype=torch.bool)
    else:
        top1 = log_q.argmax(dim=-1, keepdim=True)  # (..., 1)
        ids = torch.stack([top1.expand(*log_p.shape[:-1], V), x.expand_as(log_p)], dim=-1)
        flat = ids.reshape(*log_p.shape[:-1], 2 * V)  # (..., 2V): [top1, x] for each x
        s = log_p.gather(-1, flat).reshape(ids.shape)  # (..., V, 2)
        t = log_q.gather(-1, flat).reshape(ids.shape)
        valid = torch.stack([torch.ones_like(x, dtype=torch.bool).expand_as(log_p),
                             x != top1], dim=-1)
    losses = _sparse_divergence(s, t, valid, beta, approximation, max_log_mass)  # (..., V)
    weight = log_p.detach().exp()
    # a token the student never samples (weight 0) adds nothing, even an infinite loss
    return torch.where(weight > 0, weight * losses, torch.zeros_like(losses)).sum(dim=-1)


def forward_kl_upper_bound(student_logits, teacher_topk_logp, topk_ids):
    r"""The least upper bound of $\mathrm{KL}(q \,\|\, p)$ over the teachers consistent with a
    top-$k$ report: the worst tail (module docstring, 5.).

    $$
    \overline{\mathrm{KL}} = \sum_{v \in S} q_v \log\frac{q_v}{p_v}
    + \sum_{i \ge 0} w_i \log\frac{w_i}{p_{(i)}}, \qquad
    w_i = \min\bigl(\mu, \max(1 - Q - i\mu, 0)\bigr),
    $$

    with $\mu = \min_{v \in S} q_v$ and $p_{(0)} \le p_{(1)} \le \dots$ the student's
    probabilities off $S$ in increasing order. Equality holds for the teacher with exactly
    that tail.

    **Precision.** $w_i$ is the remainder $1 - Q - i\mu$, computed to the unit roundoff of
    the compute dtype relative to 1. With $\mu$ near $1/V$, float32 (unit roundoff $2^{-24}$)
    cannot resolve it past about $2^{24}$ tokens: at $V = 2^{24} + 2$ the float32 bound fell
    4.6% below the float64 one on the same inputs (a slow test checks more than 1%). Pass
    float64 logits for such vocabularies.

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(..., V)`` floating.
    teacher_topk_logp, topk_ids : torch.Tensor
        ``(..., k)``: the teacher's top-$k$ report, its log-probabilities and distinct ids. It
        must be a top-$k$ report: the unreported mass $1 - Q$ must fit under $\mu$ on the
        $V - k$ other tokens (to the rounding of $Q$), or it is a ``ValueError``.

    Returns
    -------
    torch.Tensor
        ``(...)``, in the compute dtype; $+\infty$ where the worst tail puts mass on a token
        the student cannot emit.

    Examples
    --------
    The teacher reports $q_0 = 0.5$ of $V = 3$; the uniform student. The tail of $0.5$ fits
    under $\mu = 0.5$ on one token: $0.5 \log 1.5 + 0.5 \log 1.5 = \log 1.5$.

    >>> bound = forward_kl_upper_bound(torch.zeros(3), torch.log(torch.tensor([0.5])),
    ...                                torch.tensor([0]))
    >>> round(bound.item(), 4), round(math.log(1.5), 4)
    (0.4055, 0.4055)
    """
    _check_logits("student_logits", student_logits)
    V, lead = student_logits.shape[-1], tuple(student_logits.shape[:-1])
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be an integer torch.Tensor, got {type(topk_ids).__name__}")
    report = Support(topk_ids, torch.ones_like(topk_ids, dtype=torch.bool), teacher_topk_logp)
    ids, _, t = _check_support(student_logits, report, None,
                               ("topk_ids", "valid", "teacher_topk_logp"))
    k = ids.shape[-1]
    dtype = compute_dtype(student_logits, teacher_topk_logp)
    log_p = _log_softmax(student_logits, dtype, "student_logits")  # (..., V)
    t = t.detach().to(dtype)
    # the reported part, sum over S of q_v log(q_v / p_v)
    reported = _masked_kl(t, log_p.gather(-1, ids))
    mu = t.min(dim=-1, keepdim=True).values.exp()  # (..., 1)
    rest = (1.0 - t.exp().sum(dim=-1, keepdim=True)).clamp_min(0.0)  # 1 - Q
    slack = 4 * k * torch.finfo(dtype).eps
    if bool((rest > (V - k) * mu + slack).any()):
        raise ValueError("teacher_topk_logp is not a top-k report: its unreported mass 1 - Q "
                         "exceeds (V - k) times its smallest reported probability")
    # the student's tail probabilities in increasing order (the reported ids sorted last)
    in_S = torch.zeros_like(log_p, dtype=torch.bool).scatter_(-1, ids, True)
    tail = torch.where(in_S, torch.full_like(log_p, math.inf), log_p).sort(dim=-1).values
    i = torch.arange(V, device=log_p.device, dtype=dtype)
    # w_i = min(mu, max(1 - Q - i mu, 0)): mu on the smallest p, the remainder on the next
    w = torch.minimum(mu, (rest - i * mu).clamp_min(0.0))
    w = torch.where(i < V - k, w, torch.zeros_like(w))  # (..., V)
    lw = torch.where(w > 0, w, torch.ones_like(w)).log()
    worst = _masked_kl(torch.where(w > 0, lw, torch.full_like(lw, -math.inf)),
                       torch.where(i < V - k, tail, torch.zeros_like(tail)))
    return (reported + worst).reshape(lead)


# ---------------------------------------------------------------------------------------------
# Exact bias of each rule, and the study
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """One framework's top-k loss: a support rule and the loss computed on it."""

    label: str
    """The legend's and the table's name."""
    framework: str
    """Who computes it, with the options that select it."""
    rule: str
    """One of ``SUPPORTS``."""
    beta: float
    """The divergence $D_\\beta$ it approximates (0 forward, 1 reverse)."""
    loss: str
    """``"tail"``, ``"renormalize"`` (:func:`support_divergence`), ``"reinforce"``
    (:func:`reinforce_reverse_kl`), ``"verl"`` (``clamps.verl_forward_kl_topk``) or
    ``"upper_bound"`` (:func:`forward_kl_upper_bound`, a bound, not a loss)."""


CHOICES = (
    Choice("teacher top-k, forward, tail (b)",
           "TRL beta=0 (IWOPDTrainer jsd, ServerDistillationTrainer, AsyncDistillationTrainer)",
           "teacher_topk", 0.0, "tail"),
    Choice("teacher top-k, forward, verl's clamped (c)", "verl forward_kl_topk",
           "teacher_topk", 0.0, "verl"),
    Choice("teacher top-k, forward, worst tail (bound)", "an upper bound, no framework",
           "teacher_topk", 0.0, "upper_bound"),
    Choice("teacher top-k, reverse, renormalised (a)", "Tinker cookbook SDFT, reverse=True",
           "teacher_topk", 1.0, "reinforce"),
    Choice("teacher top-k, reverse, tail (b)", "none (the other support, for comparison)",
           "teacher_topk", 1.0, "tail"),
    Choice("student top-k, reverse, tail (b)", "TRL beta=1, loss_top_k >= 2 (IWOPDTrainer jsd)",
           "student_topk", 1.0, "tail"),
    Choice("union, JSD 0.5, tail (b)", "TRL 0 < beta < 1, loss_top_k >= 2 (IWOPDTrainer jsd)",
           "union", 0.5, "tail"),
    Choice("student top-k, JSD 0.5, renormalised (a)",
           "TRL SDFT (distillation_topk=100, distillation_alpha=0.5)", "student_topk", 0.5,
           "renormalize"),
    Choice("sampled token, reverse, tail (b)",
           "TRL beta=1, loss_top_k=1 (IWOPDTrainer jsd defaults; ServerDistillationTrainer)",
           "sampled", 1.0, "tail"),
    Choice("student argmax, reverse, tail (b)",
           "TRL beta=1, loss_top_k=1, reverse_kl_top_1_mode='argmax' (local teacher)",
           "argmax", 1.0, "tail"),
    Choice("teacher top-1 + sampled, JSD 0.5, tail (b)",
           "TRL 0 < beta < 1, loss_top_k=1 (IWOPDTrainer jsd; ServerDistillationTrainer)",
           "teacher_top1_sampled", 0.5, "tail"),
)
"""The choices the study compares, each a framework's (or, for the bound, none)."""



@dataclass(frozen=True)
class NemoChoice:
    r"""NeMo-RL's loss on the teacher's top-$k$ with its options (:func:`nemo_rl_topk_kl`), a
    row of :func:`support_study` beside the ``Choice`` rows.

    Its reference is the full-vocabulary form of the same loss: $\mathrm{KL}(q \,\|\, p)$,
    $\mathrm{KL}(p \,\|\, q)$, or for ``"mixed"`` $w\, \mathrm{KL}(q \,\|\, p) + (1 - w)\,
    \mathrm{KL}(p \,\|\, q)$ (not the JSD)."""

    label: str
    """The table's name."""
    framework: str
    """The options that select it."""
    kl_type: str
    """One of ``NEMO_RL_KL_TYPES``."""
    mixed_kl_weight: float = NEMO_RL_MIXED_KL_WEIGHT
    """$w$, the forward KL's weight (read by ``"mixed"`` only)."""
    zero_outside_topk: bool = False
    """NeMo-RL's ``zero_outside_topk``."""

    rule = "teacher_topk"  # the support NeMo-RL's teacher reports (not a field)
    loss = "nemo_rl"  # no clamp, no bound: the study's other columns stay empty (not a field)


NEMO_CHOICES = (
    NemoChoice("NeMo-RL top-k, forward, renormalised (a)", "NeMo-RL kl_type=forward", "forward"),
    NemoChoice("NeMo-RL top-k, reverse, renormalised (a)",
               "NeMo-RL kl_type=reverse (its recipes)", "reverse"),
    NemoChoice("NeMo-RL top-k, mixed 0.5, renormalised (a)",
               "NeMo-RL defaults (kl_type=mixed, mixed_kl_weight=0.5)", "mixed"),
    NemoChoice("NeMo-RL top-k, forward, zero outside",
               "NeMo-RL kl_type=forward, zero_outside_topk", "forward", zero_outside_topk=True),
    NemoChoice("NeMo-RL top-k, reverse, zero outside",
               "NeMo-RL kl_type=reverse, zero_outside_topk", "reverse", zero_outside_topk=True),
    NemoChoice("NeMo-RL top-k, mixed 0.5, zero outside",
               "NeMo-RL kl_type=mixed, mixed_kl_weight=0.5, zero_outside_topk", "mixed",
               zero_outside_topk=True),
)
"""NeMo-RL's options on the teacher's top-$k$; ``support_study(choices=NEMO_CHOICES)`` computes
their rows."""


def _rows_value_and_grad(fn, logits):
    """Per-row values of ``fn`` and their gradients w.r.t. ``logits`` (rows are independent:
    one backward pass of the sum)."""
    z = logits.detach().clone().requires_grad_(True)
    value = fn(z)
    (grad,) = torch.autograd.grad(value.sum(), z)
    return value.detach(), grad


def _choice_loss(choice, k, student_logits, teacher_logits):
    """The per-position function of the student's logits that ``choice`` computes at ``k``."""
    if choice.loss == "verl":
        report, ids = F.log_softmax(teacher_logits, -1).topk(k, dim=-1)
        return lambda z: verl_forward_kl_topk(z, report, ids)
    if choice.rule in _NEEDS_TOKENS:
        return lambda z: expected_sampled_divergence(z, teacher_logits, beta=choice.beta,
                                                     approximation=choice.loss)
    support = build_support(choice.rule, k, student_logits, teacher_logits)
    if choice.loss == "upper_bound":
        return lambda z: forward_kl_upper_bound(z, support.teacher_logp, support.ids)
    if choice.loss == "reinforce":
        return lambda z: reinforce_reverse_kl(z, support)
    if isinstance(choice, NemoChoice):
        return lambda z: nemo_rl_topk_kl(z, support, kl_type=choice.kl_type,
                                         mixed_kl_weight=choice.mixed_kl_weight,
                                         zero_outside_topk=choice.zero_outside_topk)
    return lambda z: support_divergence(z, support, beta=choice.beta, approximation=choice.loss)


def support_bias(choice, k, student_logits, teacher_logits):
    r"""Exact value and gradient bias of ``choice`` at $k$, at every position, in float64.

    Against the full-vocabulary $D_\beta$ of the same $\beta$ and its gradient $g$ with respect
    to all $V$ student logits (autograd):

    $$
    \text{rel. bias} = \frac{\hat D - D}{D}, \qquad
    \text{rel. gradient error} = \frac{\lVert \hat g - g \rVert}{\lVert g \rVert}.
    $$

    The sampled rules are averaged exactly over $x \sim p$ (:func:`expected_sampled_divergence`).
    NeMo-RL's ``"mixed"`` (a ``NemoChoice``) is measured against the same weighted sum of the
    full KLs, $w\, \mathrm{KL}(q \,\|\, p) + (1 - w)\, \mathrm{KL}(p \,\|\, q)$, not against
    the JSD.

    Parameters
    ----------
    choice : Choice
        One of ``CHOICES``, or another; or a ``NemoChoice`` (``NEMO_CHOICES``).
    k : int
        The support's $k$ ($1 \le k \le V$).
    student_logits, teacher_logits : torch.Tensor
        ``(P, V)`` floating: $P$ positions; the teacher's divergence and gradient must be
        nonzero and finite at each.

    Returns
    -------
    dict
        ``value``, ``true``, ``rel_bias``, ``rel_grad_error`` (``None`` for a bound): ``(P,)``
        float64 tensors.

    Examples
    --------
    At $k = V$ the tail bucket is empty and the loss is the divergence itself:

    >>> student, teacher = zipf_pair(V=6, noise=1.0)
    >>> bias = support_bias(CHOICES[0], 6, student[None], teacher[None])
    >>> abs(bias["rel_bias"].item()) < 1e-6, bias["rel_grad_error"].item() < 1e-5
    (True, True)
    """
    _check_any_choice(choice)
    check_float_tensor("student_logits", student_logits, 2)
    check_float_tensor("teacher_logits", teacher_logits, 2)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits must have the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    _check_rule(choice.rule, k, student_logits.shape[-1])
    student = student_logits.detach().to(torch.float64)
    teacher = teacher_logits.detach().to(torch.float64)
    return _bias(choice, k, student, teacher, _truth(student, teacher, *_reference(choice)))


_CHOICE_LOSSES = ("tail", "renormalize", "reinforce", "verl", "upper_bound")


def _check_any_choice(choice):
    """:func:`_check_choice`, or for a ``NemoChoice`` the checks of :func:`nemo_rl_topk_kl`."""
    if not isinstance(choice, NemoChoice):
        _check_choice(choice)
        return
    if choice.kl_type not in NEMO_RL_KL_TYPES:
        raise ValueError(f"choice.kl_type must be one of {NEMO_RL_KL_TYPES}, got "
                         f"{choice.kl_type!r}")
    check_finite_number("choice.mixed_kl_weight", choice.mixed_kl_weight, low=0.0, high=1.0)
    if not isinstance(choice.zero_outside_topk, bool):
        raise TypeError(f"choice.zero_outside_topk must be a bool, got "
                        f"{type(choice.zero_outside_topk).__name__} {choice.zero_outside_topk!r}")


def _check_choice(choice):
    r"""Raise unless ``choice`` is a ``Choice`` whose loss is computed on its rule and
    approximates its $D_\beta$ (a mismatch would give the bias against another divergence)."""
    if not isinstance(choice, Choice):
        raise TypeError(f"choice must be a Choice, got {type(choice).__name__}")
    if choice.rule not in SUPPORTS:
        raise ValueError(f"choice.rule must be one of {SUPPORTS}, got {choice.rule!r}")
    beta = check_finite_number("choice.beta", choice.beta, low=0.0, high=1.0)
    if choice.loss not in _CHOICE_LOSSES:
        raise ValueError(f"choice.loss must be one of {_CHOICE_LOSSES}, got {choice.loss!r}")
    if choice.loss in ("verl", "upper_bound") and (choice.rule != "teacher_topk" or beta != 0):
        raise ValueError(f"choice.loss {choice.loss!r} takes the teacher's top-k report and "
                         "approximates the forward KL: it needs rule 'teacher_topk' and beta 0, "
                         f"got rule {choice.rule!r} and beta {choice.beta!r}")
    if choice.loss == "reinforce" and beta != 1:
        raise ValueError("choice.loss 'reinforce' is Tinker's reverse KL: it needs beta 1, got "
                         f"beta {choice.beta!r}")
    if choice.rule in _NEEDS_TOKENS and (choice.loss not in LOSSES_ON_SUPPORT or beta == 0):
        raise ValueError(f"choice.rule {choice.rule!r} is TRL's sampled top-1 path: it needs a "
                         f"loss in {LOSSES_ON_SUPPORT} and beta > 0, got loss {choice.loss!r} "
                         f"and beta {choice.beta!r}")


def _reference(choice):
    r"""``(beta, mixture)``: the full divergence ``choice`` is measured against, $D_\beta$, or
    for NeMo-RL's ``"mixed"`` (``mixture`` True) the weighted sum of the two KLs, $\beta$ the
    reverse KL's weight $1 - w$."""
    if not isinstance(choice, NemoChoice):
        return choice.beta, False
    if choice.kl_type != "mixed":
        return (0.0 if choice.kl_type == "forward" else 1.0), False
    return 1.0 - float(choice.mixed_kl_weight), True


def _truth(student, teacher, beta, mixture=False):
    r"""The full divergence at each position and its gradient, checked nonzero and finite:
    $D_\beta$, or with ``mixture`` $(1 - \beta)\, \mathrm{KL}(q \| p) + \beta\,
    \mathrm{KL}(p \| q)$."""
    def full(z, b):
        return generalized_jsd_per_position(z[None], teacher[None], beta=b)[0]

    if mixture:
        true, true_grad = _rows_value_and_grad(
            lambda z: (1.0 - beta) * full(z, 0.0) + beta * full(z, 1.0), student)
    else:
        true, true_grad = _rows_value_and_grad(lambda z: full(z, beta), student)
    norm = true_grad.norm(dim=-1)
    if not bool(((true > 0) & (true < math.inf) & (norm > 0)).all()):
        raise ValueError("the full divergence and its gradient must be nonzero and finite at "
                         "every position for a relative bias (the student equals the teacher, "
                         "or one side puts mass where the other has none)")
    return true, true_grad, norm


def _bias(choice, k, student, teacher, truth):
    """:func:`support_bias` on float64 inputs, given the ``_truth`` of ``choice.beta``."""
    true, true_grad, norm = truth
    loss = _choice_loss(choice, k, student, teacher)
    if choice.loss == "upper_bound":
        with torch.no_grad():
            value = loss(student)
        return {"value": value, "true": true, "rel_bias": (value - true) / true,
                "rel_grad_error": None}
    value, grad = _rows_value_and_grad(loss, student)
    return {"value": value, "true": true, "rel_bias": (value - true) / true,
            "rel_grad_error": (grad - true_grad).norm(dim=-1) / norm}


def support_study(V=4096, exponent=1.1, temperature=1.0, noise=1.0, positions=16, seed=0,
                  ks=None, choices=CHOICES):
    r"""Bias and gradient error of each choice against $k$, on the ``topk`` module's Zipf pairs.

    Position $i$ is ``topk.zipf_pair(V, exponent, temperature, noise, seed + i)``: a Zipf
    teacher over $V$ ranks and a student that adds Gaussian noise to its logits (the pairs of
    ``clamps.clamp_study``). For each choice and $k$ the row holds the means over the positions
    of the relative value bias and gradient error (:func:`support_bias`), and for verl's loss
    the fraction of positions whose value is clamped to 0 (``clamps.clamp_study``'s
    ``clamped``). The top-1 rules are computed at $k = 1$ only.

    Returns
    -------
    dict
        ``{"V", "exponent", "temperature", "noise", "positions", "ks", "rows"}``; each row has
        ``label``, ``framework``, ``k``, ``rel_bias``, ``rel_grad_error`` (None for the bound),
        ``clamped`` and ``p_above_q`` (verl's row only, else None: the fractions of positions
        clamped to 0 and with $P > Q$) and ``lower_bound`` (whether the value was at most the
        divergence at every position).

    Examples
    --------
    >>> data = support_study(V=64, positions=2, ks=[1, 8])
    >>> [r["k"] for r in data["rows"] if r["label"].startswith("sampled")]
    [1]
    """
    if isinstance(V, bool) or not isinstance(V, int) or V < 2:
        raise ValueError(f"V must be an int >= 2, got {V!r}")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be a positive int, got {positions!r}")
    if ks is None:
        ks = [2 ** i for i in range(int(math.log2(V)))]  # 1, 2, 4, ..., V / 2
    ks = list(ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
            raise ValueError(f"ks must hold ints in [1, V] = [1, {V}], got {k!r}")
    if len(set(ks)) != len(ks):
        raise ValueError(f"ks must not repeat a value (one row per choice and k), got {ks!r}")
    choices = tuple(choices)
    for choice in choices:
        _check_any_choice(choice)
    labels = [choice.label for choice in choices]
    if len(set(labels)) != len(labels):
        raise ValueError(f"choices must have distinct labels (the table's rows), got {labels!r}")
    pairs = [zipf_pair(V, exponent, temperature, noise, seed + i) for i in range(positions)]
    student = torch.stack([pair[0] for pair in pairs])  # (positions, V), float64
    teacher = torch.stack([pair[1] for pair in pairs])
    clamped = {r["k"]: r for r in clamp_study(
        V, exponent, temperatures=(temperature,), noises=(noise,), ks=tuple(ks),
        positions=positions, seed=seed)}
    truths = {ref: _truth(student, teacher, *ref) for ref in {_reference(c) for c in choices}}
    rows = []
    for choice in choices:
        top1 = choice.rule not in ("teacher_topk", "student_topk", "union")
        for k in ([1] if top1 else ks):
            bias = _bias(choice, k, student, teacher, truths[_reference(choice)])
            grad = bias["rel_grad_error"]
            rows.append({
                "label": choice.label, "framework": choice.framework, "k": k,
                "rel_bias": float(bias["rel_bias"].mean()),
                "rel_grad_error": None if grad is None else float(grad.mean()),
                "clamped": clamped[k]["clamped"] if choice.loss == "verl" else None,
                "p_above_q": clamped[k]["p_above_q"] if choice.loss == "verl" else None,
                "lower_bound": bool((bias["value"] <= bias["true"]).all()),
            })
    return {"V": V, "exponent": exponent, "temperature": temperature, "noise": noise,
            "positions": positions, "ks": ks, "rows": rows}


def _check_study_data(data, keys):
    """Raise unless ``data`` is a dict of :func:`support_study` with ``keys`` and a list of rows."""
    if not isinstance(data, dict) or not set(keys) <= set(data) \
            or not isinstance(data["rows"], list):
        raise TypeError(f"data must be the dict of support_study, with keys {keys} and a list "
                        f"of rows, got {type(data).__name__}"
                        + (f" with keys {sorted(data)}" if isinstance(data, dict) else ""))


def format_support_table(data, ks=(1, 8, 64, 512)):
    r"""A Markdown table of ``data`` (from :func:`support_study`) at a few values of $k$.

    One row per choice; each cell "relative value bias / relative gradient error" (the bound:
    its relative excess over the forward KL), and verl's row adds the clamped fraction.

    Examples
    --------
    >>> data = support_study(V=64, positions=2, ks=[1, 8])
    >>> table = format_support_table(data, ks=[1, 8]).splitlines()
    >>> table[0]
    '| choice | used by | k = 1 | k = 8 |'
    >>> next(row for row in table if row.startswith("| sampled")).endswith(" |  |")  # k = 1 only
    True
    """
    _check_study_data(data, ("ks", "rows"))
    lines = ["| choice | used by | " + " | ".join(f"k = {k}" for k in ks) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in ks) + " |"]
    labels = list(dict.fromkeys(r["label"] for r in data["rows"]))
    for label in labels:
        cells = {r["k"]: r for r in data["rows"] if r["label"] == label}
        framework = next(iter(cells.values()))["framework"]
        out = []
        for k in ks:
            if k not in cells:
                if len(cells) > 1 or k not in data["ks"]:
                    raise ValueError(f"k = {k} is not in the data (ks = {data['ks']})")
                out.append("")  # a top-1 rule: k = 1 only
                continue
            r = cells[k]
            cell = f"{r['rel_bias'] + 0.0:+.3f}"
            if r["rel_grad_error"] is not None:
                cell += f" / {r['rel_grad_error']:.3f}"
            if r["clamped"] is not None:
                cell += f"; clamped {r['clamped']:.2f}"
            out.append(cell)
        lines.append(f"| {label} | {framework} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot_support_bias(path, data=None):
    r"""Draw the study into ``path`` (an SVG): value bias, gradient error and verl's clamped
    fraction against $k$.

    Three panels sharing the $k$ axis (log scale). The colour is the divergence (blue the
    forward KL, orange the reverse KL, green the JSD with $\beta = 0.5$), the line style the
    loss (dashed the tail bucket (b), solid renormalised (a), dotted verl's clamped (c),
    dash-dotted the worst-tail upper bound) and the marker the support (circles the teacher's
    top-$k$, squares the student's, diamonds the union). The top-1 rules, at $k = 1$ only, are
    large single markers (a star the sampled token, a cross the student's argmax). The last
    panel has verl's clamped fraction and the fraction of positions with $P > Q$ (grey), which
    a clamp needs. ``data`` defaults to :func:`support_study` ``()``.

    Returns
    -------
    pathlib.Path
        The written file.
    """
    import pathlib

    data = support_study() if data is None else data
    _check_study_data(data, ("V", "positions", "rows"))
    unknown = sorted({r["label"] for r in data["rows"]} - {c.label for c in CHOICES})
    if unknown:
        raise ValueError(f"data's rows must be those of CHOICES, whose styles the figure draws, "
                         f"got the labels {unknown}")
    fig, axes = new_figure(3, 1, height=9.0, sharex=True)
    colours = {0.0: "C0", 1.0: "C1"}  # any other beta: the JSD, C2
    styles = {"tail": "--", "renormalize": "-", "reinforce": "-", "verl": ":",
              "upper_bound": "-."}
    markers = {"teacher_topk": "o", "student_topk": "s", "union": "D"}
    top1 = {"sampled": "*", "argmax": "X", "teacher_top1_sampled": "*", "teacher_top1_argmax": "X"}
    choices = {c.label: c for c in CHOICES}
    for label in dict.fromkeys(r["label"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["label"] == label]
        choice = choices[label]
        ks = [r["k"] for r in rows]
        colour = colours.get(choice.beta, "C2")
        if choice.rule in top1:
            kw = dict(color=colour, marker=top1[choice.rule], linestyle="none", markersize=11,
                      markeredgecolor="black", markeredgewidth=0.6, label=label)
        else:
            kw = dict(color=colour, linestyle=styles[choice.loss], marker=markers[choice.rule],
                      markersize=3.5, label=label)
        axes[0].plot(ks, [r["rel_bias"] for r in rows], **kw)
        if rows[0]["rel_grad_error"] is not None:
            axes[1].plot(ks, [r["rel_grad_error"] for r in rows], **kw)
        if rows[0]["clamped"] is not None:
            axes[2].plot(ks, [r["clamped"] for r in rows], **kw)
            axes[2].plot(ks, [r["p_above_q"] for r in rows], color="0.55", marker="o",
                         markersize=3.5, label="fraction with P > Q (a clamp needs it)")
    axes[0].axhline(0.0, color="black", lw=0.6)
    # symlog: linear in [-1, 1], where every loss's bias lies; logarithmic above (the bound)
    axes[0].set_yscale("symlog", linthresh=1.0, linscale=2.0)
    axes[0].set(xscale="log", ylabel="relative value bias\n(D̂ − D) / D")
    axes[1].set(xscale="log", yscale="log", ylabel="relative gradient error\n‖ĝ − g‖ / ‖g‖")
    axes[2].set(xscale="log", ylim=(-0.02, 1.02), ylabel="verl: fraction of\npositions")
    axes[2].set_xlabel(f"k (support size; V = {data['V']:,}, {data['positions']} positions)")
    axes[2].legend(loc="upper right")
    for ax in axes:
        ax.grid(True, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, bbox_to_anchor=(0.5, 0.0),
               columnspacing=1.0, handlelength=2.6)
    fig.tight_layout(rect=(0, 0.165, 1, 1))
    path = pathlib.Path(path)
    path.write_bytes(svg_bytes(fig))
    return path
