r"""Many teachers: OPD with a teacher chosen per prompt, and with a mixture of teachers.

A student distilled from several specialists (a mathematics teacher for the mathematics prompts,
a code teacher for the code) sees, on each prompt $x$, the tokens it wrote itself and the
log-probabilities of one or more teachers on them. This module gives the enumerable toys of
[opd_literate.mismatch.toy][] several prompts and several teachers, and computes exactly what
each way of combining the teachers optimises, its gradient, and the mean of the sampled-token
OPD estimate of it.

**The setting.** $P$ prompts, drawn with probabilities $\rho(x)$; on prompt $x$ the student
writes a response $y$ with probability $\pi_x(y) = \prod_t \pi_x(y_t \mid y_{<t})$ (a toy of
[opd_literate.mismatch.toy.make_toy][], independent positions, or of
[opd_literate.mismatch.toy.make_ar_toy][], each token conditioned on the previous one), each
prompt with its own student parameters $\theta_x$ (or one shared student, below). $K$ teachers
$q_{k,x}(y)$ of the same form, and a **source** $r(x) \in \{0, \dots, K - 1\}$ per prompt that
names the teacher meant for it. All three objectives are expectations over $\rho$ of a
per-prompt reverse KL, and for any teacher sequence distribution $q$ that does not depend on
$\theta$ (normalised or not), $\nabla_\theta \mathbb{E}_\pi[\log \pi(y) - \log q(y)]$ is
$\mathbb{E}_\pi[(\log \pi(y) - \log q(y))\, \nabla \log \pi(y)]$ because
$\mathbb{E}_\pi[\nabla \log \pi] = 0$: each exact gradient below is that sum over the enumerated
responses.

**(a) Routed.** $\mathcal{R} = \mathbb{E}_{x \sim \rho}\big[\mathrm{KL}(\pi_x \,\|\,
q_{r(x),x})\big]$: each prompt distilled toward its own teacher.

**(b) A mixture teacher.** With weights $w_k \ge 0$, $\sum_k w_k = 1$ (per prompt, or the same
for all), the teacher is the mixture. *Of sequences*: $\bar q(y) = \sum_k w_k q_k(y)$, whose
next-token conditional is, by Bayes,

$$
\bar q(y_t \mid y_{<t}) = \sum_k w_k(y_{<t})\, q_k(y_t \mid y_{<t}), \qquad
w_k(y_{<t}) = \frac{w_k\, q_k(y_{<t})}{\sum_j w_j\, q_j(y_{<t})},
$$

the weights updated by how likely each teacher was to write the prefix. *Per token*:
$\tilde q(y) = \prod_t \sum_k w_k\, q_k(y_t \mid y_{<t})$ keeps the prior weights at every
position. The two agree on the first token; after it, only where the prefix leaves the
posterior at the prior: the per-token mixture forgets which teacher the prefix came from, so it
is not the sequence mixture, even for teachers with independent positions
($\sum_k w_k \prod_t q_{k,t} \ne \prod_t \sum_k w_k q_{k,t}$ unless the teachers agree) and
for autoregressive ones. The objectives are
$\bar{\mathcal{M}} = \mathbb{E}_\rho[\mathrm{KL}(\pi_x \,\|\, \bar q_x)]$ and
$\tilde{\mathcal{M}} = \mathbb{E}_\rho[\mathrm{KL}(\pi_x \,\|\, \tilde q_x)]$.

**(c) A weighted sum of KLs.** $\mathcal{S} = \mathbb{E}_\rho\big[\sum_k w_k\,
\mathrm{KL}(\pi_x \,\|\, q_{k,x})\big]$. As $\sum_k w_k \log q_k(y)$ is a sum over tokens,

$$
\sum_k w_k\, \mathrm{KL}(\pi \,\|\, q_k) = \mathrm{KL}(\pi \,\|\, G) - \log Z,
$$

$$
G(y) = \frac{1}{Z} \prod_k q_k(y)^{w_k}, \qquad Z = \sum_y \prod_k q_k(y)^{w_k} \le 1,
$$

so its minimiser over all distributions of responses is the normalised geometric mean $G$, a
**product of experts** ($Z \le \sum_y \sum_k w_k q_k(y) = 1$ by the weighted AM-GM
inequality, and $-\log Z$, the minimum, is 0 only when the teachers with a positive weight
agree). For softmax teachers with independent positions $G$ is the teacher with the averaged
logits $\sum_k w_k \phi_{k}$ ([opd_literate.teachers.many_teachers.geometric_mean_logits][]).
For autoregressive teachers $\prod_k q_k(y_t \mid y_{<t})^{w_k} = Z_t(y_{<t})\, G_t(y_t \mid
y_{<t})$ with a per-state normaliser $Z_t \le 1$, and
$\mathcal{S} = \mathbb{E}_\pi[\sum_t \mathrm{KL}(\pi_t \,\|\, G_t)] - \mathbb{E}_\pi[\sum_t \log
Z_t(y_{<t})]$: the second term rewards reaching prefixes where the teachers agree, so the
minimiser is not the per-state geometric mean.

**(b) against (c).** With the posterior over teachers given the whole response,
$p_k(y) = w_k q_k(y) / \bar q(y)$, the difference $\log \bar q(y) - \sum_k w_k \log q_k(y)$
is $\sum_k w_k \log (w_k / p_k(y))$, so

$$
\mathcal{S} - \bar{\mathcal{M}} = \mathbb{E}_\rho\, \mathbb{E}_{y \sim \pi_x}
\big[\mathrm{KL}(w \,\|\, p(y))\big] \ge 0,
$$

$$
\nabla \mathcal{S} - \nabla \bar{\mathcal{M}}
= \mathbb{E}_\rho\, \mathbb{E}_{\pi_x}\big[\mathrm{KL}(w \,\|\, p(y))\, \nabla \log \pi_x(y)\big]
$$

([opd_literate.teachers.many_teachers.mixture_gap][]): the weighted sum exceeds the mixture
by how much a response tells which teacher wrote it, and its gradient pushes the student away
from responses that only one teacher would write. In the limits: the reverse KL to a mixture is
finite wherever *some* teacher gives the response mass (a student may imitate one teacher and
ignore the rest), the weighted sum only where *every* teacher does (the student must stay where
they all agree). For $K = 1$, or teachers that agree, all three are the same.

**Routing is (c) with one-hot weights, and misrouting is (c) with the confusion matrix.** (a)
is $\mathcal{S}$ with $w_{x,k} = [k = r(x)]$. If prompt $x$ is sent to teacher $k$ with
probability $C_{x,k}$ (``misrouting_matrix``: the right teacher with $1 - \varepsilon$, each
other with $\varepsilon / (K - 1)$), the objective in expectation over the routing is
$\mathbb{E}_\rho[\sum_k C_{x,k}\, \mathrm{KL}(\pi_x \,\|\, q_{k,x})]$, a weighted sum of KLs:
the student is pulled toward the geometric mean $q_{r}^{1-\varepsilon} \prod_{k \ne r}
q_k^{\varepsilon / (K-1)}$, not toward the right teacher, and the expected gradient is affine
in $\varepsilon$: $\bar g(\varepsilon) = \bar g(0) + \varepsilon\, (\bar g_{\text{wrong}} -
\bar g(0))$, so the bias it adds is $\varepsilon \lVert \bar g_{\text{wrong}} - \bar g(0)
\rVert$ exactly, with $\bar g_{\text{wrong}}$ the mean when every prompt goes to a uniformly
drawn wrong teacher ([opd_literate.teachers.many_teachers.misrouting_curve][]).

**Sampled-token estimators.** Each objective has a per-token teacher log-probability
$\log q^\star(y_t \mid y_{<t})$ ([opd_literate.teachers.many_teachers.target_token_logprobs][]),
computable from the $K$ teachers' log-probabilities of the sampled tokens:

* routed: $\log q_{k}(y_t \mid y_{<t})$ of the one teacher $k$ the prompt was sent to;
* weighted sum: $\sum_k w_k \log q_k(y_t \mid y_{<t})$ (the average of the $K$ routed rewards);
* per-token mixture: $\log \sum_k w_k\, q_k(y_t \mid y_{<t})$;
* sequence mixture: $\log \sum_k w_k\, q_k(y_{\le t}) - \log \sum_k w_k\, q_k(y_{<t})$, from
  the running sums of each teacher's log-probabilities.

The estimate is $\hat g = \sum_t G_t\, \nabla \log \pi(y_t \mid y_{<t})$ with $d_t = \log
\pi(y_t \mid y_{<t}) - \log q^\star(y_t \mid y_{<t})$ and $G_t = \sum_{k \ge t} \gamma^{k-t}
d_k$ ([opd_literate.mismatch.opd_mismatch.opd_estimate][]). As the $\log q^\star_t$ sum to
$\log q^\star(y)$ and $\mathbb{E}[d_k \nabla \log \pi(y_t \mid y_{<t})] = 0$ for $k < t$, the
estimate with $\gamma = 1$ is unbiased for the gradient of its own objective. With
$\gamma = 0$ it estimates $\mathbb{E}_\pi[\sum_t d_t \nabla \log \pi(y_t \mid y_{<t})]$,
which drops the terms $k > t$: those vanish when $d_k$ depends on $y_k$ alone (routed, weighted
and per-token mixture on independent positions), not otherwise (the sequence mixture's $d_k$
depends on the whole prefix through the posterior weights, and every $d_k$ does on the
autoregressive toy). Routing drawn from $C$ has, by linearity in $\log q$, the mean of the
weighted-sum estimator with weights $C$.

**What verl and slime compute.** verl 0.9.1 routes per sample. Its distillation config holds
one teacher per ``key`` in ``teacher_models``, and ``teacher_key`` (default ``data_source``)
names the sample's field that selects it (``verl/trainer/config/distillation/distillation.yaml``
lines 65 and 113). ``AsyncTeacherLLMServerManager._resolve_teacher_key``
(``verl/experimental/teacher_loop/teacher_manager.py`` lines 100 to 114) returns the sample's
value, raises a ``ValueError`` for a missing or unconfigured one, and with a single teacher
configured sends every sample to it whatever the field says. Adding entries to
``teacher_models`` drops the default entry ``teacher_model``, so the teachers must be named
apart from it: otherwise the one left takes every sample, which the resource-pool check
catches only when the pool is sized for all of them. The routed teacher's per-token
log-probabilities then enter the single-teacher losses of ``verl/trainer/distillation/
losses.py``: with ``loss_mode: k1`` and ``use_policy_gradient: true`` the advantage is
$-d_t$, discount 0 (line 283), in verl's clipped policy loss. So verl, switched to these two
settings and to ``use_task_rewards: false`` (``true`` as composed, which adds the task's PPO
loss), computes on the first mini-batch of an on-policy step (ratio 1, no importance weight)
the routed estimator of (a) with $\gamma = 0$, up to the ``token-mean`` normalisation: its
mean is $\nabla \mathcal{R}$ on independent positions, the per-state gradient on the
autoregressive toy. The config its trainer
composes has ``loss_mode: k3`` and ``use_policy_gradient: false`` instead: the routed teacher's
$k_3$ backpropagated as a loss ([opd_literate.mismatch.task_rewards][], ``k3_loss``), with the
same routing. Either way a mislabelled ``data_source`` among two configured teachers or more
is misrouting or a ``ValueError``, never a fallback to a default teacher. verl 0.9.1 has no
mixture teacher and no weighted sum of KLs. slime
at commit ``624b824`` (2026-08-21) has one teacher: one ``--rm-url`` that
``slime/rollout/on_policy_distillation.py`` (line 27) posts every sample to, or one
``--opd-teacher-load`` checkpoint; ``apply_opd_kl_to_advantages``
(``slime/backends/megatron_utils/loss.py`` lines 663 to 701) adds $-\lambda d_t$ to each
token's advantage. It carries each sample's ``source_names`` to training, "useful for ...
future per-source routing such as OPD teacher selection" (``docs/en/get_started/usage.md`` line
194), but no routing, mixture or weighted sum exists in it; a user's own reward function
(``--custom-rm-path``) could route by source, which is (a). Pull requests #1868 and #1869
(commit ``0e76601``, 2026-04-02, not merged into the main branch by ``624b824``) add such a
function, ``reward_func_route_by_domain``, which posts each sample to the teacher named by its
``metadata["domain"]``: (a) again.
"""

