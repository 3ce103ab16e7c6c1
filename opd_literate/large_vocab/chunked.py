r"""Full-vocabulary OPD losses for large vocabularies, in chunks of tokens.

The dense losses of [opd_literate.opd][] take ``(B, T, V)`` logits. For a real tokenizer
($V = 151{,}936$ for Qwen) one float32 vocabulary vector is 0.58 MiB, and the dense reverse KL
holds several of them per token at once: the student's logits, their log-softmax, the
probabilities, the teacher's logits and log-softmax, the product inside the sum, and in the
backward pass the gradient of each. Measured by ``benchmarks/bench_large_vocab.py`` at 2,048
tokens, the dense loss adds 13,655 MiB (6.7 MiB, about 11.5 float32 vocabulary vectors, a
token) on top of its inputs and the model.

Everything a token needs is its own row: the KL at position $t$ depends on the logits of
position $t$ only. So we compute the logits of ``chunk_size`` tokens at a time, from the
student's last hidden states $h_t \in \mathbb{R}^H$ and its LM head $W \in \mathbb{R}^{V \times H}$
(and bias $b$),

$$
z_t = W h_t + b \in \mathbb{R}^V ,
$$

evaluate the divergence of those rows, and drop them. The gradient is taken by hand in the same
pass (the *fused linear-plus-loss* idea of Liger-Kernel's chunked losses): for a chunk with
per-row loss gradients $g_t = \partial \mathcal{L} / \partial z_t$,

$$
\frac{\partial \mathcal{L}}{\partial h_t} = W^\top g_t, \qquad
\frac{\partial \mathcal{L}}{\partial W} \mathrel{+}= \sum_{t \in \text{chunk}} g_t h_t^\top, \qquad
\frac{\partial \mathcal{L}}{\partial b} \mathrel{+}= \sum_{t \in \text{chunk}} g_t .
$$

The backward pass then only multiplies the stored gradients by the incoming scalar. Memory:
$O(\text{chunk} \times V)$ for the chunk's rows, plus $N \times H$ and $V \times H$ for the
stored gradients, instead of $O(N \times V)$. Time: the same matrix products as the dense
forward and backward passes, so no recompute is paid (a backward that recomputed each chunk
would run the $N \times V \times H$ product once more, about a third more work).

The row gradients are closed forms (with $p = \mathrm{softmax}(z_t)$, $q$ the teacher,
$d_v = \log p_v - \log q_v$):

* reverse KL, $\mathrm{KL}(p \,\|\, q)$: $\; g = p \odot (d - \mathrm{KL}(p \,\|\, q))$;
* forward KL, $\mathrm{KL}(q \,\|\, p)$: $\; g = p - q$;
* generalized JSD with $m = \beta q + (1 - \beta) p$ (the convention of
  [opd_literate.opd.generalized_jsd_per_position][]): since
  $\partial \mathrm{JSD}_\beta / \partial p_v = (1 - \beta) \log(p_v / m_v)$,
  $\; g = (1 - \beta)\, p \odot (\log p - \log m - \mathrm{KL}(p \,\|\, m))$.

Conventions (the same as [opd_literate.opd][], against which every function here is tested):
token-mean over the mask, normaliser $\max(1, \sum \mathrm{mask})$; masked-out positions are
never read (their hidden states may hold anything) and receive exactly 0 gradient; $0 \log 0 =
0$; a position where one side gives probability 0 to an entry the other side (the first argument
of the KL) can emit has a loss of $+\infty$ and contributes no gradient (as in ``opd.py``);
bf16 and fp16 inputs are computed in float32; the teacher never receives a gradient. What is
read must be a number: NaN or an infinity in a head weight or in a masked-in hidden state,
NaN or $+\infty$ in a bias or a masked-in row of teacher logits, a bias or a row that is
$-\infty$ everywhere, and logits $W h + b$ that overflow the compute dtype are a
``ValueError`` naming the argument (checked chunk by chunk, one synchronisation a chunk).

Imports: torch only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._numerics import (
    check_finite_number,
    check_float_tensor,
    check_mask,
    compute_dtype,
    kl_to_mixture,
)

__all__ = [
    "DIVERGENCES",
    "chunked_divergence",
    "chunked_reverse_kl",
    "chunked_forward_kl",
    "chunked_generalized_jsd",
]

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
"""The divergences of [opd_literate.large_vocab.chunked.chunked_divergence][]."""


# ---------------------------------------------------------------------------------------------
# One chunk: per-row loss and its gradient with respect to the logits, by closed form.
# ---------------------------------------------------------------------------------------------
def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[c, v] * b[c, v] for each row c, without a (chunk, V) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


def _kl_rows(log_a: torch.Tensor, a: torch.Tensor, log_b: torch.Tensor):
    r"""Per-row $\mathrm{KL}(a \,\|\, b)$ and the rows where it is $+\infty$.

    Returns ``(kl, infinite, d)`` with ``d = log_a - log_b`` on $a$'s support, 0 off it and on
    infinite rows (so ``d`` can be reused for the gradient). Overwrites ``log_b``.
    """
    support = log_a > -math.inf  # entries a can emit (a_v > 0 even where exp underflows)
    d = log_b.neg_().add_(log_a)  # log a - log b, in place of log_b: one (chunk, V) buffer
    # 0 log 0 = 0: off a's support d is -inf or NaN (-inf + inf); select it away.
    d.masked_fill_(~support, 0.0)
    # a_v > 0 = b_v: d_v = +inf and the KL is +inf (a constant: no gradient, as in opd.py).
    infinite = torch.isinf(d).any(dim=-1)
    d.masked_fill_(infinite[:, None], 0.0)
    # KL = sum_v a_v (log a_v - log b_v)
    kl = _row_dot(a, d)
    return kl, infinite, d


def _chunk_loss_and_grad(z, zt, divergence, beta, normalize):
    """Per-row loss (chunk,) and its gradient with respect to the student logits (chunk, V).

    ``z`` and ``zt`` (student and teacher logits of the chunk) are overwritten: the caller
    passes them without keeping a reference, so each chunk holds three ``(chunk, V)`` buffers
    (log p, log q, p) plus the temporaries of one operation at a time.
    """
    # log_softmax in place: log p = z - logsumexp(z) (logsumexp subtracts the max first)
    log_p = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))
    log_q = zt.sub_(torch.logsumexp(zt, dim=-1, keepdim=True))
    del z, zt
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        p = log_p.exp()
        kl, infinite, d = _kl_rows(log_p, p, log_q)
        # dKL/dz = p * (d - KL); rounding can make KL slightly negative where p = q: clamp it
        # to 0 and, like opd.py's clamp_min, send no gradient through a clamped row.
        grad = d.sub_(kl[:, None]).mul_(p)
        dead = infinite | (kl < 0)
        loss = torch.where(infinite, torch.full_like(kl, math.inf), kl.clamp_min(0.0))
    elif divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        q = log_q.exp()
        kl, infinite, _ = _kl_rows(log_q, q, log_p.clone())
        # dKL(q || p)/dz = p - q
        grad = log_p.exp_().sub_(q)
        dead = infinite | (kl < 0)
        loss = torch.where(infinite, torch.full_like(kl, math.inf), kl.clamp_min(0.0))
    else:  # generalized JSD, 0 < beta < 1: every term finite
        p = log_p.exp()
        # log m = log(beta q + (1 - beta) p); logaddexp(-inf, -inf) = -inf for padded entries
        log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log1p(-beta))
        # The value in the form without first-order cancellation: near beta = 0 or 1 the
        # plain sum of a (log a - log m) cancels to O(beta^2), which normalize then divides.
        loss = beta * kl_to_mixture(log_q, log_m) + (1.0 - beta) * kl_to_mixture(log_p, log_m)
        kl_pm, _, d = _kl_rows(log_p, p, log_m)
        # dJSD/dz = (1 - beta) p (log p - log m - KL(p || m))
        grad = d.sub_(kl_pm[:, None]).mul_(p).mul_(1.0 - beta)
        dead = torch.zeros_like(loss, dtype=torch.bool)
    if normalize and 0.0 < beta < 1.0:
        scale = 1.0 / (beta * (1.0 - beta))
        loss, grad = loss * scale, grad.mul_(scale)
    grad.masked_fill_(dead[:, None], 0.0)
    return loss, grad


class _ChunkedDivergence(torch.autograd.Function):
    """Token-mean divergence over the masked rows; gradients computed during the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_logits, teacher_hidden, teacher_weight,
                teacher_bias, rows, divergence, beta, normalize, chunk_size, grad_enabled):
        dtype = compute_dtype(*(t for t in (hidden, weight, bias, teacher_logits,
                                            teacher_hidden, teacher_weight, teacher_bias)
                                if t is not None))
        # needs_input_grad says True under torch.no_grad too: an evaluation pass would pay for
        # the gradient products, so the caller's grad mode is passed in as well.
        want_hidden, want_weight, want_bias = (grad_enabled and need
                                               for need in ctx.needs_input_grad[:3])
        weight_c = weight.detach().to(dtype)
        bias_c = None if bias is None else bias.detach().to(dtype)
        # -inf entries of each bias: the only -inf a row of W h + b may hold
        impossible = 0 if bias is None else int(torch.isneginf(bias).sum())
        if teacher_logits is None:
            t_weight_c = teacher_weight.detach().to(dtype)
            t_bias_c = None if teacher_bias is None else teacher_bias.detach().to(dtype)
            t_impossible = 0 if teacher_bias is None else int(torch.isneginf(teacher_bias).sum())
        # Every buffer on the inputs' device: without it they are CPU tensors, and the first
        # chunk on a GPU fails (an in-place add of a CUDA tensor into a CPU one).
        device = hidden.device
        grad_hidden = (torch.zeros(hidden.shape, dtype=dtype, device=device) if want_hidden
                       else None)
        grad_weight = (torch.zeros(weight.shape, dtype=dtype, device=device) if want_weight
                       else None)
        grad_bias = (torch.zeros(weight.shape[0], dtype=dtype, device=device) if want_bias
                     else None)
        # token-mean normaliser N = max(1, number of masked-in positions)
        n_tokens = max(int(rows.numel()), 1)
        total = torch.zeros((), dtype=dtype, device=device)
        for start in range(0, rows.numel(), chunk_size):
            idx = rows[start:start + chunk_size]  # only masked-in rows are ever read
            h = hidden.detach()[idx].to(dtype)  # (c, H)
            # Only the rows read are checked (padding may hold NaN): NaN or +inf in a row, or
            # logits that overflow, would give a NaN loss (and a NaN teacher row in the JSD a
            # loss of 0). One synchronisation a chunk.
            _check_finite(f"student_hidden (rows {int(idx[0])} to {int(idx[-1])})", h)
            if teacher_logits is not None:
                zt = teacher_logits.detach()[idx].to(dtype)  # (c, V), a copy (indexing)
                _check_chunk("teacher_logits", zt, idx)
            else:
                t_hidden = teacher_hidden.detach()[idx].to(dtype)
                _check_finite(f"teacher_hidden (rows {int(idx[0])} to {int(idx[-1])})", t_hidden)
                zt = F.linear(t_hidden, t_weight_c, t_bias_c)
                del t_hidden
                _check_chunk("the teacher's logits teacher_hidden @ teacher_weight.T", zt, idx,
                             t_impossible)
            # z = W h + b, the student's logits of the chunk, (c, V)
            z = F.linear(h, weight_c, bias_c)
            _check_chunk("the student's logits student_hidden @ student_weight.T", z, idx,
                         impossible)
            # passed on without a reference kept here, so that the callee can free it
            loss, grad_z = _chunk_loss_and_grad(z, zt, divergence, beta, normalize)
            del z
            del zt
            total += loss.sum()
            grad_z.div_(n_tokens)  # the token mean's 1/N
            if want_hidden:
                # dL/dh = W^T g, row by row: (c, V) @ (V, H)
                grad_hidden[idx] = grad_z @ weight_c
            if want_weight:
                # dL/dW += sum_t g_t h_t^T: (V, c) @ (c, H), accumulated in place
                grad_weight.addmm_(grad_z.T, h)
            if want_bias:
                grad_bias += grad_z.sum(dim=0)
            del grad_z
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.input_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / n_tokens

    @staticmethod
    def backward(ctx, grad_output):
        grads = []
        for stored, dtype in zip(ctx.saved_tensors, ctx.input_dtypes):
            if stored is None:
                grads.append(None)
                continue
            # The loss is a scalar: the backward pass only scales the stored gradients. The
            # usual upstream gradient is exactly 1; returning the stored tensor then avoids a
            # second (V, H) buffer.
            scaled = stored if bool(grad_output == 1) else stored * grad_output
            grads.append(scaled.to(dtype))
        return (*grads, None, None, None, None, None, None, None, None, None, None)


