r"""Several teachers in torch: the per-token teacher log-probability of each objective on a batch.

The torch form of [opd_literate.teachers.many_teachers.target_token_logprobs][], for a trainer's
``(B, T)`` batch: from the $K$ teachers' log-probabilities of the tokens the student wrote,
``teacher_logp`` of shape ``(K, B, T)``, the target $\log q^\star(y_t \mid y_{<t})$ of one of
the objectives of that module, which then replaces the one teacher's log-probability in any
sampled-token OPD loss (the reward $\log q^\star - \log \pi_\theta$ of
[opd_literate.opd.reverse_kl_rewards][], its discounted return, or $k_3$ as a loss):

* ``"routed"``: $\log q_{r(b)}$, the teacher that ``routes[b]`` names for response $b$ (verl's
  routing by ``data_source``);
* ``"weighted_kl"``: $\sum_k w_{b,k} \log q_k$, whose discount-1 estimate is that of
  $\sum_k w_k\, \mathrm{KL}(\pi \,\|\, q_k)$;
* ``"token_mixture"``: $\log \sum_k w_{b,k}\, q_k(y_t \mid y_{<t})$, the prior weights at
  every position;
* ``"sequence_mixture"``: $\log \sum_k w_{b,k}\, q_k(y_{\le t}) - \log \sum_k w_{b,k}\,
  q_k(y_{< t})$, the weights updated by Bayes along the response.

Which estimate is unbiased for which objective, at which discount, is the numpy module's
``bias_table``; ``tests/teachers/test_teacher_targets.py`` checks these targets against its
``target_token_logprobs`` on every enumerated response of its toys.

Conventions (those of [opd_literate.opd][]): ``mask`` is ``(B, T)`` with a response's valid
tokens first; the targets are 0 where ``mask`` is 0, and a teacher log-probability there (NaN,
infinite, anything) never reaches a valid position: the padding is selected away before the
running sums. Half-precision inputs are computed in float32. The sequence mixture's running
sums hold each teacher's drift from the teachers' mean, not its whole log-probability of the
prefix: in float32, on responses of 8,192 tokens with log-probabilities drawn in $[-4, 0]$,
its targets are within $10^{-4}$ of float64's at every token (about $10^{-3}$ with the plain
running sums). The targets carry no gradient
(a teacher's log-probabilities are constants of the loss).
"""

from __future__ import annotations

import torch

from .._numerics import check_float_tensor, check_mask, compute_dtype

__all__ = ["TARGET_KINDS", "teacher_target_logprobs"]

TARGET_KINDS = ("routed", "weighted_kl", "token_mixture", "sequence_mixture")
"""The objectives of [opd_literate.teachers.many_teachers.KINDS][], in its order."""


def _check_weights(weights, K, B, dtype, device):
    """(B, K) weights: uniform, a (K,) row for every response, or one row a response."""
    if weights is None:
        return torch.full((B, K), 1.0 / K, dtype=dtype, device=device)
    check_float_tensor("weights", weights, None)
    if tuple(weights.shape) == (K,):
        weights = weights[None, :].expand(B, K)
    elif tuple(weights.shape) != (B, K):
        raise ValueError(f"weights must have shape (K,) = {(K,)} or (B, K) = {(B, K)}, got "
                         f"{tuple(weights.shape)}")
    # a row rounded to a half type sums to 1 only within its rounding (0.2, 0.3, 0.5 in
    # bfloat16 sum to 1.001): allowed, and divided by its sum
    tolerance = max(1e-6, K * torch.finfo(weights.dtype).eps)
    weights = weights.detach().to(dtype)
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise ValueError("weights must be finite and non-negative")
    sums = weights.sum(-1)
    if not bool(((sums - 1).abs() <= tolerance).all()):
        raise ValueError(f"each row of weights must sum to 1 (within {tolerance:.3g}), got sums "
                         f"{sums.tolist()[:4]}{' ...' if B > 4 else ''}")
    return weights / sums[:, None]