from __future__ import annotations

import math

import numpy as np

from .._numerics import (
    check_finite_number,
    check_positive_int,
    check_real_array,
    check_sequence,
)
from ..mismatch.opd_mismatch import opd_estimate
from ..mismatch.toy import ar_toy_from_logits, log_softmax, response_mask, toy_from_logits

__all__ = [
    "KINDS",
    "make_prompts",
    "prompts_from_logits",
    "routing_weights",
    "misrouting_matrix",
    "target_token_logprobs",
    "objective",
    "expected_estimate",
    "mixture_gap",
    "geometric_mean_logits",
    "bias_table",
    "misrouting_curve",
]

KINDS = ("routed", "weighted_kl", "token_mixture", "sequence_mixture")
r"""The objectives: (a) routed, (c) the weighted sum of KLs, (b) the per-token and the
sequence mixture."""

_WEIGHT_ATOL = 1e-9  # a row of weights must sum to 1 within this (weights typed by hand)


# ---------------------------------------------------------------------------------------------
# Prompts, teachers and routes
# ---------------------------------------------------------------------------------------------
def make_prompts(P=3, K=3, T=3, V=3, *, autoregressive=False, eos=True, seed=0,
                 teacher_scale=1.0, prompt_probs=None, routes=None, shared_student=False):
    r"""$P$ enumerable prompts, $K$ teachers, a prompt distribution and a source per prompt.

    The draws, in this order, from ``numpy.random.default_rng(seed)``: the student's logits
    $\theta \sim \mathcal{N}(0, 0.7^2)$ of shape ``(P,) + shape`` (one student of ``shape``
    with ``shared_student``), then the teachers' $\phi \sim \mathcal{N}(0,
    \text{teacher\_scale}^2)$ of shape ``(P, K) + shape``; ``shape`` is ``(T, V)``, or
    ``(T, V + 1, V)`` with ``autoregressive`` (read as in
    [opd_literate.mismatch.toy.make_ar_toy][]). By default $\rho$ is uniform and prompt $x$
    comes from source $x \bmod K$.

    Examples
    --------
    >>> prompts = make_prompts(P=2, K=2, T=2, V=2)
    >>> prompts["routes"].tolist(), prompts["prompt_probs"].tolist()
    ([0, 1], [0.5, 0.5])
    >>> prompts["toys"][0]["logp_teachers"].shape  # (K, M, T)
    (2, 4, 2)
    """
    P, K = check_positive_int("P", P), check_positive_int("K", K)
    if not isinstance(autoregressive, bool):
        raise TypeError(f"autoregressive must be True or False, got {autoregressive!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    T, V = check_positive_int("T", T), check_positive_int("V", V)
    scale = check_finite_number("teacher_scale", teacher_scale, low=0.0)
    shape = (T, V + 1, V) if autoregressive else (T, V)
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 0.7, size=shape if shared_student else (P,) + shape)
    phi = rng.normal(0.0, 1.0, size=(P, K) + shape) * scale
    if prompt_probs is None:
        prompt_probs = np.full(P, 1.0 / P)
    if routes is None:
        routes = np.arange(P) % K
    return prompts_from_logits(theta, phi, prompt_probs, routes, eos=eos,
                               shared_student=shared_student)