def _check_bias(name, bias, V):
    """An optional LM-head bias: None, or a floating (V,) tensor, no NaN or +inf, not all -inf."""
    if bias is None:
        return
    check_float_tensor(name, bias, 1)
    if bias.shape[0] != V:
        raise ValueError(f"{name} must have shape ({V},), got {tuple(bias.shape)}")
    if bool(torch.isnan(bias).any()):
        raise ValueError(f"{name} holds NaN")
    largest = bias.amax().item()
    if largest == math.inf:
        raise ValueError(f"{name} holds +inf: an entry must be finite, or -inf for a token "
                         "that cannot be emitted")
    if largest == -math.inf:
        raise ValueError(f"{name} is -inf everywhere: no token could be emitted")


def _check_finite(name, x):
    """Raise unless every entry of ``x`` is finite (two reductions: no temporary of x's size)."""
    if x.numel() and not (x.amin().item() > -math.inf and x.amax().item() < math.inf):
        what = "NaN" if bool(torch.isnan(x).any()) else "an infinite entry"
        raise ValueError(f"{name} holds {what}; it must be finite")


def _check_chunk(name, logits, rows, impossible=None):
    """Raise unless each row of a chunk's logits has no NaN or +inf and one entry above -inf.

    ``impossible``: for logits computed as ``W h + b``, the number of -inf entries of ``b``;
    a row with more -inf entries overflowed (a finite token made impossible).
    """
    row_max = logits.amax(dim=-1)  # NaN where a row holds NaN
    bad = ~(row_max < math.inf) | (row_max == -math.inf)
    if impossible is not None:
        bad |= torch.isneginf(logits).sum(dim=-1) != impossible
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        value = row_max[i].item()
        what = ("NaN" if math.isnan(value) else "+inf" if value == math.inf
                else "-inf everywhere" if value == -math.inf else "-inf where the bias is finite")
        raise ValueError(f"{name} at row {int(rows[i])} (masked in) holds {what}: the "
                         "logits must be finite, or -inf for tokens that cannot be emitted, "
                         "with at least one finite (a product of finite hidden states and "
                         "head that is not finite overflowed the compute dtype)")


