r"""On-policy distillation (OPD): the lab's three tasks and the loss family around them.

A student policy $\pi_\theta$ writes a response $y = (y_1, \dots, y_T)$ to a prompt $x$. A frozen
teacher $\pi_T$ then reads the *student's* response and scores every token of it. Because the
student is corrected on the states $s_t = (x, y_{<t})$ that it actually visits, it learns to
recover from its own mistakes: the DAgger idea, applied to language models.

Shapes used throughout (``B, T, V = student_logits.shape``):

* ``B``: responses in the batch; ``T``: response positions; ``V``: vocabulary size.
* ``student_logp``, ``teacher_logp``: ``(B, T)``, the log-probability of the sampled token
  $y_t$ under each model.
* ``student_logits``, ``teacher_logits``: ``(B, T, V)``, the full next-token logits.
* ``mask``: ``(B, T)``, 1 for the tokens the student generated (``<eos>`` included), 0 for the
  padding after ``<eos>``.

There are two ways to turn "be like the teacher" into a gradient.

**Sampled-token OPD** (lab Tasks 1 and 2). Use the per-token reward

$$
r_t = \log \pi_T(y_t \mid s_t) - \log \pi_\theta(y_t \mid s_t)
$$

in an ordinary policy-gradient loss with discount 0. Only the sampled token's log-probability
under the teacher is needed, so the teacher can be a served model that returns log-probs.

**Full-vocabulary OPD** (lab Task 3). At every visited state compute the exact reverse KL
$\mathrm{KL}(\pi_\theta(\cdot \mid s_t) \,\|\, \pi_T(\cdot \mid s_t))$ over the vocabulary and
minimize it directly. It needs the teacher's full logits, and in exchange has no sampling noise at
a given state.

The module also holds the variants the training frameworks ship: the k1/k2/k3 single-sample KL
estimators (and what their gradients are as a loss versus as a reward), the forward KL, the
generalized Jensen-Shannon divergence, a discounted sampled-token loss and the five loss
reductions.

Conventions shared by every function here:

* Inputs are validated: a wrong shape, ndim or dtype, a mask value outside {0, 1}, a missing
  mask, or a bool or string where a number is expected, raises a ``ValueError`` or
  ``TypeError`` naming the argument. Nothing is broadcast silently.
* bf16 and fp16 inputs are computed in float32 (see ``_numerics.compute_dtype``) by every
  function, and the result is float32; gradients flow back to the inputs in their own dtype
  (in fp16 a gradient above 65504 in magnitude overflows to ``inf`` on the way back).
* Positions where ``mask == 0`` contribute exactly 0 to values *and* gradients, whatever the
  inputs hold there (``-inf``, a row of ``-inf``, NaN): they are selected away with
  ``torch.where`` before any arithmetic, never multiplied by 0 (``0 * inf`` is NaN).
* A ``-inf`` logit means "this vocabulary entry is impossible". Where the student gives an entry
  probability 0 it contributes $0 \log 0 = 0$, in the forward and the backward pass; an entry
  impossible in both models (a padded vocabulary) contributes nothing anywhere. Where the
  teacher gives probability 0 to an entry that the student can emit, the reverse KL is $+\infty$:
  that is the true value, and it is returned as such. Its gradient at that position is 0 (no
  finite step makes an infinite KL finite, so the position gives no direction), and the other
  positions keep their own gradients.
* ``B = 0`` or ``T = 0`` is allowed: a loss is 0 (an empty mean), a per-token result is empty.
  ``V = 0`` is a ``ValueError``.

**Which identities hold for variable-length responses.** When a response can end early at
``<eos>``, the number of tokens in a batch is random and depends on the sampled tokens. The
per-state identities (E over $y_t$ of the Task-2 gradient = the Task-3 gradient; discount 1
gives the sequence reverse-KL gradient) survive the batch reduction only when its normaliser
does not depend on the sampled lengths: ``"sum"``, ``"seq-mean-token-sum"`` (a fixed $1/B$) and
``"seq-mean-token-sum-norm"`` (a fixed $1/(BT)$). With ``"token-mean"`` (Task 2 and Task 3 as
written) or ``"seq-mean-token-mean"`` the expected gradients differ. On the enumerable two-step
model with ``<eos>`` of ``tests/opd/test_reductions.py`` the discount-1 expected gradient of
``token-mean`` points 7.26 degrees away from the sequence-KL gradient (3.42 degrees with two
responses a batch), and with one response a batch E[Task-2 gradient] differs from
E[Task-3 gradient] by 21.5% of the latter's norm; with a fixed normaliser both identities hold
to $10^{-12}$.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._numerics import (
    REDUCTIONS,
    aggregate,
    check_finite_number,
    check_float_tensor,
    check_mask,
    check_reduction,
    check_same_shape,
    compute_dtype,
    kl_to_mixture,
    masked_mean,
    select,
)

__all__ = [
    "REDUCTIONS",
    "KL_ESTIMATORS",
    "reverse_kl_rewards",
    "opd_pg_loss",
    "full_vocab_reverse_kl",
    "reverse_kl_per_position",
    "forward_kl_per_position",
    "forward_kl",
    "generalized_jsd_per_position",
    "generalized_jsd",
    "kl_estimator",
    "expected_kl_estimator_gradient",
    "discounted_returns",
    "aggregate_loss",
    "sampled_token_opd_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
"""The single-sample KL estimators of [opd_literate.opd.kl_estimator][]."""


# ---------------------------------------------------------------------------------------------
# Input checks shared by the functions below.
# ---------------------------------------------------------------------------------------------
def _check_token_pair(student_logp, teacher_logp, mask):
    """Validate (B, T) log-probs of the sampled tokens and return the mask as bool."""
    check_float_tensor("student_logp", student_logp, 2)
    check_float_tensor("teacher_logp", teacher_logp, 2)
    check_same_shape("student_logp", student_logp, "teacher_logp", teacher_logp)
    return check_mask(mask, "student_logp", tuple(student_logp.shape))


def _check_logits_pair(student_logits, teacher_logits, mask, mask_optional=False):
    """Validate (B, T, V) logits; return the bool mask (None only when optional and not given)."""
    check_float_tensor("student_logits", student_logits, 3)
    check_float_tensor("teacher_logits", teacher_logits, 3)
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            "teacher_logits must have the vocabulary size of student_logits "
            f"(V = {student_logits.shape[-1]}), got V = {teacher_logits.shape[-1]}; "
            "student and teacher must share one tokenizer"
        )
    check_same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    if student_logits.shape[-1] == 0:
        raise ValueError(
            f"student_logits must have a vocabulary of at least 1 entry, got shape "
            f"{tuple(student_logits.shape)} (V = 0)"
        )
    checked = None if mask is None and mask_optional else check_mask(
        mask, "student_logits[..., 0]", tuple(student_logits.shape[:2]))
    _check_no_nan("student_logits", student_logits, checked)
    _check_no_nan("teacher_logits", teacher_logits, checked)
    return checked


def _check_no_nan(name, logits, mask):
    """Raise if ``logits`` hold NaN at a position ``mask`` selects (None: at any position).

    The support tests (``log p > -inf``) read NaN as probability 0: a NaN student gave a loss
    of exactly 0.0. Masked-out positions may hold NaN.
    """
    if bool((torch.isnan(logits).any(dim=-1) & (True if mask is None else mask)).any()):
        raise ValueError(f"{name} holds NaN at a position"
                         + ("" if mask is None else " that the mask selects")
                         + ": a logit is a number or -inf; only masked-out positions may hold NaN")


def _log_softmax_pair(student_logits, teacher_logits, mask=None, temperature=1.0):
    r"""log_softmax of both, in the compute dtype; the teacher is detached (a constant).

    Both logits are divided by ``temperature`` before the softmax, as TRL's
    ``generalized_jsd_loss`` and ``DistillationTrainer`` do (TRL 1.16.0; note that
    ``GKDTrainer.compute_loss`` does not pass its temperature on). Each row's largest finite
    logit is subtracted first (a constant shift, which the softmax ignores), so that a small
    temperature cannot overflow $z / \tau$ to $+\infty$; a temperature whose inverse is not
    finite in the compute dtype is refused.

    Where ``mask`` is 0 both rows are replaced by zeros *before* the softmax, so whatever a
    masked-out position holds (``-inf``, NaN) reaches neither the value nor the gradient: a
    ``-inf`` selected away only after the loss is computed still sends ``0 * inf = NaN`` back
    through the backward pass.
    """
    dtype = compute_dtype(student_logits, teacher_logits)
    student = student_logits.to(dtype)
    teacher = teacher_logits.detach().to(dtype)
    if mask is not None:
        keep = mask[..., None]  # (B, T, 1)
        student = torch.where(keep, student, torch.zeros_like(student))
        teacher = torch.where(keep, teacher, torch.zeros_like(teacher))
    if temperature != 1.0:  # softmax(z / tau); skipped at 1 so the default is bit for bit unchanged
        if 1.0 / temperature > torch.finfo(dtype).max:  # z / tau would overflow for |z| >= 1
            raise ValueError(
                f"temperature must be at least 1 / (the largest {dtype} number), "
                f"got {temperature!r}"
            )
        student = _shift_to_max(student) / temperature
        teacher = _shift_to_max(teacher) / temperature
    # log_softmax subtracts the max before exponentiating: finite for logits of any magnitude,
    # where log(softmax(z)) underflows to log(0) = -inf for entries far below the max.
    return F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)


def _shift_to_max(logits):
    """``logits`` minus each row's largest finite entry (a detached constant); -inf rows kept."""
    finite = torch.isfinite(logits)
    row_max = torch.where(finite, logits, torch.full_like(logits, -math.inf)).amax(-1, True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    return logits - row_max.detach()


def _kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    r"""$\sum_v p_v (\log p_v - \log q_v)$ over the last axis, with $0 \log 0 = 0$.

    Entries with $p_v = 0$ are selected away *before* the subtraction, so that neither the value
    nor the gradient sees $-\infty - (-\infty)$. Entries with $p_v > 0 = q_v$ make the value
    $+\infty$; that infinity is selected in as a constant, so the position's gradient is 0 (not
    NaN, and not the gradient of its finite part).
    """
    ### BEGIN SOLUTION Task 3: sum_v p_v (log p_v - log q_v); 0 where p_v = 0, in value and gradient
    support = log_p > -math.inf  # the entries p can emit (p_v > 0, even if exp underflows)
    both = support & (log_q > -math.inf)
    # The double where: both operands are replaced by 0 off `both`, so the backward pass
    # multiplies a zero upstream gradient by finite numbers only (no 0 * inf = NaN).
    log_p_safe = torch.where(both, log_p, torch.zeros_like(log_p))
    log_q_safe = torch.where(both, log_q, torch.zeros_like(log_q))
    terms = log_p_safe.exp() * (log_p_safe - log_q_safe)
    kl = torch.where(both, terms, torch.zeros_like(terms)).sum(dim=-1)
    # Rounding can leave a KL of -1e-8 where the distributions agree; the true value is >= 0.
    kl = kl.clamp_min(0.0)
    # p_v > 0 = q_v somewhere: the true KL is +inf (a constant: no gradient flows through it).
    infinite = (support & ~both).any(dim=-1)
    return torch.where(infinite, torch.full_like(kl, math.inf), kl)
    ### END SOLUTION


# ---------------------------------------------------------------------------------------------
# Task 1
# ---------------------------------------------------------------------------------------------
def reverse_kl_rewards(student_logp, teacher_logp, mask):
    r"""Per-token OPD reward: minus the single-sample estimate of the reverse KL (lab Task 1).

    $$
    r_t = \log \pi_T(y_t \mid s_t) - \log \pi_\theta(y_t \mid s_t),
    \qquad r_t = 0 \text{ where } \mathrm{mask}_t = 0 .
    $$

    The student's own token $y_t$ is drawn from $\pi_\theta(\cdot \mid s_t)$, so the expected
    negative reward at a state is exactly the reverse KL at that state:

    $$
    \mathbb{E}_{y_t \sim \pi_\theta}[-r_t]
    = \sum_v \pi_\theta(v \mid s_t) \log \frac{\pi_\theta(v \mid s_t)}{\pi_T(v \mid s_t)}
    = \mathrm{KL}\big(\pi_\theta(\cdot \mid s_t) \,\|\, \pi_T(\cdot \mid s_t)\big).
    $$

    A positive $r_t$ reads "the teacher likes this token more than you do: do it more". The
    reward is *mode seeking*: a token the teacher finds unlikely gets a large negative reward,
    a token the student never emits gets no reward at all.

    Parameters
    ----------
    student_logp : torch.Tensor
        ``(B, T)`` floating, $\log \pi_\theta(y_t \mid s_t)$ of the sampled tokens. It may carry
        a gradient; the reward never does.
    teacher_logp : torch.Tensor
        ``(B, T)`` floating, $\log \pi_T(y_t \mid s_t)$ of the same tokens.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1} (bool, integer or floating).

    Returns
    -------
    torch.Tensor
        ``(B, T)``, detached from the graph (a reward is data, not a loss): ``teacher_logp -
        student_logp`` where the mask is 1 and exactly 0 where it is 0, even if the inputs hold
        ``-inf`` there.

    Examples
    --------
    Two positions; the student is more confident than the teacher on the first token and less on
    the second; the third position is padding:

    >>> student_logp = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    >>> teacher_logp = torch.log(torch.tensor([[0.25, 0.5, 1.0]]))
    >>> mask = torch.tensor([[1.0, 1.0, 0.0]])
    >>> r = reverse_kl_rewards(student_logp, teacher_logp, mask)
    >>> [round(v, 4) for v in r[0].tolist()]  # log(1/2), log 2, 0
    [-0.6931, 0.6931, 0.0]
    >>> r.requires_grad
    False
    """
    mask = _check_token_pair(student_logp, teacher_logp, mask)
    ### BEGIN SOLUTION Task 1: teacher_logp - student_logp, detached, float32 for half; 0 off mask
    dtype = compute_dtype(student_logp, teacher_logp)  # float32 for half precision
    # r_t = log pi_T(y_t|s_t) - log pi_theta(y_t|s_t); detached: a reward is a constant.
    log_ratio = teacher_logp.detach().to(dtype) - student_logp.detach().to(dtype)
    # where, not "* mask": padding may hold -inf log-probs and 0 * inf is NaN.
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ### END SOLUTION


# ---------------------------------------------------------------------------------------------
# Task 2
# ---------------------------------------------------------------------------------------------
def opd_pg_loss(student_logp, rewards, mask):
    r"""REINFORCE loss for sampled-token OPD with discount 0, token-mean (lab Task 2).

    The advantage of token $t$ is its own reward, $A_t = r_t$: no reward-to-go, no baseline and
    no importance ratio, because each batch is fresh from the current student and used for one
    gradient step (exactly on-policy). With $N = \sum_{b,t} \mathrm{mask}_{b,t}$,

    $$
    \mathcal{L}(\theta) = -\frac{1}{N} \sum_{b,t} \mathrm{mask}_{b,t}\,
    \mathrm{sg}(r_{b,t}) \log \pi_\theta(y_{b,t} \mid s_{b,t}),
    $$

    where $\mathrm{sg}$ is stop-gradient. Its gradient with respect to ``student_logp[b, t]`` is
    $-r_{b,t}\,\mathrm{mask}_{b,t} / N$.

    Why this estimates the reverse-KL gradient. At a fixed state $s$ with student probabilities
    $p = \pi_\theta(\cdot \mid s)$ and teacher $q$, write $d_v = \log p_v - \log q_v$. Then

    $$
    \nabla_\theta \mathrm{KL}(p \,\|\, q)
    = \sum_v \nabla p_v \, (d_v + 1)
    = \sum_v p_v \nabla \log p_v \, d_v + \nabla \!\sum_v p_v
    = \mathbb{E}_{v \sim p}\big[d_v \nabla \log p_v\big],
    $$

    because $\sum_v p_v = 1$. The single-token term $-\mathrm{sg}(r_t) \nabla \log p_{y_t} =
    d_{y_t} \nabla \log p_{y_t}$ with $y_t \sim p$ is therefore an unbiased estimate of
    $\nabla \mathrm{KL}$ at that state: exactly the quantity the full-vocabulary loss
    [opd_literate.opd.full_vocab_reverse_kl][] differentiates. Discount 0 means the estimate
    ignores how $y_t$ changes the *later* states; see
    [opd_literate.opd.sampled_token_opd_loss][] for $\gamma > 0$.

    The identity holds per state. Over a batch it needs the normaliser $N$ not to depend on the
    sampled tokens: with responses that can end at ``<eos>``, $N$ does (sampling ``<eos>``
    shortens the response), and the expected token-mean gradient of this loss is no longer the
    expected token-mean gradient of [opd_literate.opd.full_vocab_reverse_kl][] (21.5% apart on
    the two-step model of ``tests/opd/test_reductions.py``). With a fixed normaliser,
    ``sampled_token_opd_loss(..., gamma=0, reduction="sum")`` against the ``"sum"`` of
    [opd_literate.opd.reverse_kl_per_position][], they agree exactly.

    Parameters
    ----------
    student_logp : torch.Tensor
        ``(B, T)`` floating, $\log \pi_\theta(y_t \mid s_t)$, carrying the gradient.
    rewards : torch.Tensor
        ``(B, T)`` floating, usually from [opd_literate.opd.reverse_kl_rewards][]. Detached here
        anyway: no gradient ever flows into it.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.

    Returns
    -------
    torch.Tensor
        A scalar (float32 for half-precision inputs). An all-zero mask, or an empty batch,
        gives a loss of 0 with a zero (finite) gradient.

    Examples
    --------
    >>> logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    >>> r = torch.tensor([[-1.0, 2.0]])
    >>> loss = opd_pg_loss(logp, r, torch.ones(1, 2))
    >>> round(loss.item(), 4)  # -(-1 * log 0.5 + 2 * log 0.25) / 2
    1.0397
    >>> loss.backward()
    >>> logp.grad.tolist()  # -r / N
    [[0.5, -1.0]]
    """
    check_float_tensor("student_logp", student_logp, 2)
    check_float_tensor("rewards", rewards, 2)
    check_same_shape("student_logp", student_logp, "rewards", rewards)
    mask = check_mask(mask, "student_logp", tuple(student_logp.shape))
    ### BEGIN SOLUTION Task 2: -sum(mask * sg(r) * logp) / max(sum(mask), 1), where; fp32 for half
    dtype = compute_dtype(student_logp, rewards)  # float32 for half precision
    zeros = torch.zeros(student_logp.shape, dtype=dtype, device=student_logp.device)
    # sg(r): the reward is a constant; only log pi_theta(y_t|s_t) is differentiated.
    advantage = torch.where(mask, rewards.detach().to(dtype), zeros)
    logp = torch.where(mask, student_logp.to(dtype), zeros)
    # loss = -sum_{b,t} mask * sg(r) * log pi / max(sum mask, 1); the max guards N = 0.
    return -(advantage * logp).sum() / mask.sum().clamp_min(1).to(dtype)
    ### END SOLUTION


# ---------------------------------------------------------------------------------------------
# Task 3
# ---------------------------------------------------------------------------------------------
def reverse_kl_per_position(student_logits, teacher_logits, mask=None, temperature=1.0):
    r"""$\mathrm{KL}(\pi_\theta(\cdot \mid s_t) \,\|\, \pi_T(\cdot \mid s_t))$ at every position.

    $$
    \mathrm{KL}_t = \sum_{v=1}^{V} \pi_\theta(v \mid s_t)
    \big(\log \pi_\theta(v \mid s_t) - \log \pi_T(v \mid s_t)\big),
    $$

    with $0 \log 0 = 0$ (entries the student cannot emit contribute nothing, and no NaN reaches
    the gradient) and $+\infty$ where the student can emit an entry the teacher cannot.
    The teacher is detached.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(B, T, V)`` floating logits of the same shape.
    mask : torch.Tensor, optional
        ``(B, T)`` with values in {0, 1}. Where it is 0 the result is exactly 0 with a zero
        gradient, whatever the logits hold. Pass it rather than selecting afterwards: a
        position that is selected away after the computation still sends NaN back through the
        softmax if its row is all ``-inf`` or NaN.

    temperature : float
        $\tau > 0$: both logits are divided by it before the softmax, as TRL's
        ``DistillationTrainer`` does (default 1.0, which leaves the logits unchanged).

    Returns
    -------
    torch.Tensor
        ``(B, T)``, every entry $\ge 0$; float32 for half-precision inputs.

    Examples
    --------
    >>> s = torch.log(torch.tensor([[[0.5, 0.5, 0.0]]]))   # student cannot emit entry 3
    >>> t = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))
    >>> round(reverse_kl_per_position(s, t).item(), 4)      # log 2
    0.6931
    """
    mask = _check_logits_pair(student_logits, teacher_logits, mask, mask_optional=True)
    temperature = check_finite_number("temperature", temperature, positive=True)
    log_p, log_q = _log_softmax_pair(student_logits, teacher_logits, mask, temperature)
    return select(mask, _kl_from_log_probs(log_p, log_q))


def full_vocab_reverse_kl(student_logits, teacher_logits, mask, temperature=1.0):
    r"""Exact reverse KL at every visited position, token-mean over the batch (lab Task 3).

    $$
    \mathcal{L}(\theta) = \frac{1}{N} \sum_{b,t} \mathrm{mask}_{b,t}\,
    \mathrm{KL}\big(\pi_\theta(\cdot \mid s_{b,t}) \,\|\, \pi_T(\cdot \mid s_{b,t})\big),
    \qquad N = \max\Big(1, \sum_{b,t} \mathrm{mask}_{b,t}\Big).
    $$

    The states $s_{b,t}$ were visited by the student, which is what makes the loss on-policy;
    we do not differentiate through *which* states were visited, only through the student's
    distribution at each of them.

    Its gradient with respect to the student's logits $z$ at one position is, with $p =
    \mathrm{softmax}(z)$ and $q$ the teacher,

    $$
    \frac{\partial \mathrm{KL}}{\partial z_j} = p_j\big(\log p_j - \log q_j - \mathrm{KL}\big),
    $$

    which is the expectation over $y_t \sim p$ of the sampled-token gradient of
    [opd_literate.opd.opd_pg_loss][] (see there). By the law of total variance, replacing a
    random quantity by its conditional expectation can only lower the variance: at a fixed
    state the full-vocabulary gradient has none, while the sampled-token gradient has
    $\mathrm{Var}_{v \sim p}[d_v \nabla \log p_v]$, which is 0 when $p = q$ and in general
    positive otherwise. The price is the
    teacher's full ``(B, T, V)`` logits instead of one log-probability per token.

    That expectation is per state. Over whole responses of variable length, E[Task-2 gradient]
    = E[Task-3 gradient] holds with a normaliser that does not depend on the sampled lengths,
    not with this token-mean (see the module docstring).

    Parameters
    ----------
    student_logits : torch.Tensor
        ``(B, T, V)`` floating, carrying the gradient.
    teacher_logits : torch.Tensor
        ``(B, T, V)`` floating; treated as a constant (detached).
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.

    temperature : float
        $\tau > 0$: both logits are divided by it before the softmax, as TRL's
        ``DistillationTrainer`` does (default 1.0, which leaves the logits unchanged).

    Returns
    -------
    torch.Tensor
        A scalar $\ge 0$ (float32 for half-precision inputs); 0 when the two distributions agree
        at every masked-in position, and 0 (with zero gradient) for an all-zero mask. Masked-out
        positions may hold anything, ``-inf`` and NaN included: they reach neither the value
        nor the gradient.

    Examples
    --------
    Two positions, three vocabulary entries. At the first the student equals the teacher; at
    the second it is uniform against a teacher that puts half its mass on entry 1:

    >>> student = torch.log(torch.tensor([[[0.2, 0.3, 0.5], [1/3, 1/3, 1/3]]]))
    >>> teacher = torch.log(torch.tensor([[[0.2, 0.3, 0.5], [0.5, 0.25, 0.25]]]))
    >>> loss = full_vocab_reverse_kl(student, teacher, torch.ones(1, 2))
    >>> # KL_2 = log(1/3) - (log 0.5 + 2 log 0.25) / 3 = 0.0566; token-mean (0 + KL_2) / 2
    >>> round(loss.item(), 4)
    0.0283
    """
    mask = _check_logits_pair(student_logits, teacher_logits, mask)
    temperature = check_finite_number("temperature", temperature, positive=True)
    ### BEGIN SOLUTION Task 3: log_softmax both (teacher detached), KL per position, masked mean
    # log_softmax (never log(softmax)): stable for logits of any size. Teacher detached;
    # masked-out rows are replaced before the softmax, so their -inf never reach the gradient.
    log_p, log_q = _log_softmax_pair(student_logits, teacher_logits, mask, temperature)
    # KL_t = sum_v p_v (log p_v - log q_v), with 0 log 0 = 0.
    kl_per_position = _kl_from_log_probs(log_p, log_q)  # (B, T)
    # loss = sum_{b,t} mask * KL_t / max(sum mask, 1)
    return masked_mean(kl_per_position, mask)
    ### END SOLUTION


# ---------------------------------------------------------------------------------------------
# Forward KL and the generalized Jensen-Shannon divergence
# ---------------------------------------------------------------------------------------------
def forward_kl_per_position(student_logits, teacher_logits, mask=None, temperature=1.0):
    r"""$\mathrm{KL}(\pi_T(\cdot \mid s_t) \,\|\, \pi_\theta(\cdot \mid s_t))$ at every position.

    $$
    \mathrm{KL}^{\mathrm{fwd}}_t = \sum_v \pi_T(v \mid s_t)
    \big(\log \pi_T(v \mid s_t) - \log \pi_\theta(v \mid s_t)\big).
    $$

    The forward KL is *mass covering*: the student pays $+\infty$ for giving zero probability
    to anything the teacher can say, and nothing for entries the teacher cannot say. Its
    gradient, $\partial/\partial z_j = p_j - q_j$, is the cross-entropy gradient of ordinary
    distillation on the teacher's soft labels.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(B, T, V)`` floating; the teacher is detached.
    mask : torch.Tensor, optional
        ``(B, T)`` in {0, 1}: 0 gives exactly 0 in value and gradient (as in
        [opd_literate.opd.reverse_kl_per_position][]).

    temperature : float
        $\tau > 0$: both logits are divided by it before the softmax, as TRL's
        ``DistillationTrainer`` does (default 1.0, which leaves the logits unchanged).

    Returns
    -------
    torch.Tensor
        ``(B, T)``, every entry $\ge 0$.

    Examples
    --------
    >>> s = torch.log(torch.tensor([[[0.5, 0.5, 0.0]]]))
    >>> t = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))
    >>> forward_kl_per_position(s, t).item()  # the teacher says entry 3, the student cannot
    inf
    """
    mask = _check_logits_pair(student_logits, teacher_logits, mask, mask_optional=True)
    temperature = check_finite_number("temperature", temperature, positive=True)
    return _forward_kl_per_position(student_logits, teacher_logits, mask, temperature)


def _forward_kl_per_position(student_logits, teacher_logits, mask, temperature):
    """[opd_literate.opd.forward_kl_per_position][] on checked inputs (a bool mask or None)."""
    log_p, log_q = _log_softmax_pair(student_logits, teacher_logits, mask, temperature)
    # KL(q || p): the roles swap, the support is now the teacher's.
    return select(mask, _kl_from_log_probs(log_q, log_p))


def forward_kl(student_logits, teacher_logits, mask, temperature=1.0):
    r"""Token-mean forward KL $\mathrm{KL}(\pi_T \,\|\, \pi_\theta)$ over the masked positions.

    The mean over positions of [opd_literate.opd.forward_kl_per_position][], with the same
    masking and normalization as [opd_literate.opd.full_vocab_reverse_kl][].

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(B, T, V)`` floating; the teacher is detached.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.

    temperature : float
        $\tau > 0$: both logits are divided by it before the softmax, as TRL's
        ``DistillationTrainer`` does (default 1.0, which leaves the logits unchanged).

    Returns
    -------
    torch.Tensor
        A scalar $\ge 0$.

    Examples
    --------
    >>> student = torch.log(torch.tensor([[[1/3, 1/3, 1/3]]]))
    >>> teacher = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    >>> # 0.5 log 1.5 + 2 * 0.25 log 0.75 = 0.0589
    >>> round(forward_kl(student, teacher, torch.ones(1, 1)).item(), 4)
    0.0589
    """
    mask = _check_logits_pair(student_logits, teacher_logits, mask)
    temperature = check_finite_number("temperature", temperature, positive=True)
    per_position = _forward_kl_per_position(student_logits, teacher_logits, mask, temperature)
    return masked_mean(per_position, mask)


def generalized_jsd_per_position(student_logits, teacher_logits, beta=0.5, normalize=False,
                                 mask=None, temperature=1.0):
    r"""Generalized Jensen-Shannon divergence at every position (GKD's loss).

    With $p = \pi_\theta(\cdot \mid s_t)$, $q = \pi_T(\cdot \mid s_t)$ and weight
    $\beta \in [0, 1]$, this module uses the convention of TRL's ``GKDTrainer.generalized_jsd_loss``
    (``GKDConfig.beta``, default 0.5; the trainer of Agarwal et al. (2024), *On-Policy
    Distillation of Language Models: Learning from Self-Generated Mistakes*):

    $$
    m = \beta q + (1 - \beta) p, \qquad
    \mathrm{JSD}_\beta(p, q)
    = \beta\, \mathrm{KL}(q \,\|\, m) + (1 - \beta)\, \mathrm{KL}(p \,\|\, m),
    $$

    and at the endpoints, by definition, $\mathrm{JSD}_0 = \mathrm{KL}(q \,\|\, p)$ (forward)
    and $\mathrm{JSD}_1 = \mathrm{KL}(p \,\|\, q)$ (reverse). The mixture is formed in log
    space, which never underflows:

    $$
    \log m = \mathrm{logsumexp}\bigl(\log \beta + \log q,\; \log(1 - \beta) + \log p\bigr).
    $$

    The endpoints are a **discontinuity**. The interpolating formula tends to 0 at both ends
    ($m \to p$ as $\beta \to 0$, $m \to q$ as $\beta \to 1$), so an implementation that
    special-cases $\beta \in \{0, 1\}$ (as TRL does) jumps from about 0 to a full KL there.
    Expanding to first order,

    $$
    \mathrm{JSD}_\beta = \beta\,\mathrm{KL}(q \,\|\, p) + O(\beta^2), \qquad
    \mathrm{JSD}_\beta = (1 - \beta)\,\mathrm{KL}(p \,\|\, q) + O((1 - \beta)^2),
    $$

    so ``normalize=True`` returns $\mathrm{JSD}_\beta / (\beta (1 - \beta))$, which is
    continuous on $[0, 1]$ and equal to the forward and reverse KL at the endpoints. For every
    $\beta$, $\mathrm{JSD}_\beta \le -\beta \log \beta - (1 - \beta) \log (1 - \beta) \le \log 2$.

    Both KLs to the mixture are computed as sums of nonnegative terms, with
    $\varphi(u) = e^u - 1 - u$,

    $$
    \mathrm{KL}(a \,\|\, m) = \sum_{a_v > 0} a_v\, \varphi(\log m_v - \log a_v)
    + \sum_{a_v = 0} m_v :
    $$

    the first-order terms, which cancel in $\sum_v a_v (\log a_v - \log m_v)$, are removed
    before rounding. Dividing the plain form
    by $\beta = 10^{-6}$ in float32 turns its rounding into an error of about 0.03 (it returned
    0.033 for $\mathrm{JSD}(p, p) = 0$); this form keeps the normalized value accurate to
    float32 precision for any $\beta \in (0, 1)$.

    Notes
    -----
    References: the convention and the special-cased endpoints are those of
    ``trl/experimental/gkd/gkd_trainer.py`` (``generalized_jsd_loss``; ``F.kl_div(input,
    target)`` is $\mathrm{KL}(\mathrm{target} \,\|\, \mathrm{input})$, so ``beta == 0`` is
    $\mathrm{KL}(q \,\|\, p)$ and ``beta == 1`` is $\mathrm{KL}(p \,\|\, q)$, with the mixture
    $(1 - \beta) p + \beta q$) and ``trl/experimental/gkd/gkd_config.py`` of huggingface/trl at
    commit ``f2cd57710ae345ea6428ae95363267fcf38a3dc8``.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(B, T, V)`` floating; the teacher is detached.
    beta : float
        The weight in $[0, 1]$.
    normalize : bool
        Divide by $\beta(1 - \beta)$ for $0 < \beta < 1$ (continuous in $\beta$).
    mask : torch.Tensor, optional
        ``(B, T)`` in {0, 1}: 0 gives exactly 0 in value and gradient (as in
        [opd_literate.opd.reverse_kl_per_position][]).

    temperature : float
        $\tau > 0$: both logits are divided by it before the softmax, as TRL's
        ``DistillationTrainer`` does (default 1.0, which leaves the logits unchanged).

    Returns
    -------
    torch.Tensor
        ``(B, T)``, every entry $\ge 0$.

    Examples
    --------
    Two disjoint distributions are as far apart as JSD allows, $\log 2$ at $\beta = 1/2$:

    >>> s = torch.log(torch.tensor([[[1.0, 0.0]]]))
    >>> t = torch.log(torch.tensor([[[0.0, 1.0]]]))
    >>> round(generalized_jsd_per_position(s, t, beta=0.5).item(), 4)
    0.6931
    """
    mask = _check_logits_pair(student_logits, teacher_logits, mask, mask_optional=True)
    beta, temperature = _check_jsd_options(beta, normalize, temperature)
    return _generalized_jsd_per_position(student_logits, teacher_logits, beta, normalize, mask,
                                         temperature)


def _check_jsd_options(beta, normalize, temperature):
    """Validate the JSD's beta, normalize and temperature; return beta and temperature."""
    beta = check_finite_number("beta", beta, low=0.0, high=1.0)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__} {normalize!r}")
    temperature = check_finite_number("temperature", temperature, positive=True)
    return beta, temperature