def prompts_from_logits(theta, phi, prompt_probs, routes, *, eos=True, shared_student=False):
    r"""The prompts of ``make_prompts`` with every logit given by hand.

    Parameters
    ----------
    theta : array_like
        The student's logits: ``(P,) + shape``, one student per prompt, or ``shape`` with
        ``shared_student`` (the same student on every prompt: a student that cannot tell the
        prompts apart).
    phi : array_like
        The teachers' logits, ``(P, K) + shape``: teacher $k$ on prompt $x$. ``shape`` is
        ``(T, V)`` (independent positions) or ``(T, V + 1, V)`` (autoregressive, with ``eos``).
    prompt_probs : array_like
        $\rho$, ``(P,)``, non-negative, summing to 1.
    routes : array_like
        $r(x)$, ``(P,)`` integers in ``[0, K)``.
    eos : bool
        For the autoregressive toy: whether token ``V - 1`` is ``<eos>``
        ([opd_literate.mismatch.toy.make_ar_toy][]); unused with independent positions.

    Returns
    -------
    dict
        ``toys`` (one toy a prompt, on-policy: the sampler is the student, with
        ``logp_teachers`` ``(K, M, T)``, 0 on the padding), ``theta`` ``(P,) + shape``,
        ``phi``, ``prompt_probs``, ``routes``, ``P``, ``K``, ``shared_student``,
        ``autoregressive``.

    Examples
    --------
    One prompt, one position, two tokens: a uniform student, and teachers $(0.8, 0.2)$ and
    $(0.2, 0.8)$ (the toys of the other examples):

    >>> prompts = prompts_from_logits(np.log([[[0.5, 0.5]]]),
    ...                               np.log([[[[0.8, 0.2]], [[0.2, 0.8]]]]), [1.0], [0])
    >>> np.exp(prompts["toys"][0]["logp_teachers"][:, :, 0]).round(12).tolist()
    [[0.8, 0.2], [0.2, 0.8]]
    """
    if not isinstance(shared_student, bool):
        raise TypeError(f"shared_student must be True or False, got {shared_student!r}")
    phi = check_real_array("phi", phi, ndim=None)
    if phi.ndim not in (4, 5) or 0 in phi.shape:
        raise ValueError(f"phi must have shape (P, K, T, V) or (P, K, T, V + 1, V), got "
                         f"{phi.shape}")
    P, K, shape = phi.shape[0], phi.shape[1], phi.shape[2:]
    autoregressive = phi.ndim == 5
    if autoregressive and shape[1] != shape[2] + 1:
        raise ValueError(f"phi of an autoregressive toy must have shape (P, K, T, V + 1, V), got "
                         f"{phi.shape}")
    theta = check_real_array("theta", theta, ndim=None)
    expected = shape if shared_student else (P,) + shape
    if theta.shape != expected:
        raise ValueError(f"theta must have shape {expected} (phi is {phi.shape}, "
                         f"shared_student={shared_student}), got {theta.shape}")
    if shared_student:
        theta = np.broadcast_to(theta, (P,) + shape).copy()
    rho = check_real_array("prompt_probs", prompt_probs, ndim=1)
    if rho.shape != (P,) or (rho < 0).any() or abs(rho.sum() - 1.0) > _WEIGHT_ATOL:
        raise ValueError(f"prompt_probs must be {P} non-negative numbers summing to 1, got "
                         f"{rho.tolist()}")
    routes = np.asarray(routes)
    if routes.shape != (P,) or routes.dtype.kind not in "iu" or (routes < 0).any() \
            or (routes >= K).any():
        raise ValueError(f"routes must be {P} integers in [0, {K}) (one source a prompt), got "
                         f"{routes.tolist()}")
    toys = []
    for x in range(P):
        if autoregressive:
            toy = ar_toy_from_logits(theta[x], theta[x], eos=eos)
        else:
            toy = toy_from_logits(theta[x], theta[x])
        toys.append(dict(toy, logp_teachers=np.stack([_teacher_logp(toy, phi[x, k])
                                                      for k in range(K)])))
    return dict(toys=toys, theta=theta, phi=phi, prompt_probs=rho, routes=routes.astype(np.int64),
                P=P, K=K, shared_student=shared_student, autoregressive=autoregressive)