def _check_inputs(student_hidden, student_weight, student_bias, mask, teacher_logits,
                  teacher_hidden, teacher_weight, teacher_bias, chunk_size):
    """Validate the arguments; return the indices of the masked-in rows."""
    check_float_tensor("student_hidden", student_hidden, 2)
    check_float_tensor("student_weight", student_weight, 2)
    N, H = student_hidden.shape
    V = student_weight.shape[0]
    if student_weight.shape[1] != H:
        raise ValueError(
            f"student_weight must have shape (V, H) with H = {H} (student_hidden's last "
            f"dimension), got {tuple(student_weight.shape)}"
        )
    if V == 0:
        raise ValueError("student_weight must have at least one row (V >= 1), got shape "
                         f"{tuple(student_weight.shape)}")
    _check_finite("student_weight", student_weight)
    _check_bias("student_bias", student_bias, V)
    if (teacher_logits is None) == (teacher_hidden is None and teacher_weight is None):
        raise ValueError("give the teacher either as teacher_logits (N, V) or as teacher_hidden "
                         "(N, H_T) with teacher_weight (V, H_T), not both and not neither")
    if teacher_logits is not None:
        check_float_tensor("teacher_logits", teacher_logits, 2)
        if tuple(teacher_logits.shape) != (N, V):
            raise ValueError(f"teacher_logits must have shape (N, V) = {(N, V)}, got "
                             f"{tuple(teacher_logits.shape)}")
        if teacher_bias is not None:
            raise ValueError("teacher_bias is only used with teacher_hidden and teacher_weight")
    else:
        if teacher_hidden is None or teacher_weight is None:
            raise ValueError("teacher_hidden and teacher_weight must be given together")
        check_float_tensor("teacher_hidden", teacher_hidden, 2)
        check_float_tensor("teacher_weight", teacher_weight, 2)
        if teacher_hidden.shape[0] != N:
            raise ValueError(f"teacher_hidden must have N = {N} rows (one per student "
                             f"position), got shape {tuple(teacher_hidden.shape)}")
        if tuple(teacher_weight.shape) != (V, teacher_hidden.shape[1]):
            raise ValueError(f"teacher_weight must have shape (V, H_T) = "
                             f"{(V, teacher_hidden.shape[1])}, got {tuple(teacher_weight.shape)}")
        _check_finite("teacher_weight", teacher_weight)
        _check_bias("teacher_bias", teacher_bias, V)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    mask = check_mask(mask, "student_hidden[:, 0]", (N,))
    return mask.nonzero().reshape(-1)