def _generalized_jsd_per_position(student_logits, teacher_logits, beta, normalize, mask,
                                  temperature):
    """[opd_literate.opd.generalized_jsd_per_position][] on checked inputs."""
    log_p, log_q = _log_softmax_pair(student_logits, teacher_logits, mask, temperature)
    if beta == 0.0:
        return select(mask, _kl_from_log_probs(log_q, log_p))  # forward KL(q || p)
    if beta == 1.0:
        return select(mask, _kl_from_log_probs(log_p, log_q))  # reverse KL(p || q)
    # log m = logsumexp(log beta + log q, log(1 - beta) + log p). An entry impossible in both
    # models (a padded vocabulary) has m = 0: logsumexp(-inf, -inf) would give it a NaN
    # gradient, so it is selected away on both sides.
    padded = (log_p == -math.inf) & (log_q == -math.inf)
    zeros = torch.zeros_like(log_p)
    log_m = torch.logsumexp(
        torch.stack([torch.where(padded, zeros, log_q) + math.log(beta),
                     torch.where(padded, zeros, log_p) + math.log1p(-beta)]), dim=0
    )
    log_m = torch.where(padded, torch.full_like(log_m, -math.inf), log_m)
    kl_teacher = kl_to_mixture(log_q, log_m)  # KL(q || m)
    kl_student = kl_to_mixture(log_p, log_m)  # KL(p || m) = O(beta^2) as beta -> 0
    if normalize:
        # JSD / (beta (1 - beta)), term by term: no product rounded and then divided
        jsd = kl_teacher / (1.0 - beta) + kl_student / beta
    else:
        jsd = beta * kl_teacher + (1.0 - beta) * kl_student
    return select(mask, jsd)