def _teacher_logp(toy, phi):
    """(M, T) log q(y_t | y_<t) of one teacher on a toy's responses; 0 on the padding."""
    with np.errstate(over="ignore", invalid="ignore"):
        log_q = log_softmax(phi)
    if not np.isfinite(log_q).all():
        raise ValueError("a teacher gives a token probability 0 (its logits differ by more than "
                         "float64 can represent); use smaller logits")
    positions = np.arange(toy["T"])[None, :]
    if "prev" in toy:
        return np.where(response_mask(toy) > 0, log_q[positions, toy["prev"], toy["Y"]], 0.0)
    return log_q[positions, toy["Y"]]


def routing_weights(prompts):
    r"""The one-hot ``(P, K)`` weights $[k = r(x)]$ of the routes: (a) as a weighted sum.

    Examples
    --------
    >>> routing_weights(make_prompts(P=3, K=2, T=1, V=2)).tolist()
    [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    """
    _check_prompts(prompts)
    return np.eye(prompts["K"])[prompts["routes"]]


def misrouting_matrix(prompts, epsilon):
    r"""$C_{x,k}$: the right teacher with probability $1 - \varepsilon$, each of the $K - 1$
    others with $\varepsilon / (K - 1)$.

    Examples
    --------
    >>> misrouting_matrix(make_prompts(P=2, K=3, T=1, V=2), 0.3).round(12).tolist()
    [[0.7, 0.15, 0.15], [0.15, 0.7, 0.15]]
    """
    _check_prompts(prompts)
    epsilon = check_finite_number("epsilon", epsilon, low=0.0, high=1.0)
    K = prompts["K"]
    if K == 1:
        if epsilon > 0:
            raise ValueError(f"epsilon must be 0 with K = 1 (there is no wrong teacher), got "
                             f"{epsilon!r}")
        return routing_weights(prompts)
    right = routing_weights(prompts)
    return (1.0 - epsilon) * right + epsilon / (K - 1) * (1.0 - right)