def chunked_divergence(student_hidden, student_weight, mask, *, teacher_logits=None,
                       teacher_hidden=None, teacher_weight=None, student_bias=None,
                       teacher_bias=None, divergence="reverse_kl", beta=0.5, normalize=False,
                       chunk_size=256):
    r"""Token-mean divergence between student and teacher, computed ``chunk_size`` rows at a time.

    The student's logits are $z_t = W h_t + b$; the teacher's are given, or computed the same
    way from its own hidden states and head. With $N = \max(1, \sum_t \mathrm{mask}_t)$,

    $$
    \mathcal{L} = \frac{1}{N} \sum_{t:\, \mathrm{mask}_t = 1}
    D\big(\mathrm{softmax}(z_t), \mathrm{softmax}(z^T_t)\big),
    $$

    with $D$ the reverse KL, the forward KL or the generalized JSD. The value and the gradients
    with respect to ``student_hidden``, ``student_weight`` and ``student_bias`` equal those of
    the dense [opd_literate.opd.full_vocab_reverse_kl][], [opd_literate.opd.forward_kl][] and
    [opd_literate.opd.generalized_jsd][] on the logits ``student_hidden @ student_weight.T +
    student_bias``, up to rounding. Only ``chunk_size`` rows of logits exist at any time.

    Parameters
    ----------
    student_hidden : torch.Tensor
        ``(N, H)`` floating, the student's last hidden states (flatten ``(B, T, H)`` first).
    student_weight : torch.Tensor
        ``(V, H)`` floating, the student's LM head (``nn.Linear(H, V).weight``).
    mask : torch.Tensor
        ``(N,)`` with values in {0, 1}. Rows with 0 are never read.
    teacher_logits : torch.Tensor, optional
        ``(N, V)`` floating, the teacher's logits. Give this *or* the next two.
    teacher_hidden, teacher_weight : torch.Tensor, optional
        ``(N, H_T)`` and ``(V, H_T)``: the teacher's hidden states and head; its logits are then
        computed chunk by chunk as well.
    student_bias, teacher_bias : torch.Tensor, optional
        ``(V,)`` head biases (``-inf`` entries are impossible tokens).
    divergence : str
        One of ``DIVERGENCES``: ``"reverse_kl"`` $\mathrm{KL}(p \,\|\, q)$ (OPD's),
        ``"forward_kl"`` $\mathrm{KL}(q \,\|\, p)$, ``"jsd"``.
    beta, normalize
        The JSD's weight in $[0, 1]$ and normalisation, as in
        [opd_literate.opd.generalized_jsd][]. The two KLs do not use them, but they are
        checked whatever the divergence (``beta=1.5`` is an error with ``"reverse_kl"`` too).
    chunk_size : int
        Rows of logits computed at once. Peak extra memory, measured (float32, $V = 65{,}536$,
        ``tests/large_vocab/test_chunked.py``), is 4.5 ``(chunk_size, V)`` buffers of the
        compute dtype for the reverse KL, 5.5 for the forward KL and 12.8 for the JSD with
        $0 < \beta < 1$ (whose cancellation-free sums take temporaries of their own), plus
        the stored gradients (``(N, H)`` and ``(V, H)``).

    Returns
    -------
    torch.Tensor
        A scalar in the compute dtype (float32 for half precision), differentiable with respect
        to the student's hidden states, head weight and bias. The teacher gets no gradient.

    Examples
    --------
    One position, a 2-dimensional hidden state and a head of 3 rows. The student's logits are
    $W h = (1, 0, 0)$, so $p = (e, 1, 1) / (e + 2)$; the teacher is uniform, so the forward KL
    is $\sum_v \tfrac{1}{3} \log \tfrac{1/3}{p_v} = \log(e + 2) - \log 3 - \tfrac{1}{3} = 0.1195$:

    >>> h = torch.tensor([[1.0, 0.0]], requires_grad=True)
    >>> W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    >>> loss = chunked_divergence(h, W, torch.ones(1), teacher_logits=torch.zeros(1, 3),
    ...                           divergence="forward_kl")
    >>> round(loss.item(), 4)
    0.1195
    >>> loss.backward()
    >>> # dL/dz = p - q = (0.2427, -0.1214, -0.1214); dL/dh = W^T (p - q)
    >>> [round(g, 4) for g in h.grad[0].tolist()]
    [0.2427, -0.1214]
    """
    rows = _check_inputs(student_hidden, student_weight, student_bias, mask, teacher_logits,
                         teacher_hidden, teacher_weight, teacher_bias, chunk_size)
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    beta = check_finite_number("beta", beta, low=0.0, high=1.0)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__} {normalize!r}")
    if divergence != "jsd":
        beta, normalize = (1.0 if divergence == "reverse_kl" else 0.0), False
    return _ChunkedDivergence.apply(student_hidden, student_weight, student_bias, teacher_logits,
                                    teacher_hidden, teacher_weight, teacher_bias, rows,
                                    divergence, beta, normalize, chunk_size,
                                    torch.is_grad_enabled())