def generalized_jsd(student_logits, teacher_logits, mask, beta=0.5, normalize=False,
                    temperature=1.0):
    r"""Token-mean generalized JSD over the masked positions.

    The mean over positions of [opd_literate.opd.generalized_jsd_per_position][] (see there for
    the convention, the endpoints and ``normalize``).

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        ``(B, T, V)`` floating; the teacher is detached.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.
    beta : float
        The weight in $[0, 1]$: 0 is the forward KL, 1 the reverse KL.
    normalize : bool
        Divide by $\beta(1 - \beta)$ inside $(0, 1)$.

    temperature : float
        $\tau > 0$: both logits are divided by it before the softmax, as TRL's
        ``DistillationTrainer`` does (default 1.0, which leaves the logits unchanged).

    Returns
    -------
    torch.Tensor
        A scalar $\ge 0$.

    Examples
    --------
    >>> student = torch.log(torch.tensor([[[1/3, 1/3, 1/3]]]))
    >>> teacher = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    >>> ones = torch.ones(1, 1)
    >>> # beta = 0: forward KL 0.5 log 1.5 + 0.5 log 0.75; beta = 1: reverse KL (see above)
    >>> [round(generalized_jsd(student, teacher, ones, beta=b).item(), 4) for b in (0, 1)]
    [0.0589, 0.0566]
    >>> jsd = generalized_jsd(student, teacher, ones, beta=0.5).item()
    >>> swapped = generalized_jsd(teacher, student, ones, beta=0.5).item()
    >>> abs(jsd - swapped) < 1e-7, 0.0 < jsd < 0.6931  # symmetric at 1/2, below log 2
    (True, True)

    ``normalize=True`` approaches the endpoints continuously, in float32 too:

    >>> [round(generalized_jsd(student, teacher, ones, beta=b, normalize=True).item(), 4)
    ...  for b in (1e-6, 1 - 1e-6)]
    [0.0589, 0.0566]
    >>> generalized_jsd(teacher, teacher, ones, beta=1e-6, normalize=True).item()  # JSD(p, p)
    0.0
    """
    mask = _check_logits_pair(student_logits, teacher_logits, mask)
    beta, temperature = _check_jsd_options(beta, normalize, temperature)
    per_position = _generalized_jsd_per_position(student_logits, teacher_logits, beta, normalize,
                                                 mask, temperature)
    return masked_mean(per_position, mask)