# ---------------------------------------------------------------------------------------------
# The objectives and their exact gradients
# ---------------------------------------------------------------------------------------------
def target_token_logprobs(prompts, kind, weights=None):
    r"""$\log q^\star(y_t \mid y_{<t})$ of objective ``kind``: one ``(M, T)`` array a prompt.

    ``routed``: the routed teacher's (``weights`` must be None). ``weighted_kl``:
    $\sum_k w_k \log q_k$. ``token_mixture``: $\log \sum_k w_k q_k(y_t \mid y_{<t})$.
    ``sequence_mixture``: $\log \sum_k w_k q_k(y_{\le t}) - \log \sum_k w_k q_k(y_{<t})$. 0 on
    the padding. ``weights``: ``(K,)`` (the same for every prompt) or ``(P, K)``, rows
    non-negative summing to 1; uniform by default.

    Examples
    --------
    Two positions, two tokens; teacher 0 writes token 0 with probability 0.9 at each position,
    teacher 1 token 1. For the response $(0, 0)$ the per-token mixture says $(0.5, 0.5)$; the
    sequence mixture $0.5$, then $0.9 \cdot 0.9 + 0.1 \cdot 0.1 = 0.82$: after a first token 0
    the posterior gives teacher 0 the weight $0.45 / 0.5 = 0.9$.

    >>> hi, lo = np.log([0.9, 0.1]), np.log([0.1, 0.9])
    >>> prompts = prompts_from_logits(np.zeros((1, 2, 2)), [[[hi, hi], [lo, lo]]], [1.0], [0])
    >>> [np.exp(target_token_logprobs(prompts, kind)[0][0]).round(12).tolist()
    ...  for kind in ("token_mixture", "sequence_mixture")]
    [[0.5, 0.5], [0.5, 0.82]]
    """
    _check_prompts(prompts)
    kind = _check_kind(kind)
    if kind == "routed":
        if weights is not None:
            raise ValueError("routed takes no weights: it uses prompts['routes'] (a routing "
                             "drawn from a matrix C is weighted_kl with weights C)")
        weights = routing_weights(prompts)
        kind = "weighted_kl"
    w = _check_weights(prompts, weights)
    return [_target(toy, w[x], kind) for x, toy in enumerate(prompts["toys"])]


def _target(toy, w, kind):
    """(M, T) per-token log q* of one prompt's toy, weights w (K,) already checked."""
    log_q = toy["logp_teachers"]  # (K, M, T)
    mask = response_mask(toy) > 0  # (M, T)
    if kind == "weighted_kl":
        # sum_k w_k log q_k; a zero weight contributes 0 (never 0 * -inf: log q is finite)
        return np.einsum("k,kmt->mt", w, log_q)
    with np.errstate(divide="ignore"):
        log_w = np.log(w)[:, None, None]  # -inf for a weight 0: that teacher drops out
    if kind == "token_mixture":
        return np.where(mask, _logsumexp(log_w + log_q, axis=0), 0.0)
    # sequence mixture: log qbar(y_<=t) - log qbar(y_<t), log qbar(prefix) = LSE_k(log w + cum)
    upto = np.cumsum(log_q, axis=2)  # (K, M, T) log q_k(y_<=t); the padding adds 0
    before = upto - log_q            # log q_k(y_<t)
    logq_star = _logsumexp(log_w + upto, axis=0) - _logsumexp(log_w + before, axis=0)
    return np.where(mask, logq_star, 0.0)