def chunked_reverse_kl(student_hidden, student_weight, mask, *, teacher_logits=None,
                       teacher_hidden=None, teacher_weight=None, student_bias=None,
                       teacher_bias=None, chunk_size=256):
    r"""Full-vocabulary reverse KL $\mathrm{KL}(\pi_\theta \,\|\, \pi_T)$, token-mean, in chunks.

    The chunked form of [opd_literate.opd.full_vocab_reverse_kl][]; see
    [opd_literate.large_vocab.chunked.chunked_divergence][] for the arguments.

    Examples
    --------
    The student's logits $W h = (\log 2, 0)$ give $p = (2/3, 1/3)$; against a uniform teacher
    $\mathrm{KL} = \tfrac{2}{3} \log \tfrac{4}{3} + \tfrac{1}{3} \log \tfrac{2}{3} = 0.0566$.
    The second position is padding and holds NaN: it is never read.

    >>> import math
    >>> h = torch.tensor([[math.log(2.0)], [math.nan]])
    >>> W = torch.tensor([[1.0], [0.0]])
    >>> loss = chunked_reverse_kl(h, W, torch.tensor([1, 0]), teacher_logits=torch.zeros(2, 2))
    >>> round(loss.item(), 4)
    0.0566
    """
    return chunked_divergence(student_hidden, student_weight, mask, teacher_logits=teacher_logits,
                              teacher_hidden=teacher_hidden, teacher_weight=teacher_weight,
                              student_bias=student_bias, teacher_bias=teacher_bias,
                              divergence="reverse_kl", chunk_size=chunk_size)