# ---------------------------------------------------------------------------------------------
# k1, k2, k3: single-sample KL estimators
# ---------------------------------------------------------------------------------------------
def kl_estimator(student_logp, teacher_logp, kind="k1"):
    r"""Single-sample estimates of $\mathrm{KL}(\pi_\theta \,\|\, \pi_T)$ from a sampled token.

    With the log-ratio $d = \log \pi_\theta(y) - \log \pi_T(y)$ of a token $y \sim \pi_\theta$
    (J. Schulman, *Approximating KL Divergence*, 2020; verl's ``kl_penalty`` / ``kl_loss_type``
    names ``"kl"`` or ``"k1"``, ``"mse"`` or ``"k2"``, ``"low_var_kl"`` or ``"k3"``, see the
    Notes for how verl's k3 differs):

    $$
    k_1 = d, \qquad k_2 = \tfrac{1}{2} d^2, \qquad k_3 = e^{-d} - 1 + d .
    $$

    $k_1$ and $k_3$ are unbiased for the reverse KL ($\mathbb{E}_p[e^{-d}] = \sum_v q_v = 1$);
    $k_3 \ge 0$ always, with less variance when $p \approx q$; $k_2$ is biased (its
    expectation is $\tfrac12 \mathbb{E}[d^2]$) but close when $p \approx q$.

    Their *gradients* are another matter, and depend on how the value is used. Backpropagated
    as a **loss** (the sample held fixed, $\nabla$ through $\log \pi_\theta(y)$ only) the
    expected gradients over $y \sim p$ are

    $$
    \begin{aligned}
    \mathbb{E}[\nabla k_1] &= \mathbb{E}[\nabla \log p_y] = 0, \\
    \mathbb{E}[\nabla k_2] &= \mathbb{E}[d\,\nabla \log p_y] = \nabla \mathrm{KL}(p \,\|\, q), \\
    \mathbb{E}[\nabla k_3] &= \mathbb{E}[(1 - e^{-d}) \nabla \log p_y] \\
    &= -\sum_v q_v \nabla \log p_v = \nabla \mathrm{KL}(q \,\|\, p).
    \end{aligned}
    $$

    So $k_1$ as a loss does nothing on average, $k_2$ as a loss gives the reverse-KL gradient,
    and $k_3$ as a loss gives the *forward*-KL gradient although its value estimates the
    reverse KL. Used as a **reward** (a cost $k$ inside a REINFORCE surrogate
    $\mathrm{sg}(k) \log p_y$), the expected gradient is $\mathbb{E}[k\,\nabla \log p_y]$, which
    is the reverse-KL gradient for $k_1$ only: that is sampled-token OPD. The exact numbers for
    any logits come from [opd_literate.opd.expected_kl_estimator_gradient][].

    Parameters
    ----------
    student_logp, teacher_logp : torch.Tensor
        Floating tensors of one shape (any ndim): log-probabilities of the sampled tokens.
        The teacher is detached; the student keeps its gradient.
    kind : {"k1", "k2", "k3"}

    Returns
    -------
    torch.Tensor
        The elementwise estimate, with gradient through ``student_logp`` (float32 for
        half-precision inputs).

    Notes
    -----
    verl's ``kl_penalty`` function (used for both ``algorithm.kl_penalty`` and the actor's
    ``kl_loss_type``, default ``"low_var_kl"``) also knows ``"abs"`` ($|d|$) and ``"full"``
    (not implemented there), and a ``"+"`` suffix (``"k1+"``, ``"low_var_kl+"``, ...) that keeps
    the value of the named estimator with the gradient of $k_2$ (a straight-through trick).
    Its k3 is not exactly this one: it clamps $-d$ to $[-20, 20]$ before the exponential and
    the result to $[-10, 10]$; here $k_3$ is unclamped (``+inf`` where the teacher gives the
    token probability 0, its true value).

    References: ``kl_penalty`` and ``kl_penalty_forward`` in ``verl/trainer/ppo/core_algos.py``
    and ``kl_loss_type`` in ``verl/trainer/config/actor/actor.yaml``, verl 0.9.1 (whose
    ``kl_penalty`` ``tests/integration/test_verl.py`` calls; the ``"+"`` suffix works there
    since commit ``7e80ab0``, before which it raised ``NotImplementedError``).

    Examples
    --------
    >>> d = torch.tensor([0.5, -0.5, 0.0])
    >>> [round(v, 4) for v in kl_estimator(d, torch.zeros(3), "k3").tolist()]
    [0.1065, 0.1487, 0.0]
    >>> [round(v, 4) for v in kl_estimator(d, torch.zeros(3), "k2").tolist()]
    [0.125, 0.125, 0.0]
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_ESTIMATORS}, got {kind!r}")
    check_float_tensor("student_logp", student_logp, None)
    check_float_tensor("teacher_logp", teacher_logp, None)
    check_same_shape("student_logp", student_logp, "teacher_logp", teacher_logp)
    dtype = compute_dtype(student_logp, teacher_logp)  # float32 for half precision
    # d = log pi_theta(y) - log pi_T(y)
    d = student_logp.to(dtype) - teacher_logp.detach().to(dtype)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    # k3 = exp(-d) - 1 + d = (q/p - 1) - log(q/p); expm1 keeps it accurate near d = 0.
    return torch.expm1(-d) + d


def expected_kl_estimator_gradient(student_logits, teacher_logits, kind="k1", mode="loss"):
    r"""Exact expected gradient of a k-estimator, by summing over the whole vocabulary.

    For logits $z$ of one or more states (last axis the vocabulary) this returns

    $$
    \text{mode="loss"}:\ \sum_v p_v\, \nabla_z k(d_v), \qquad
    \text{mode="reward"}:\ \sum_v p_v\, k(d_v)\, \nabla_z \log p_v ,
    $$

    the expectation over $y \sim p$ of what one sampled token contributes to the gradient when
    $k$ is backpropagated as a loss, or used as a cost in a REINFORCE surrogate
    $\mathrm{sg}(k)\log p_y$. Both are sums $\sum_v c_v \nabla_z \log p_v = c - p \sum_v c_v$
    (since $\nabla_z \log p_v = e_v - p$) with $c_v = p_v k'(d_v)$ (loss) or $p_v k(d_v)$
    (reward), so the result is exact (no sampling), and can be compared with
    $\nabla \mathrm{KL}(p \,\|\, q)$ and $\nabla \mathrm{KL}(q \,\|\, p)$.

    The weights are formed in log space: $p_v e^{-d_v}$ is computed as $q_v$, never as a
    product whose factor $e^{-d_v}$ overflows (float32 overflows at $-d_v > 88.7$, e.g. for a
    student logit 90 below the others). A token the student cannot sample ($p_v = 0$, a
    ``-inf`` logit) is never drawn, so it contributes nothing. This is a discontinuity for k3:
    as a logit tends to $-\infty$ its token keeps contributing $-q_v \nabla \log p_v$ (as a
    loss) in the limit, and contributes 0 at $-\infty$ itself. Where the student can sample a
    token the teacher cannot ($d_v = +\infty$) the expected gradient is not finite, except for
    k1 and k3 as a loss.

    Parameters
    ----------
    student_logits, teacher_logits : torch.Tensor
        Floating tensors of one shape ``(..., V)``.
    kind : {"k1", "k2", "k3"}
    mode : {"loss", "reward"}

    Returns
    -------
    torch.Tensor
        The expected gradient with respect to ``student_logits``, same shape, one row per
        state (float32 for half-precision inputs).

    Examples
    --------
    k3 as a loss gives the forward-KL gradient $p - q$: with $p = (1/2, 1/2)$ and
    $q = (3/4, 1/4)$, that is $(-1/4, 1/4)$:

    >>> z, zt = torch.zeros(2), torch.log(torch.tensor([0.75, 0.25]))
    >>> expected_kl_estimator_gradient(z, zt, "k3", "loss").tolist()
    [-0.25, 0.25]

    k1 as a loss has zero expected gradient, whatever the teacher:

    >>> z = torch.tensor([0.3, -0.2, 1.0], dtype=torch.float64)
    >>> zt = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    >>> expected_kl_estimator_gradient(z, zt, "k1", "loss").abs().max().item() < 1e-15
    True
    """
    if mode not in ("loss", "reward"):
        raise ValueError(f"mode must be 'loss' or 'reward', got {mode!r}")
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_ESTIMATORS}, got {kind!r}")
    check_float_tensor("student_logits", student_logits, None)
    check_float_tensor("teacher_logits", teacher_logits, None)
    if student_logits.ndim < 1:
        raise ValueError("student_logits must have a vocabulary axis, got a 0-d tensor")
    check_same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    dtype = compute_dtype(student_logits, teacher_logits)
    log_p = F.log_softmax(student_logits.detach().to(dtype), dim=-1)
    log_q = F.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
    # Only the tokens the student can sample enter the expectation: p_v = 0 contributes 0.
    support = log_p > -math.inf
    zeros = torch.zeros_like(log_p)
    p = torch.where(support, log_p.exp(), zeros)
    q = torch.where(support, log_q.exp(), zeros)  # q_v = p_v e^{-d_v}, never formed as a ratio
    d = torch.where(support, log_p - log_q, zeros)  # d_v = log p_v - log q_v
    # c_v: the weight of grad log p_v in sum_v p_v (...), formed without e^{-d} (which
    # overflows in float32 for d < -88) and without 0 * inf where p_v = 0
    if mode == "loss":  # p_v * dk/dd (d_v): k1' = 1, k2' = d, k3' = 1 - e^{-d}
        coefficient = {"k1": p, "k2": p * d, "k3": p - q}[kind]
    else:  # p_v * k(d_v): k3 = e^{-d} - 1 + d
        coefficient = {"k1": p * d, "k2": 0.5 * p * d.square(), "k3": q - p + p * d}[kind]
    coefficient = torch.where(support, coefficient, zeros)
    # grad_z log p_v = e_v - p, so sum_v c_v grad_z log p_v = c - p * sum_v c_v
    return coefficient - p * coefficient.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# Discounted sampled-token OPD and the loss reductions
# ---------------------------------------------------------------------------------------------
def discounted_returns(rewards, mask, gamma):
    r"""Reward-to-go within each response: $G_t = \sum_{k \ge t} \gamma^{k - t} r_k m_k$.

    Computed backwards, $G_t = r_t m_t + \gamma G_{t+1}$, over the position index (a masked-out
    position inside a response contributes no reward but still counts as a step of the
    discount). $\gamma = 0$ returns the rewards themselves; masked-out positions get 0.

    Parameters
    ----------
    rewards : torch.Tensor
        ``(B, T)`` floating.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.
    gamma : float
        Discount in $[0, 1]$.

    Returns
    -------
    torch.Tensor
        ``(B, T)``, detached.

    Examples
    --------
    >>> r = torch.tensor([[1.0, 2.0, 4.0]])
    >>> discounted_returns(r, torch.ones(1, 3), 0.5).tolist()  # 1 + 0.5 * (2 + 0.5 * 4)
    [[3.0, 4.0, 4.0]]
    """
    check_float_tensor("rewards", rewards, 2)
    mask = check_mask(mask, "rewards", tuple(rewards.shape))
    gamma = check_finite_number("gamma", gamma, low=0.0, high=1.0)
    dtype = compute_dtype(rewards)  # float32 for half precision
    return _discounted_returns(rewards.detach().to(dtype), mask, gamma)


def _discounted_returns(rewards, mask, gamma):
    """[opd_literate.opd.discounted_returns][] of detached rewards in their compute dtype."""
    r = select(mask, rewards)
    if gamma == 0.0:
        return r  # G_t = r_t; the recursion would form 0 * (-inf) = NaN after a -inf reward
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])  # (B,); T = 0 gives an empty (B, 0) result
    for t in reversed(range(r.shape[1])):  # T is a response length: a short loop
        running = r[:, t] + gamma * running
        returns[:, t] = running
    return select(mask, returns)


def aggregate_loss(per_token_loss, mask, reduction="token-mean"):
    r"""Reduce a ``(B, T)`` per-token loss to a scalar, the way the RL frameworks do.

    With $\ell_{b,t}$ the per-token loss, $m_{b,t}$ the mask and $n_b = \sum_t m_{b,t}$:

    * ``"token-mean"`` (the lab's; verl's default, DAPO):
      $\sum_{b,t} m_{b,t} \ell_{b,t} / \sum_b n_b$. Every token weighs the same, so long
      responses weigh more.
    * ``"seq-mean-token-sum"``: $\frac{1}{B} \sum_b \sum_t m_{b,t} \ell_{b,t}$. Every
      sequence's summed loss weighs the same; the scale grows with the response length.
    * ``"seq-mean-token-mean"`` (the original GRPO):
      $\frac{1}{B} \sum_b \frac{1}{n_b} \sum_t m_{b,t}\ell_{b,t}$. Every sequence weighs the
      same, so a token of a short response weighs more than one of a long response: a length
      bias.
    * ``"seq-mean-token-sum-norm"`` (Dr. GRPO's constant normaliser):
      $\frac{1}{BT} \sum_{b,t} m_{b,t}\ell_{b,t}$, the ``"seq-mean-token-sum"`` divided by
      $T$, the padded length ``per_token_loss.shape[1]`` (verl's default
      ``loss_scale_factor``). This is verl's meaning since commit ``b8d91ef`` (PR #5417,
      February 2026); before it verl divided the plain sum by $T$, which is ``"token-sum-norm"``
      here.
    * ``"sum"``, and its verl name ``"token-sum"`` (a ``loss_agg_mode`` since commit
      ``4730d46``, August 2026): $\sum_{b,t} m_{b,t}\ell_{b,t}$. No normalization; the gradient
      scale depends on the batch size and lengths.
    * ``"token-sum-norm"`` (verl's ``"seq-mean-token-sum-norm"`` before ``b8d91ef``, e.g. at
      b178a3c; not a verl name): $\frac{1}{T} \sum_{b,t} m_{b,t}\ell_{b,t}$.

    **Which are unbiased.** ``"sum"``, ``"token-sum"``, ``"seq-mean-token-sum"``,
    ``"seq-mean-token-sum-norm"`` and ``"token-sum-norm"`` divide by a constant ($1$, $B$,
    $BT$, $T$), so the expectation of the reduced loss's gradient is
    the constant times the expectation of the summed one: the per-state identities of OPD carry
    over to the batch. ``"token-mean"`` and ``"seq-mean-token-mean"`` divide by token counts
    that depend on the sampled lengths; with responses that can end at ``<eos>`` their
    expected gradient is not a rescaled sequence-KL gradient (see
    [opd_literate.opd.sampled_token_opd_loss][] and the module docstring).

    A sequence with no token ($n_b = 0$) contributes 0 and **counts** in the $1/B$ of the
    sequence means: $B$ stays a fixed normaliser. verl's ``agg_loss`` does otherwise: with no
    ``global_batch_size`` given it divides by the number of sequences with at least one token
    (a fully masked sequence is left out), while its trainer passes the mini-batch size as
    ``global_batch_size``, which counts them. An all-zero mask, or an empty batch, gives 0 for
    every reduction here.

    Parameters
    ----------
    per_token_loss : torch.Tensor
        ``(B, T)`` floating.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.
    reduction : str
        One of ``REDUCTIONS``.

    Returns
    -------
    torch.Tensor
        A scalar (float32 for half-precision inputs).

    Notes
    -----
    References: ``agg_loss`` in ``verl/trainer/ppo/core_algos.py`` (the five
    ``loss_agg_mode`` values and the exclusion of fully masked sequences) and
    ``loss_agg_mode: token-mean`` in ``verl/trainer/config/actor/actor.yaml`` and
    ``global_batch_size=ppo_mini_batch_size`` in ``verl/trainer/ppo/ray_trainer.py``, verl 0.9.1
    (``tests/integration/test_verl.py`` calls its ``agg_loss``). The exclusion entered in commit
    ``4424616d7dfe03cc564866dc5e99dfaba1daba2e`` (October 2025).

    Examples
    --------
    A ragged batch: one response of one token, one of three.

    >>> loss = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    >>> mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    >>> [aggregate_loss(loss, mask, r).item() for r in REDUCTIONS]
    [1.5, 3.0, 2.0, 1.0, 6.0, 6.0, 2.0]

    Tokens: $3 + 3 = 6$ over 4 tokens is 1.5; per sequence $(3 + 3) / 2 = 3$; per sequence
    means $(3 + 1) / 2 = 2$; the sequence mean over the padded length $3 / T = 3 / 3 = 1$; the
    sum is 6; the sum over the padded length $6 / 3 = 2$.
    """
    check_float_tensor("per_token_loss", per_token_loss, 2)
    mask = check_mask(mask, "per_token_loss", tuple(per_token_loss.shape))
    check_reduction(reduction)
    per_token_loss = per_token_loss.to(compute_dtype(per_token_loss))  # float32 for half
    return aggregate(per_token_loss, mask, reduction)


def sampled_token_opd_loss(student_logp, teacher_logp, mask, gamma=0.0, reduction="token-mean"):
    r"""Sampled-token OPD with a discount and a choice of reduction.

    The advantage of token $t$ is the discounted reward-to-go of the OPD rewards,

    $$
    A_t = \sum_{k \ge t} \gamma^{k - t} r_k, \qquad
    r_k = \log \pi_T(y_k \mid s_k) - \log \pi_\theta(y_k \mid s_k),
    $$

    and the per-token loss $-\mathrm{sg}(A_t) \log \pi_\theta(y_t \mid s_t)$ is reduced by
    [opd_literate.opd.aggregate_loss][].

    * $\gamma = 0$ with ``"token-mean"`` is the lab's loss,
      [opd_literate.opd.opd_pg_loss][] of [opd_literate.opd.reverse_kl_rewards][]: a greedy,
      per-state objective that ignores how $y_t$ changes the states after it.
    * $\gamma = 1$ makes $A_t$ the remaining sequence-level log-ratio, and with
      ``reduction="sum"`` the policy gradient is an unbiased estimate of the gradient of the
      *sequence* reverse KL $\mathrm{KL}(\pi_\theta(y \mid x) \,\|\, \pi_T(y \mid x)) =
      \mathbb{E}\big[\sum_t -r_t\big]$, which also counts the cost of steering into states
      where the teacher and the student disagree later. It has more variance.

    The $\gamma = 1$ claim needs a reduction whose normaliser does not depend on the sampled
    lengths: ``"sum"`` ($B$ times the gradient), ``"seq-mean-token-sum"`` (the gradient) or
    ``"seq-mean-token-sum-norm"`` ($1/T$ times it). With ``"token-mean"`` or
    ``"seq-mean-token-mean"`` and responses that can end at ``<eos>``, sampling ``<eos>``
    changes the weight of every token of the response, and the expected gradient is biased: on
    the two-step model of ``tests/opd/test_reductions.py`` it points 7.26 degrees away from the
    true gradient (a rescaled copy would point 0 degrees away). With a fixed length every
    reduction is a constant multiple of ``"sum"`` and all are unbiased up to scale.

    Parameters
    ----------
    student_logp : torch.Tensor
        ``(B, T)`` floating, $\log \pi_\theta(y_t \mid s_t)$ with gradient.
    teacher_logp : torch.Tensor
        ``(B, T)`` floating, $\log \pi_T(y_t \mid s_t)$.
    mask : torch.Tensor
        ``(B, T)`` with values in {0, 1}.
    gamma : float
        Discount in $[0, 1]$.
    reduction : str
        One of ``REDUCTIONS``.

    Returns
    -------
    torch.Tensor
        A scalar loss.

    Examples
    --------
    >>> s = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    >>> t = torch.log(torch.tensor([[0.25, 1.0]]))
    >>> loss = sampled_token_opd_loss(s, t, torch.ones(1, 2), gamma=1.0, reduction="sum")
    >>> loss.backward()
    >>> [round(g, 4) for g in s.grad[0].tolist()]  # -A_t = -(r_1 + r_2), -r_2
    [0.0, -0.6931]
    """
    mask = _check_token_pair(student_logp, teacher_logp, mask)
    check_reduction(reduction)
    gamma = check_finite_number("gamma", gamma, low=0.0, high=1.0)
    dtype = compute_dtype(student_logp, teacher_logp)  # float32 for half precision
    # r_t = log pi_T(y_t|s_t) - log pi_theta(y_t|s_t), detached: the rewards of
    # reverse_kl_rewards (Task 1), here on the mask checked above
    rewards = select(mask, teacher_logp.detach().to(dtype) - student_logp.detach().to(dtype))
    advantages = _discounted_returns(rewards, mask, gamma)
    logp = select(mask, student_logp.to(advantages.dtype))
    # per-token loss: -sg(A_t) * log pi_theta(y_t | s_t)
    return aggregate(-advantages * logp, mask, reduction)