def objective(prompts, kind, weights=None):
    r"""The exact value and gradient of objective ``kind`` (``KINDS``).

    The value is $\mathbb{E}_{x \sim \rho} \mathbb{E}_{y \sim \pi_x}[\log \pi_x(y) - \log
    q^\star_x(y)]$ with $\log q^\star_x(y) = \sum_t \log q^\star(y_t \mid y_{<t})$ of
    [opd_literate.teachers.many_teachers.target_token_logprobs][] (for ``weighted_kl``,
    $\sum_k w_k \mathrm{KL}(\pi_x \,\|\, q_{k,x})$), the gradient
    $\mathbb{E}_\rho \mathbb{E}_{\pi_x}[(\log \pi_x(y) - \log q^\star_x(y))\, \nabla \log
    \pi_x(y)]$ summed over the responses.

    Returns
    -------
    dict
        ``value`` (float) and ``grad``: ``(P,) + shape``, row $x$ the gradient with respect to
        $\theta_x$, or ``shape`` with a shared student (the sum over the prompts).

    Examples
    --------
    A uniform student, teachers $(0.8, 0.2)$ and $(0.2, 0.8)$ with weights $(0.5, 0.5)$: the
    mixture is uniform, so its KL is 0, while the weighted sum is $\mathrm{KL}(u \,\|\, (0.8,
    0.2))$, that is $\tfrac12 \log \tfrac{0.5}{0.8} + \tfrac12 \log \tfrac{0.5}{0.2} = \log
    1.25$; the uniform student is the minimiser of both (the geometric mean of the teachers
    is uniform):

    >>> prompts = prompts_from_logits(np.log([[[0.5, 0.5]]]),
    ...                               np.log([[[[0.8, 0.2]], [[0.2, 0.8]]]]), [1.0], [0])
    >>> [round(objective(prompts, kind)["value"], 6) for kind in KINDS[1:]]
    [0.223144, 0.0, 0.0]
    >>> round(math.log(1.25), 6), float(np.abs(objective(prompts, "weighted_kl")["grad"]).max())
    (0.223144, 0.0)
    """
    targets = target_token_logprobs(prompts, kind, weights)
    value, grads = 0.0, []
    for rho, toy, logq_star in zip(prompts["prompt_probs"], prompts["toys"], targets):
        log_ratio = (toy["logp_train"] - logq_star).sum(axis=1)  # (M,) log pi(y) - log q*(y)
        pi = toy["p_train"]
        value += float(rho * (pi @ log_ratio))
        # grad E_pi[f] = E_pi[f grad log pi] (f does not depend on theta; E_pi[score] = 0)
        grads.append(rho * np.einsum("m,m,m...->...", pi, log_ratio, toy["score"]))
    return dict(value=value, grad=_total(prompts, grads))


def expected_estimate(prompts, kind, weights=None, gamma=0.0):
    r"""Exact mean of the sampled-token OPD estimate with the per-token target of ``kind``.

    A prompt $x \sim \rho$, a response $y \sim \pi_x$ (on-policy), and
    $\hat g = \sum_t G_t \nabla \log \pi_x(y_t \mid y_{<t})$ with $G_t = \sum_{k \ge t}
    \gamma^{k - t} d_k$, $d_t = \log \pi_x(y_t \mid y_{<t}) - \log q^\star(y_t \mid y_{<t})$
    (minus the OPD reward, [opd_literate.mismatch.opd_mismatch.opd_estimate][]). For
    ``routed``, ``weights`` are the routing probabilities $C$ ``(P, K)`` (default: the routes);
    the teacher is drawn from row $C_x$, so the mean is $\sum_k C_{x,k}$ times each teacher's.

    Returns
    -------
    numpy.ndarray
        The shape of ``objective(prompts, kind, weights)["grad"]``.

    Examples
    --------
    With $\gamma = 1$ every estimate is unbiased for its own objective:

    >>> prompts = make_prompts(T=2, V=3, autoregressive=True)
    >>> g = expected_estimate(prompts, "sequence_mixture", gamma=1.0)
    >>> bool(np.allclose(g, objective(prompts, "sequence_mixture")["grad"], rtol=0, atol=1e-12))
    True

    and misrouting half of the prompts of two teachers makes the routed estimate the weighted
    sum's with weights $(0.5, 0.5)$:

    >>> two = make_prompts(P=2, K=2, T=2, V=2)
    >>> half = misrouting_matrix(two, 0.5)
    >>> bool(np.allclose(expected_estimate(two, "routed", half),
    ...                  expected_estimate(two, "weighted_kl", [0.5, 0.5]), rtol=0, atol=1e-12))
    True
    """
    _check_prompts(prompts)
    kind = _check_kind(kind)
    gamma = check_finite_number("gamma", gamma, low=0.0, high=1.0)
    if kind == "routed":
        routing = routing_weights(prompts) if weights is None else _check_weights(prompts, weights)
        grads = []
        for x, (rho, toy) in enumerate(zip(prompts["prompt_probs"], prompts["toys"])):
            # the framework sends prompt x to teacher k with probability C[x, k]
            per_teacher = [_mean_estimate(toy, toy["logp_teachers"][k], gamma)
                           for k in range(prompts["K"])]
            grads.append(rho * np.einsum("k,k...->...", routing[x], np.stack(per_teacher)))
        return _total(prompts, grads)
    targets = target_token_logprobs(prompts, kind, weights)
    grads = [rho * _mean_estimate(toy, target, gamma)
             for rho, toy, target in zip(prompts["prompt_probs"], prompts["toys"], targets)]
    return _total(prompts, grads)


