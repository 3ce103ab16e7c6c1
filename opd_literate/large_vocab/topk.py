r"""Top-k teachers: the KL when the teacher returns only its k most likely tokens, with exact bias.

A served teacher (vLLM's ``logprobs=k``, Tinker's ``topk_prompt_logprobs``) returns, at every
position, a set $S$ of $k$ token ids and their log-probabilities $\log q_v$, $v \in S$, under
the full softmax. The student's full distribution $p$ is known. Write the captured masses

$$
Q = \sum_{v \in S} q_v, \qquad P = \sum_{v \in S} p_v ,
$$

the renormalised top-k distributions $\tilde q_v = q_v / Q$, $\tilde p_v = p_v / P$ on $S$, and
the tail conditionals $\hat q_v = q_v / (1 - Q)$, $\hat p_v = p_v / (1 - P)$ off $S$ (the part
the teacher does not report). Three approximations of a KL are in use:

* ``"renormalize"`` (a): the KL between $\tilde p$ and $\tilde q$ on $S$;
* ``"tail"`` (b): the KL over $k + 1$ outcomes, $S$ and one bucket holding the rest of the
  mass ($1 - P$ for the student, $1 - Q$ for the teacher);
* ``"ignore"`` (c): the full-vocabulary sum restricted to $S$, unnormalised:
  $\sum_{v \in S} p_v \log(p_v / q_v)$ (reverse) or $\sum_{v \in S} q_v \log(q_v / p_v)$
  (forward).

Each is defined for both directions: ``"reverse"`` approximates
$\mathrm{KL}(p \,\|\, q)$, OPD's objective (see [opd_literate.opd.full_vocab_reverse_kl][]),
and ``"forward"`` approximates $\mathrm{KL}(q \,\|\, p)$, the objective of ordinary
distillation and of most top-k distillation code.

**Exact bias (the chain rule of KL).** Grouping the vocabulary into $S$ and its complement,
for any two distributions $a$, $b$ with masses $A$, $B$ on $S$,

$$
\mathrm{KL}(a \,\|\, b) = \underbrace{A \log\frac{A}{B} + (1 - A)\log\frac{1 - A}{1 - B}}_{
\mathrm{kl}_2(A, B)} + A\, \mathrm{KL}(\tilde a \,\|\, \tilde b)
+ (1 - A)\, \mathrm{KL}(\hat a \,\|\, \hat b).
$$

(Expand $\log(a_v / b_v) = \log(A/B) + \log(\tilde a_v / \tilde b_v)$ on $S$ and likewise off
it.) With $(a, b, A) = (p, q, P)$ for the reverse KL and $(q, p, Q)$ for the forward KL:

* (b) is exactly the first two terms, $\mathrm{kl}_2(A, B) + A \cdot (a)$, so its bias is
  $-(1 - A)\,\mathrm{KL}(\hat a \,\|\, \hat b) \le 0$: **the tail bucket is a lower bound of
  the true KL, in both directions**, with equality iff the tails agree up to scale. (This is
  the data-processing inequality: merging outcomes never increases a KL.)
* (a) satisfies $A \cdot (a) \le (b) \le \mathrm{KL}$, so $(a) \le \mathrm{KL} / A$; but (a)
  itself is **not a bound**: it is 0 whenever $\tilde p = \tilde q$ however different the
  masses, and it can exceed the true KL, by at most the factor $1 / A$ (so only where
  $A < 1$): when the two spread their mass on $S$ very differently while the masses
  themselves and the tails nearly agree, the KL is close to $A \cdot (a)$ (both cases are
  in the tests).
* (c) equals $\mathrm{KL} - \sum_{v \notin S} a_v \log(a_v / b_v)$. By the log-sum inequality
  the omitted tail sum is at least $(1 - A)\log\frac{1 - A}{1 - B}$, so (c) $\le \mathrm{KL}$
  whenever $1 - A \ge 1 - B$: **a lower bound of the reverse KL when the student's tail mass is
  at least the teacher's, and of the forward KL when the teacher's tail mass is at least the
  student's.** There it can be negative. Without that condition it is no lower bound: the
  log-sum inequality applied on $S$ gives (c) $\ge A \log(A / B) > 0$, so it is positive, and
  it can exceed the true KL (the tests enumerate a negative lower bound and a value above the
  KL).

At $k = V$ all three are the true KL, and at $k = V - 1$ so is (b) (a single unreported
token: the tails agree). Otherwise none is an upper bound in general: each is below the true
KL for some reports (the tests give one for each). Not for every report, though: the
teacher's tail is unknown, but when its mass is small, a report can leave every consistent
tail below what (a) says (a forward case is in the tests).

**Gradients.** With respect to the student's logits $z$ (all $V$ of them), the true gradients
are $p \odot (\log p - \log q - \mathrm{KL})$ (reverse) and $p - q$ (forward);
[opd_literate.large_vocab.topk.topk_bias_table][] reports how far each approximation's
gradient is from them, $\lVert \hat g - g \rVert / \lVert g \rVert$, at one position. For
example the forward (c) has gradient $Q\,p - q\,\mathbb{1}_S$, which pushes every tail logit
down in proportion to $p_v$ only.

**What the frameworks do** (source read at the commits given; see the chapter for details):
TRL's ``IWOPDTrainer`` (``trl/experimental/iw_opd/iw_opd_trainer.py``) offers (b) (its
default) or (a), and the SDFT/SDPO trainers (``trl/experimental/sdft/loss_utils.py``) (a) (their
default) or (b); Tinker
cookbook's SDFT (``tinker_cookbook/distillation/sdft.py``) uses the cross-entropy of the
student against the renormalised teacher $\tilde q$, that is $\mathrm{KL}(\tilde q \,\|\, p)
= (c)/Q - \log Q$ in the forward direction; verl's core computes the forward (c) on the
teacher's top-k (``loss_mode="forward_kl_topk"``, since PR #5041; top-32 and no
log-probability clamp in the config its trainer composes, top-128 and a clamp at $-10$ in the
``DistillationLossConfig`` dataclass), and so does its GKD recipe (``gkd/megatron/
megatron_kl_loss.py`` in ``verl-project/verl-recipe``).

**Conventions.** NaN or $+\infty$ in ``student_logits``, a position whose logits are all
$-\infty$, and logits whose spread overflows the compute dtype are a ``ValueError``; so is a
NaN or positive ``teacher_topk_logp``. $-\infty$ is an impossible token: a term $a_v > 0 = b_v$
makes the value $+\infty$ with a zero gradient, and (a) is 0 where $A = 0$ (no mass of the
first argument on $S$: nothing to renormalise). A position whose reported log-probabilities are
all $-\infty$ (a set the teacher gives no mass, possible for ids that are not its top-k)
follows the same rules, value and gradient: the reverse KLs are $+\infty$ where the student has
mass on $S$ (else 0); forward, (a) and (c) are 0 and (b) is $-\log(1 - P)$, the teacher's whole
mass in the bucket. The reported probabilities sum to at most 1, and to 1 at $k = V$ (to
$\sqrt{\varepsilon}$ of their dtype, float32's at least, far above their rounding): a report
that does not is a ``ValueError``. Rounding: at $k = V$ the student's mass $P$ is taken as
exactly 1 and the teacher's tail as exactly 0; in the reverse direction a teacher tail $1 - Q$
below $k \varepsilon$ (the rounding of the sum $Q$ in the compute dtype) is taken as
$k \varepsilon$, an upper bound of the true one, which keeps (b) a lower bound and finite.

Computed in torch (autograd for the gradients), in float64 for the studies; half precision is
computed in float32. Imports: torch (and matplotlib inside
[opd_literate.large_vocab.topk.plot_topk_bias][] only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._figures import new_figure, svg_bytes
from .._numerics import (
    check_finite_number,
    check_float_tensor,
    check_reported_mass,
    compute_dtype,
)

__all__ = [
    "APPROXIMATIONS",
    "DIRECTIONS",
    "topk_kl",
    "zipf_pair",
    "topk_bias_table",
    "topk_bias_figure_data",
    "format_topk_bias_table",
    "plot_topk_bias",
]

APPROXIMATIONS = ("renormalize", "tail", "ignore")
"""The top-k approximations (a), (b), (c) of [opd_literate.large_vocab.topk.topk_kl][]."""

DIRECTIONS = ("reverse", "forward")
r"""``"reverse"``: $\mathrm{KL}(p \,\|\, q)$ (student first, OPD's objective);
``"forward"``: $\mathrm{KL}(q \,\|\, p)$ (ordinary distillation's)."""


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    r"""$\log(1 - e^x)$ for $x \le 0$, accurately (Maechler's two branches); $-\infty$ at 0.

    Values at or above 0 (a captured mass of 1, or rounding just above it) give $-\infty$ with
    a zero gradient: the argument is replaced before the logarithm (the double ``where``).
    """
    empty = x >= 0
    safe = torch.where(empty, torch.full_like(x, -1.0), x)
    value = torch.where(safe > -math.log(2.0), torch.log(-torch.expm1(safe)),
                        torch.log1p(-torch.exp(safe)))
    return torch.where(empty, torch.full_like(x, -math.inf), value)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    r"""``logsumexp`` over the last axis (kept), $-\infty$ with a zero gradient for a row of
    $-\infty$ only (torch's has a NaN gradient there: the double ``where``)."""
    empty = (x == -math.inf).all(dim=-1, keepdim=True)
    value = torch.logsumexp(torch.where(empty, torch.zeros_like(x), x), dim=-1, keepdim=True)
    return torch.where(empty, torch.full_like(value, -math.inf), value)


def _kl_terms(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    r"""$\sum a (\log a - \log b)$ over the last axis: $0 \log 0 = 0$; $+\infty$ if $a > 0 = b$.

    Not clamped at 0: approximation (c) is a partial sum that can be negative (where it is a
    lower bound, see the module docstring).
    """
    support = log_a > -math.inf
    both = support & (log_b > -math.inf)
    log_a_safe = torch.where(both, log_a, torch.zeros_like(log_a))
    log_b_safe = torch.where(both, log_b, torch.zeros_like(log_b))
    terms = torch.where(both, log_a_safe.exp() * (log_a_safe - log_b_safe),
                        torch.zeros_like(log_a))
    total = terms.sum(dim=-1)
    infinite = (support & ~both).any(dim=-1)
    return torch.where(infinite, torch.full_like(total, math.inf), total)


def topk_kl(student_logits, teacher_topk_logp, topk_ids, approximation="tail",
            direction="reverse"):
    r"""The top-k approximation of a KL at every position (no reduction).

    The formulas, their exact bias and which is a bound are in the module docstring. With
    $s_v = \log p_v$ gathered at the reported ids and $t_v = \log q_v$ as reported:

    * ``"renormalize"``: $\sum_{v \in S} \tilde a_v (\log \tilde a_v - \log \tilde b_v)$;
    * ``"tail"``: the same sum over $S$ of $a_v \log(a_v / b_v)$ plus
      $(1 - A) \log\frac{1 - A}{1 - B}$;
    * ``"ignore"``: $\sum_{v \in S} a_v \log(a_v / b_v)$;

    with $(a, b) = (p, q)$ for ``direction="reverse"`` and $(q, p)$ for ``"forward"``.

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(..., V)`` floating, the student's full logits (carrying the gradient).
    teacher_topk_logp : torch.Tensor
        ``(..., k)`` floating, the teacher's log-probabilities of the reported tokens, under its
        full softmax (what a server returns): $\le 0$, summing to at most 1 (to 1 at
        $k = V$) in probability; treated as a constant.
    topk_ids : torch.Tensor
        ``(..., k)`` integer token ids in ``[0, V)``, distinct within a position. Any set works
        (the teacher's top-k, the student's, a union); the bounds hold for every set.
    approximation : str
        One of ``APPROXIMATIONS``.
    direction : str
        One of ``DIRECTIONS``.

    Returns
    -------
    torch.Tensor
        ``(...)``, in the compute dtype (float32 for half precision).

    Examples
    --------
    Four tokens; the teacher reports its top 2, $q = (0.5, 0.25)$, so $Q = 0.75$. The student
    is uniform, $P = 0.5$. Renormalised, $\tilde q = (2/3, 1/3)$ and $\tilde p = (1/2, 1/2)$:

    >>> student = torch.zeros(4)
    >>> teacher = torch.log(torch.tensor([0.5, 0.25]))
    >>> ids = torch.tensor([0, 1])
    >>> # (a) forward: 2/3 log(4/3) + 1/3 log(2/3) = 0.0566
    >>> round(topk_kl(student, teacher, ids, "renormalize", "forward").item(), 4)
    0.0566
    >>> # (c) forward: 0.5 log 2 + 0.25 log 1 = 0.3466
    >>> round(topk_kl(student, teacher, ids, "ignore", "forward").item(), 4)
    0.3466
    >>> # (b) forward: (c) + 0.25 log(0.25 / 0.5) = 0.1733
    >>> round(topk_kl(student, teacher, ids, "tail", "forward").item(), 4)
    0.1733
    """
    check_float_tensor("student_logits", student_logits, None)
    check_float_tensor("teacher_topk_logp", teacher_topk_logp, None)
    if student_logits.ndim < 1 or student_logits.shape[-1] < 1:
        raise ValueError(f"student_logits must have a last (vocabulary) dimension of size >= 1, "
                         f"got shape {tuple(student_logits.shape)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.is_floating_point() \
            or topk_ids.dtype == torch.bool or topk_ids.is_complex():
        raise TypeError(f"topk_ids must be an integer torch.Tensor, got "
                        f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
    if topk_ids.shape != teacher_topk_logp.shape:
        raise ValueError(f"topk_ids must have the shape of teacher_topk_logp "
                         f"{tuple(teacher_topk_logp.shape)}, got {tuple(topk_ids.shape)}")
    if topk_ids.shape[:-1] != student_logits.shape[:-1] or topk_ids.ndim != student_logits.ndim:
        raise ValueError(f"teacher_topk_logp must have shape (..., k) with the leading shape of "
                         f"student_logits {tuple(student_logits.shape[:-1])}, got "
                         f"{tuple(teacher_topk_logp.shape)}")
    V, k = student_logits.shape[-1], topk_ids.shape[-1]
    if k < 1 or k > V:
        raise ValueError(f"teacher_topk_logp must report 1 <= k <= V = {V} tokens, got k = {k}")
    if bool(torch.isnan(student_logits).any()):
        index = torch.isnan(student_logits).nonzero()[0].tolist()
        raise ValueError(f"student_logits holds NaN (first at index {tuple(index)})")
    if bool((student_logits == math.inf).any()):
        raise ValueError("student_logits holds +inf: a logit must be finite, or -inf for a "
                         "token the student cannot emit")
    if bool((student_logits == -math.inf).all(dim=-1).any()):
        raise ValueError("student_logits has a position whose logits are all -inf: the "
                         "student must be able to emit at least one token")
    if bool(((topk_ids < 0) | (topk_ids >= V)).any()):
        raise ValueError(f"topk_ids must lie in [0, V) = [0, {V}), got values from "
                         f"{topk_ids.min().item()} to {topk_ids.max().item()}")
    if bool((topk_ids.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("topk_ids must be distinct within each position (a repeated id would "
                         "count its probability twice)")
    if bool((teacher_topk_logp > 0).any()) or bool(teacher_topk_logp.isnan().any()):
        raise ValueError("teacher_topk_logp must hold log-probabilities (<= 0, not NaN)")
    if approximation not in APPROXIMATIONS:
        raise ValueError(f"approximation must be one of {APPROXIMATIONS}, got {approximation!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    topk_ids = topk_ids.long()  # gather takes int32 or int64 ids only: a uint8 one was an error

    dtype = compute_dtype(student_logits, teacher_topk_logp)
    check_reported_mass(teacher_topk_logp, dtype, k == V)
    logits = student_logits.to(dtype)
    log_p = F.log_softmax(logits, dim=-1)  # (..., V)
    # A finite logit whose log-probability is -inf: its distance to the row's largest logit
    # overflowed the compute dtype (a spread above about 3.4e38 in float32).
    if bool(((log_p == -math.inf) & (logits > -math.inf)).any()):
        raise ValueError(f"student_logits span more than the range of {dtype} within a "
                         "position: log_softmax overflows (shift or rescale them)")
    # s_v = log p_v at the reported ids (the student's full softmax), t_v = log q_v
    s = log_p.gather(-1, topk_ids)  # (..., k)
    t = teacher_topk_logp.detach().to(dtype)  # (..., k)
    log_a, log_b = (s, t) if direction == "reverse" else (t, s)
    if approximation == "ignore":
        # (c): sum_{v in S} a_v log(a_v / b_v)
        return _kl_terms(log_a, log_b)
    # log P, log Q: the captured masses. With k = V the student's P is 1 identically: summed,
    # its rounding (1e-16) would reach the gradient, which can be as small (p close to q).
    log_P = torch.zeros_like(s[..., :1]) if k == V else _logsumexp(s)
    log_Q = _logsumexp(t)
    log_A, log_B = (log_P, log_Q) if direction == "reverse" else (log_Q, log_P)
    if approximation == "renormalize":
        # (a): KL(a~ || b~) with a~ = a / A on S. A = 0 (a has no mass on S): a~ does not
        # exist, and the value is 0 (every term is 0 log 0); B = 0 < A: +inf. Dividing by a
        # mass of 0 would be -inf - (-inf) = NaN, in the value or the gradient: divide by 1.
        return _kl_terms(log_a - torch.where(log_A > -math.inf, log_A, torch.zeros_like(log_A)),
                         log_b - torch.where(log_B > -math.inf, log_B, torch.zeros_like(log_B)))
    # (b): append the bucket and take the KL over k + 1 outcomes. The student's tail mass
    # 1 - P is summed from its own entries off S (no cancellation when P is close to 1); the
    # teacher's can only be log(1 - Q).
    in_S = torch.zeros_like(log_p, dtype=torch.bool).scatter_(-1, topk_ids, True)
    student_tail = _logsumexp(torch.where(in_S, torch.full_like(log_p, -math.inf), log_p))
    if k == V:
        # S is the whole vocabulary: the teacher has no tail. log(1 - Q) would read the
        # rounding of Q (1 - 6e-8, say) as tail mass, against a student tail of exactly 0:
        # a forward KL of +inf with a zero gradient.
        teacher_tail = torch.full_like(log_Q, -math.inf)
    else:
        teacher_tail = _log1mexp(log_Q)  # log(1 - Q)
        if direction == "reverse":
            # 1 - Q is known to the rounding of the sum Q, about k eps: a Q that rounds to 1
            # made the bucket's term (1 - P) log((1 - P) / (1 - Q)) +inf where the true KL is
            # finite. Below k eps the tail is taken as k eps, at least the true one: the term
            # decreases as the teacher's tail grows, so (b) stays a lower bound.
            floor = math.log(k * torch.finfo(dtype).eps)
            teacher_tail = teacher_tail.clamp_min(floor)
    tail_a, tail_b = ((student_tail, teacher_tail) if direction == "reverse"
                      else (teacher_tail, student_tail))
    return _kl_terms(torch.cat([log_a, tail_a], dim=-1), torch.cat([log_b, tail_b], dim=-1))


# ---------------------------------------------------------------------------------------------
# The study: bias of each approximation against k on Zipf-like distributions
# ---------------------------------------------------------------------------------------------
def zipf_pair(V=4096, exponent=1.1, temperature=1.0, noise=1.0, seed=0):
    r"""A teacher with Zipf-like probabilities and a student that disagrees with it.

    The teacher's logits are $-s \log r_v$ for the ranks $r_v = 1, \dots, V$ (a Zipf law,
    $q_v \propto r_v^{-s}$, the shape of a language model's next-token distribution); the
    student's are the teacher's plus independent Gaussian noise of standard deviation
    ``noise``. Both are divided by the sampling ``temperature`` $\tau$: $\tau < 1$ sharpens
    the distributions (the top-k then holds more mass), $\tau > 1$ flattens them.

    Returns
    -------
    tuple of torch.Tensor
        ``(student_logits, teacher_logits)``, each ``(V,)`` float64.

    Examples
    --------
    >>> student, teacher = zipf_pair(V=3, exponent=1.0, noise=0.0)
    >>> [round(v, 4) for v in teacher.softmax(-1).tolist()]  # (1, 1/2, 1/3) / (11/6)
    [0.5455, 0.2727, 0.1818]
    """
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        raise ValueError(f"V must be a positive int, got {V!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    exponent = check_finite_number("exponent", exponent, low=0.0)
    temperature = check_finite_number("temperature", temperature, positive=True)
    noise = check_finite_number("noise", noise, low=0.0)
    # CPU by design: the study's data; the CPU generator draws the same noise on every machine
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, V + 1, dtype=torch.float64)  # CPU by design (the study's data)
    teacher = -exponent * ranks.log()
    # CPU by design (the study's data)
    student = teacher + noise * torch.randn(V, generator=g, dtype=torch.float64)
    return student / temperature, teacher / temperature


def _true_kl(student_logits, teacher_logits, direction):
    log_p = F.log_softmax(student_logits, dim=-1)
    log_q = F.log_softmax(teacher_logits, dim=-1)
    return _kl_terms(log_p, log_q) if direction == "reverse" else _kl_terms(log_q, log_p)


def _check_ks(ks, V):
    """``ks`` as a list of distinct ints in [1, V] (a repeated k would repeat its rows)."""
    ks = list(ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
            raise ValueError(f"ks must hold ints in [1, V] = [1, {V}], got {k!r}")
    if len(set(ks)) != len(ks):
        raise ValueError(f"ks must not repeat a value (one row per k), got {ks!r}")
    return ks


def _check_figure_data(data, keys):
    """Raise unless ``data`` is a dict of ``topk_bias_figure_data`` with ``keys``."""
    if not isinstance(data, dict) or not set(keys) <= set(data) \
            or not isinstance(data["rows"], dict):
        raise TypeError(f"data must be the dict of topk_bias_figure_data, with keys {keys} and "
                        f"its rows by temperature, got {type(data).__name__}"
                        + (f" with keys {sorted(data)}" if isinstance(data, dict) else ""))


def _grad(fn, student_logits):
    z = student_logits.detach().clone().requires_grad_(True)
    value = fn(z)
    (gradient,) = torch.autograd.grad(value, z)
    return value.item(), gradient


def topk_bias_table(ks, student_logits, teacher_logits):
    r"""Exact value and gradient bias of each approximation, for each $k$, at one position.

    The support is the teacher's top-k. For each $k$, approximation and direction, the
    approximation's value $\hat D$ and gradient $\hat g$ (with respect to all $V$ student
    logits) are compared with the true KL $D$ and its gradient $g$, computed over the full
    vocabulary:

    $$
    \text{rel. bias} = \frac{\hat D - D}{D}, \qquad
    \text{rel. gradient bias} = \frac{\lVert \hat g - g \rVert}{\lVert g \rVert}.
    $$

    Parameters
    ----------
    ks : iterable of int
        Values of $k$ in ``[1, V]``.
    student_logits, teacher_logits : torch.Tensor
        ``(V,)`` floating (see [opd_literate.large_vocab.topk.zipf_pair][]).

    Returns
    -------
    list of dict
        One row per ``(k, direction, approximation)`` with keys ``k``, ``direction``,
        ``approximation``, ``teacher_mass`` ($Q$), ``student_mass`` ($P$), ``true``,
        ``approx``, ``rel_bias``, ``rel_grad_bias``.

    Examples
    --------
    With $k = V$ nothing is left out, and every approximation is exact:

    >>> student, teacher = zipf_pair(V=5, noise=0.5)
    >>> rows = topk_bias_table([5], student, teacher)
    >>> max(abs(r["rel_bias"]) + r["rel_grad_bias"] for r in rows) < 1e-12
    True
    """
    check_float_tensor("student_logits", student_logits, 1)
    check_float_tensor("teacher_logits", teacher_logits, 1)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"teacher_logits must have the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    V = student_logits.shape[0]
    ks = _check_ks(ks, V)
    for name, logits in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not bool((logits < math.inf).all()) or bool((logits == -math.inf).all()):
            raise ValueError(f"{name} must be finite or -inf, with one finite entry")
    log_q = F.log_softmax(teacher_logits.detach().to(torch.float64), dim=-1)
    student = student_logits.detach().to(torch.float64)
    # the true KL and its gradient, the denominators of the relative biases
    truth = {d: _grad(lambda z, d=d: _true_kl(z, log_q, d), student) for d in DIRECTIONS}
    if not all(0.0 < value < math.inf and float(grad.norm()) > 0.0
               for value, grad in truth.values()):
        raise ValueError("the true KLs and their gradients must be nonzero and finite for a "
                         f"relative bias, got KL {[value for value, _ in truth.values()]} "
                         "(the student equals the teacher, or one side puts mass where the "
                         "other has none)")
    order = log_q.argsort(descending=True)
    rows = []
    for k in ks:
        ids = order[:k]
        Q = log_q[ids].exp().sum().item()
        P = F.log_softmax(student, -1)[ids].exp().sum().item()
        for direction in DIRECTIONS:
            true, true_grad = truth[direction]
            for approximation in APPROXIMATIONS:
                approx, grad = _grad(
                    lambda z, a=approximation, d=direction, S=ids: topk_kl(z, log_q[S], S, a, d),
                    student)
                rows.append({
                    "k": int(k), "direction": direction, "approximation": approximation,
                    "teacher_mass": Q, "student_mass": P, "true": true, "approx": approx,
                    "rel_bias": (approx - true) / true,
                    "rel_grad_bias": float((grad - true_grad).norm() / true_grad.norm()),
                })
    return rows


def topk_bias_figure_data(V=4096, exponent=1.1, temperatures=(0.7, 1.0), noise=1.0, seed=0,
                          ks=None):
    r"""The data of the relative-bias figure: ``topk_bias_table`` rows for each temperature.

    Returns
    -------
    dict
        ``{"V", "exponent", "noise", "ks", "rows": {temperature: rows}}``.

    Examples
    --------
    >>> data = topk_bias_figure_data(V=64, temperatures=(1.0,), ks=[1, 64])
    >>> sorted({r["k"] for r in data["rows"][1.0]})
    [1, 64]
    """
    if ks is None:
        if isinstance(V, bool) or not isinstance(V, int) or V < 2:
            raise ValueError(f"V must be an int >= 2 for the default ks, got {V!r}")
        # CPU by design: the ks are plain ints
        # k from 1 to V / 2 (at k = V every approximation is the full KL), with the table's
        ks = {int(round(x)) for x in torch.logspace(0, math.log10(V / 2), 25).tolist()}
        ks = sorted(ks | {k for k in (1, 5, 20, 100, 500) if k < V})
    elif isinstance(V, bool) or not isinstance(V, int) or V < 1:
        raise ValueError(f"V must be a positive int, got {V!r}")
    ks = _check_ks(ks, V)  # checked here too: with no temperature no table checks them
    temperatures = [check_finite_number("temperatures", t, positive=True) for t in temperatures]
    if len(set(temperatures)) != len(temperatures):
        raise ValueError(f"temperatures must not repeat a value (one set of rows each), got "
                         f"{temperatures!r}")
    rows = {}
    for temperature in temperatures:
        student, teacher = zipf_pair(V, exponent, temperature, noise, seed)
        rows[float(temperature)] = topk_bias_table(ks, student, teacher)
    return {"V": V, "exponent": exponent, "noise": noise, "ks": list(ks), "rows": rows}


def format_topk_bias_table(data, ks=(1, 5, 20, 100, 500)):
    r"""A Markdown table of ``data`` (from ``topk_bias_figure_data``) at a few values of $k$.

    One row per temperature and $k$; one column per direction and approximation, each cell
    "relative value bias / relative gradient bias".

    Examples
    --------
    At $k = V$ the teacher reports everything ($Q = 1$) and every cell is exact:

    >>> data = topk_bias_figure_data(V=64, temperatures=(1.0,), ks=[64])
    >>> row = format_topk_bias_table(data, ks=[64]).splitlines()[2]
    >>> cells = row.strip("| ").split(" | ")
    >>> cells[:3], sorted({c.lstrip("+-") for c in cells[3:]})  # zero up to rounding
    (['1', '64', '1.000'], ['0.000 / 0.000'])
    """
    _check_figure_data(data, ("ks", "rows"))
    columns = [(d, a) for d in DIRECTIONS for a in APPROXIMATIONS]
    header = "| τ | k | teacher mass Q | " + " | ".join(
        f"{d} ({'abc'[APPROXIMATIONS.index(a)]}) {a}" for d, a in columns) + " |"
    lines = [header, "| ---: | ---: | ---: | " + " | ".join("---:" for _ in columns) + " |"]
    for temperature, rows in data["rows"].items():
        for k in ks:
            cells = {(r["direction"], r["approximation"]): r for r in rows if r["k"] == k}
            if not cells:
                raise ValueError(f"k = {k} is not in the data (ks = {data['ks']})")
            mass = next(iter(cells.values()))["teacher_mass"]
            lines.append(f"| {temperature:g} | {k} | {mass:.3f} | " + " | ".join(
                f"{cells[c]['rel_bias'] + 0.0:+.3f} / {cells[c]['rel_grad_bias']:.3f}"
                for c in columns) + " |")
    return "\n".join(lines)


def plot_topk_bias(path, data=None):
    r"""Draw relative value bias and relative gradient bias against $k$ into ``path`` (an SVG).

    Two rows (reverse and forward KL), two columns (value, gradient); one line per
    approximation and temperature: the line style is the approximation (solid (a), dashed (b),
    dotted (c)), the colour the temperature. ``data`` defaults to ``topk_bias_figure_data()``.
    Drawn at the site's column width and type scale (``opd_literate._figures``).

    Returns
    -------
    pathlib.Path
        The written file.
    """
    import pathlib

    data = topk_bias_figure_data() if data is None else data
    _check_figure_data(data, ("V", "rows"))
    fig, axes = new_figure(2, 2, height=6.4, sharex=True)
    styles = {"renormalize": "-", "tail": "--", "ignore": ":"}
    for number, (temperature, rows) in enumerate(data["rows"].items()):
        for approximation in APPROXIMATIONS:
            for i, direction in enumerate(DIRECTIONS):
                sel = [r for r in rows if r["direction"] == direction
                       and r["approximation"] == approximation]
                ks = [r["k"] for r in sel]
                label = f"({'abc'[APPROXIMATIONS.index(approximation)]}) {approximation}, " \
                        f"τ = {temperature:g}"
                colour = f"C{number}"
                axes[i, 0].plot(ks, [r["rel_bias"] for r in sel], styles[approximation],
                                color=colour, marker=".", label=label)
                axes[i, 1].plot(ks, [r["rel_grad_bias"] for r in sel],
                                styles[approximation], color=colour, marker=".", label=label)
    names = {"reverse": "reverse KL(p ‖ q)", "forward": "forward KL(q ‖ p)"}
    for i, direction in enumerate(DIRECTIONS):
        axes[i, 0].set(xscale="log", ylabel=f"{names[direction]}\nrelative value bias")
        axes[i, 1].set(xscale="log", yscale="log", ylabel="relative gradient bias")
        axes[i, 0].axhline(0.0, color="black", lw=0.6)
    axes[0, 0].set_title("value: (approx − true) / true")
    axes[0, 1].set_title("gradient: ‖ĝ − g‖ / ‖g‖")
    for ax in axes[1]:
        ax.set_xlabel(f"k (teacher's top-k of V = {data['V']:,})")
    for ax in axes.flat:
        ax.grid(True, which="both")  # the log axes gridded at their minor ticks too
    fig.legend(*axes[0, 1].get_legend_handles_labels(), loc="lower center", ncol=3,
               bbox_to_anchor=(0.5, 0.0), columnspacing=1.2, handlelength=2.4)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = pathlib.Path(path)
    path.write_bytes(svg_bytes(fig))
    return path