def chunked_forward_kl(student_hidden, student_weight, mask, *, teacher_logits=None,
                       teacher_hidden=None, teacher_weight=None, student_bias=None,
                       teacher_bias=None, chunk_size=256):
    r"""Full-vocabulary forward KL $\mathrm{KL}(\pi_T \,\|\, \pi_\theta)$, token-mean, in chunks.

    The chunked form of [opd_literate.opd.forward_kl][]; see
    [opd_literate.large_vocab.chunked.chunked_divergence][] for the arguments and an example.
    """
    return chunked_divergence(student_hidden, student_weight, mask, teacher_logits=teacher_logits,
                              teacher_hidden=teacher_hidden, teacher_weight=teacher_weight,
                              student_bias=student_bias, teacher_bias=teacher_bias,
                              divergence="forward_kl", chunk_size=chunk_size)


def chunked_generalized_jsd(student_hidden, student_weight, mask, *, beta=0.5, normalize=False,
                            teacher_logits=None, teacher_hidden=None, teacher_weight=None,
                            student_bias=None, teacher_bias=None, chunk_size=256):
    r"""Generalized JSD (GKD's loss), token-mean, in chunks.

    The chunked form of [opd_literate.opd.generalized_jsd][] (same $\beta$ convention:
    0 is the forward KL, 1 the reverse KL); see
    [opd_literate.large_vocab.chunked.chunked_divergence][].

    Examples
    --------
    Two disjoint distributions are $\log 2$ apart at $\beta = 1/2$ (on its own support
    each is twice the mixture). An impossible entry is a ``-inf`` in the bias (an infinite
    head weight is an error: it would give ``0 * inf`` in the gradient of the hidden state):

    >>> h = torch.tensor([[1.0]], requires_grad=True)
    >>> W = torch.zeros(2, 1)
    >>> b = torch.tensor([0.0, -math.inf])       # the student can only say entry 1
    >>> t = torch.tensor([[-math.inf, 0.0]])     # the teacher only entry 2
    >>> loss = chunked_generalized_jsd(h, W, torch.ones(1), teacher_logits=t, student_bias=b)
    >>> round(loss.item(), 4)
    0.6931
    >>> loss.backward(); h.grad.tolist()
    [[0.0]]
    """
    return chunked_divergence(student_hidden, student_weight, mask, teacher_logits=teacher_logits,
                              teacher_hidden=teacher_hidden, teacher_weight=teacher_weight,
                              student_bias=student_bias, teacher_bias=teacher_bias,
                              divergence="jsd", beta=beta, normalize=normalize,
                              chunk_size=chunk_size)