def _mean_estimate(toy, logq_star, gamma):
    """sum_y pi(y) g(y) of opd_estimate with the trainer's log-probs and no weight."""
    estimate = opd_estimate(dict(toy, logp_teacher=logq_star), "trainer", "none", gamma=gamma)
    # estimate[m] has the parameters' shape: row t is token t's part (toy.estimator_moments)
    return np.einsum("m,m...->...", toy["p_train"], estimate)


def mixture_gap(prompts, weights=None):
    r"""$\mathcal{S} - \bar{\mathcal{M}} = \mathbb{E}_\rho \mathbb{E}_{\pi_x}[\mathrm{KL}(w
    \,\|\, p(y))]$, the weighted sum of KLs minus the KL to the sequence mixture, from the
    posterior $p_k(y) = w_k q_k(y) / \bar q(y)$; and its gradient.

    Examples
    --------
    The toy of ``objective``: after token 0 the posterior is $(0.8, 0.2)$, so the gap is
    $\mathrm{KL}((0.5, 0.5) \,\|\, (0.8, 0.2)) = \log 1.25$, the weighted sum minus 0:

    >>> prompts = prompts_from_logits(np.log([[[0.5, 0.5]]]),
    ...                               np.log([[[[0.8, 0.2]], [[0.2, 0.8]]]]), [1.0], [0])
    >>> round(mixture_gap(prompts)["value"], 6)
    0.223144
    """
    _check_prompts(prompts)
    w = _check_weights(prompts, weights)
    value, grads = 0.0, []
    for x, (rho, toy) in enumerate(zip(prompts["prompt_probs"], prompts["toys"])):
        log_q = toy["logp_teachers"].sum(axis=2)  # (K, M) log q_k(y)
        with np.errstate(divide="ignore"):
            log_w = np.log(w[x])[:, None]
        log_post = log_w + log_q - _logsumexp(log_w + log_q, axis=0)  # (K, M) log p_k(y)
        # KL(w || p(y)) = sum_k w_k (log w_k - log p_k(y)), a weight 0 contributing 0
        inside = np.where(w[x][:, None] > 0, log_w - log_post, 0.0)
        kl = np.einsum("k,km->m", w[x], inside)  # (M,)
        pi = toy["p_train"]
        value += float(rho * (pi @ kl))
        grads.append(rho * np.einsum("m,m,m...->...", pi, kl, toy["score"]))
    return dict(value=value, grad=_total(prompts, grads))


def geometric_mean_logits(prompts, weights=None):
    r"""$\sum_k w_{x,k} \phi_{k,x}$: logits of the normalised geometric mean, row by row.

    For softmax teachers, $\prod_k \mathrm{softmax}(\phi_k)^{w_k} \propto \mathrm{softmax}(\sum_k
    w_k \phi_k)$ in each row. With independent positions this is the minimiser $G$ of the
    weighted sum of KLs, and so (weights $C$) the point a misrouted student converges to; on the
    autoregressive toy it zeroes the per-state gradient (the mean of the $\gamma = 0$ estimate)
    but not the gradient of $\mathcal{S}$, which also rewards the prefixes where the teachers
    agree (module docstring).

    Returns
    -------
    numpy.ndarray
        ``(P,) + shape``: a student per prompt (a shared student is one of them only where
        the rows are equal: the same weights and teachers on every prompt).

    Examples
    --------
    >>> prompts = make_prompts(P=1, K=2, T=2, V=3)
    >>> at_g = prompts_from_logits(geometric_mean_logits(prompts, [0.7, 0.3]), prompts["phi"],
    ...                            [1.0], [0])
    >>> float(np.abs(objective(at_g, "weighted_kl", [0.7, 0.3])["grad"]).max()) < 1e-15
    True
    """
    _check_prompts(prompts)
    w = _check_weights(prompts, weights)
    return np.einsum("xk,xk...->x...", w, prompts["phi"])


# ---------------------------------------------------------------------------------------------
# Tables: every estimator against every objective; the misrouting curve
# ---------------------------------------------------------------------------------------------
def bias_table(prompts, weights=None, gammas=(0.0, 1.0)):
    r"""The exact relative bias of every estimator against every objective.

    Each row holds ``estimator`` and ``objective`` (two of ``KINDS``), ``gamma`` and
    ``rel_bias`` $= \lVert \mathbb{E}[\hat g] - \nabla \mathcal{O} \rVert / \lVert \nabla
    \mathcal{O} \rVert$, with the mixtures' and the weighted sum's ``weights`` (uniform by
    default) and the routed estimator routed by ``prompts["routes"]``.

    Examples
    --------
    On independent positions, discount 0 is unbiased for (a) and (c), not for the sequence
    mixture:

    >>> rows = bias_table(make_prompts(T=2, V=3), gammas=[0.0])
    >>> [(r["estimator"], r["rel_bias"] < 1e-12) for r in rows if r["objective"] == r["estimator"]]
    [('routed', True), ('weighted_kl', True), ('token_mixture', True), ('sequence_mixture', False)]
    """
    _check_prompts(prompts)
    gammas = check_sequence("gammas", gammas)
    targets = {kind: objective(prompts, kind, None if kind == "routed" else weights)["grad"]
               for kind in KINDS}
    rows = []
    for gamma in gammas:
        for estimator in KINDS:
            mean = expected_estimate(prompts, estimator,
                                     None if estimator == "routed" else weights, gamma)
            for kind in KINDS:
                rows.append(dict(estimator=estimator, objective=kind, gamma=float(gamma),
                                 rel_bias=_relative(mean - targets[kind], targets[kind])))
    return rows