def teacher_target_logprobs(teacher_logp, mask, kind, weights=None, routes=None):
    r"""The ``(B, T)`` target $\log q^\star(y_t \mid y_{<t})$ of objective ``kind``.

    Parameters
    ----------
    teacher_logp : torch.Tensor
        ``(K, B, T)``: teacher $k$'s log-probability of the token the student wrote at
        position $t$ of response $b$ (finite, at most 0, where ``mask`` is 1).
    mask : torch.Tensor
        ``(B, T)``, 1 on the response's tokens.
    kind : {"routed", "weighted_kl", "token_mixture", "sequence_mixture"}
    weights : torch.Tensor, optional
        ``(K,)`` or ``(B, K)``, each row non-negative and summing to 1 within the rounding of
        its dtype (then divided by its sum); uniform by default. Not with ``"routed"``.
    routes : torch.Tensor, optional
        ``(B,)`` integers in ``[0, K)``: the teacher of each response; ``"routed"`` only.

    Returns
    -------
    torch.Tensor
        ``(B, T)``, detached, 0 where ``mask`` is 0 (float32 for half-precision inputs).

    Examples
    --------
    Two teachers that write token 0 with probability 0.9 and 0.1, one response of two tokens
    0: the per-token mixture gives 0.5 at both positions; the sequence mixture 0.5, then
    $(0.9^2 + 0.1^2) / (0.9 + 0.1) = 0.82$, as the first token already says teacher 0 wrote it.

    >>> logp = torch.log(torch.tensor([[[0.9, 0.9]], [[0.1, 0.1]]], dtype=torch.float64))
    >>> mask = torch.ones(1, 2)
    >>> for kind in ("token_mixture", "sequence_mixture"):
    ...     print(kind, teacher_target_logprobs(logp, mask, kind).exp().round(decimals=6))
    token_mixture tensor([[0.5000, 0.5000]], dtype=torch.float64)
    sequence_mixture tensor([[0.5000, 0.8200]], dtype=torch.float64)
    >>> teacher_target_logprobs(logp, mask, "routed", routes=torch.tensor([1])).exp()
    tensor([[0.1000, 0.1000]], dtype=torch.float64)
    """
    check_float_tensor("teacher_logp", teacher_logp, 3)
    K, B, T = teacher_logp.shape
    if K < 1:
        raise ValueError("teacher_logp must hold one teacher at least, got K = 0")
    mask = check_mask(mask, "teacher_logp's (B, T)", (B, T))
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind must be one of {', '.join(TARGET_KINDS)}, got {kind!r}")
    dtype = compute_dtype(teacher_logp)
    device = teacher_logp.device
    zeros = torch.zeros((), dtype=dtype, device=device)
    # the padding selected away first: whatever it holds, it adds 0 to the running sums
    log_q = torch.where(mask[None], teacher_logp.detach().to(dtype), zeros)
    bad = mask[None] & ~(torch.isfinite(log_q) & (log_q <= 0))
    if bool(bad.any()):
        k, b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"teacher_logp must be finite and at most 0 where mask is 1, got "
                         f"{teacher_logp[k, b, t].item()!r} at ({k}, {b}, {t})")
    if kind == "routed":
        if weights is not None:
            raise ValueError("routed takes no weights: it uses routes (a routing drawn from a "
                             "matrix C is weighted_kl with weights C)")
        if not isinstance(routes, torch.Tensor) or tuple(routes.shape) != (B,) or \
                routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise ValueError(f"routed needs routes, a (B,) = {(B,)} integer tensor, got "
                             f"{routes!r:.80}")
        if bool(((routes < 0) | (routes >= K)).any()):
            raise ValueError(f"routes must lie in [0, K) = [0, {K}), got "
                             f"{routes.tolist()[:8]}")
        index = routes.to(device=device, dtype=torch.long)[None, :, None].expand(1, B, T)
        return log_q.gather(0, index)[0]
    if routes is not None:
        raise ValueError(f"routes is for kind='routed' only, got kind={kind!r}")
    w = _check_weights(weights, K, B, dtype, device).T[:, :, None]  # (K, B, 1)
    if kind == "weighted_kl":
        return (w * log_q).sum(0)  # a zero weight times a finite log q: 0
    log_w = w.log()  # -inf for a weight 0: that teacher drops out of the log-sum-exp
    if kind == "token_mixture":
        target = torch.logsumexp(log_w + log_q, dim=0)
    else:
        # log q_k(y_<=t) up to a shift common to the teachers: each position's mean over
        # them is taken out before the running sum and added back to the difference, so that
        # the sums hold only how far the teachers drift apart, not the response's whole
        # log-probability, whose rounding in float32 would grow with its length
        shift = log_q.mean(0)  # (B, T); the padding is 0
        centred = log_q - shift
        upto = centred.cumsum(-1)
        target = (torch.logsumexp(log_w + upto, dim=0)
                  - torch.logsumexp(log_w + (upto - centred), dim=0) + shift)
    return torch.where(mask, target, zeros)