def misrouting_curve(prompts, epsilons, gamma=0.0):
    r"""The exact effect of sending a fraction $\varepsilon$ of the prompts to a wrong teacher.

    Each row holds ``epsilon`` and

    * ``rel_bias``: $\lVert \bar g(\varepsilon) - \nabla \mathcal{R} \rVert / \lVert \nabla
      \mathcal{R} \rVert$, the routed estimate with discount ``gamma`` against the gradient of
      (a) (at $\varepsilon = 0$ the bias of the discount alone: 0 with $\gamma = 1$, or on
      independent positions);
    * ``rel_misrouting``: $\lVert \bar g(\varepsilon) - \bar g(0) \rVert / \lVert \bar g(0)
      \rVert$, the part misrouting adds, exactly $\varepsilon$ times its value at
      $\varepsilon = 1$;
    * ``fixed_point_kl``: $\mathbb{E}_\rho[\mathrm{KL}(G_{\varepsilon,x} \,\|\, q_{r(x),x})]$,
      the routed objective at the student $\sum_k C_{x,k} \phi_{k,x}$ that the misrouted
      estimate drives to (with independent positions; on the autoregressive toy, the zero of
      the $\gamma = 0$ estimate).

    Examples
    --------
    The part misrouting adds doubles with $\varepsilon$; the fixed point moves away from the
    right teachers:

    >>> rows = misrouting_curve(make_prompts(T=2, V=3), [0.0, 0.1, 0.2])
    >>> rows[0]["rel_misrouting"], round(rows[2]["rel_misrouting"] / rows[1]["rel_misrouting"], 12)
    (0.0, 2.0)
    >>> rows[0]["fixed_point_kl"] < 1e-12 < rows[1]["fixed_point_kl"] < rows[2]["fixed_point_kl"]
    True
    """
    _check_prompts(prompts)
    epsilons = check_sequence("epsilons", epsilons)
    gamma = check_finite_number("gamma", gamma, low=0.0, high=1.0)
    target = objective(prompts, "routed")["grad"]
    right = expected_estimate(prompts, "routed", gamma=gamma)
    rows = []
    for epsilon in epsilons:
        routing = misrouting_matrix(prompts, epsilon)
        mean = expected_estimate(prompts, "routed", routing, gamma)
        fixed = prompts_from_logits(geometric_mean_logits(prompts, routing), prompts["phi"],
                                    prompts["prompt_probs"], prompts["routes"],
                                    eos=_eos(prompts))
        rows.append(dict(epsilon=float(epsilon), gamma=gamma,
                         rel_bias=_relative(mean - target, target),
                         rel_misrouting=_relative(mean - right, right),
                         fixed_point_kl=objective(fixed, "routed")["value"]))
    return rows


# ---------------------------------------------------------------------------------------------
# Checks and small helpers
# ---------------------------------------------------------------------------------------------
def _logsumexp(a, axis):
    """log sum exp over ``axis``, shifted by the largest entry; all -inf gives -inf."""
    top = np.max(a, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(top, axis=axis) + np.log(np.exp(a - top).sum(axis=axis))


def _total(prompts, grads):
    """(P,) + shape: the gradient of each prompt's own student; its sum if they share one."""
    stacked = np.stack(grads)
    return stacked.sum(axis=0) if prompts["shared_student"] else stacked


def _relative(error, target):
    norm = float(np.linalg.norm(target))
    size = float(np.linalg.norm(error))
    if norm > 0:
        return size / norm
    return 0.0 if size == 0 else math.inf


def _eos(prompts):
    toy = prompts["toys"][0]
    return toy.get("eos") is not None


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind


def _check_prompts(prompts):
    keys = ("toys", "phi", "prompt_probs", "routes", "P", "K", "shared_student")
    if not isinstance(prompts, dict) or not set(keys) <= set(prompts):
        raise TypeError("prompts must be the dict of make_prompts or prompts_from_logits, got "
                        f"{type(prompts).__name__}")


def _check_weights(prompts, weights):
    """(P, K) rows of non-negative weights summing to 1; (K,) is the same row for every prompt,
    None the uniform one."""
    P, K = prompts["P"], prompts["K"]
    if weights is None:
        return np.full((P, K), 1.0 / K)
    w = check_real_array("weights", weights, ndim=None)
    if w.shape == (K,):
        w = np.tile(w, (P, 1))  # documented: one row of weights for every prompt
    if w.shape != (P, K):
        raise ValueError(f"weights must have shape ({K},) or ({P}, {K}), got {w.shape}")
    if (w < 0).any() or (np.abs(w.sum(axis=1) - 1.0) > _WEIGHT_ATOL).any():
        raise ValueError(f"each row of weights must be non-negative and sum to 1, got "
                         f"{w.tolist()}")
    return w
