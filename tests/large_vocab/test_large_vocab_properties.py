"""Property tests of ``large_vocab.chunked``, ``large_vocab.topk`` and ``large_vocab.supports``
(Hypothesis).

Cases: B or T = 0 (N = 0 rows), V = 1, H = 0, k from 1 to V, every dtype (fp16, bf16, fp32,
fp64, and mixed), ragged, empty and full masks, chunk sizes that do not divide N, ``-inf`` in
the logits and biases, NaN and infinities in masked-out rows, logits up to the largest finite
number of their dtype. Every function must

* from finite input (``-inf`` where a token is impossible) return a value that is not NaN,
  close to an independent float64 reference, ``+inf`` exactly where the reference is, in the
  documented dtype and on the inputs' device; or raise a ``ValueError`` naming an argument
  (logits whose spread overflows the compute dtype);
* from NaN (or ``+inf``) where it is read raise a ``ValueError`` naming the argument;
* ignore masked-out rows: the value and the gradients are the same when they hold garbage,
  and their gradient rows are exactly 0;
* have gradients without NaN, finite wherever the loss is finite;
* agree with a second form: the chunked losses with the dense ones of ``opd.py`` (value and
  gradients, any chunk size, the wrappers bit for bit), the support's (a) and (b) with
  ``topk_kl`` on the same report, every support loss at $k = V$ with the full divergence,
  Tinker's REINFORCE form with the renormalised reverse KL, the worst tail with the forward KL
  it bounds (equal at $k = V$), ``skip_first_tokens`` with Tinker's loop;
* treat a position the teacher gives no mass (all ``-inf`` reported log-probabilities) as
  documented, in value and gradient, and refuse a report whose mass exceeds 1 by name.

The example count comes from the Hypothesis profile (conftest.py): "fast" by default,
``--hypothesis-profile=ci`` for 1,000 examples a property.
"""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate import opd
from opd_literate.large_vocab import supports
from opd_literate.large_vocab.chunked import (
    DIVERGENCES,
    chunked_divergence,
    chunked_forward_kl,
    chunked_generalized_jsd,
    chunked_reverse_kl,
)
from opd_literate.large_vocab.topk import (
    APPROXIMATIONS,
    DIRECTIONS,
    format_topk_bias_table,
    topk_bias_table,
    topk_kl,
    zipf_pair,
)

pytestmark = pytest.mark.properties

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def compute_dtype(*dtypes):
    dtype = dtypes[0]
    for d in dtypes[1:]:
        dtype = torch.promote_types(dtype, d)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def eps(dtype):
    return torch.finfo(dtype).eps


def draw_logits(draw, g, shape, dtype, finite_rows=None, cap=math.inf):
    """Logits of ``shape`` (..., V): a scale from tiny to the dtype's largest, some -inf entries
    (each row in ``finite_rows`` keeps one finite entry; None: every row)."""
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4, "huge", "max"]))
    largest = min(torch.finfo(dtype).max, cap)
    if scale == "huge":  # large, but every difference of two logits is finite in float32
        scale = min(largest, 1e30) / 4
    elif scale == "max":
        scale = largest
    with np.errstate(over="ignore"):  # clipped to the dtype's range just below
        z = np.clip(scale * g.standard_normal(shape), -largest, largest)
    impossible = g.random(shape) < draw(st.sampled_from([0.0, 0.3, 0.7]))
    keep = g.integers(0, shape[-1], size=shape[:-1])
    rows = np.ones(shape[:-1], bool) if finite_rows is None else finite_rows
    for index in np.ndindex(*shape[:-1]):
        if rows[index]:
            impossible[index + (keep[index],)] = False
    z[impossible] = -np.inf
    return torch.from_numpy(z).to(dtype)


# ---------------------------------------------------------------------------------------------
# topk_kl
# ---------------------------------------------------------------------------------------------
def reference_topk(log_p, log_q_S, ids, approximation, direction, dtype):
    """(a), (b), (c) at one position in float64 numpy, from the full student log-probs; the
    reverse tail bucket takes a teacher tail below k eps (the rounding of Q) as k eps, as
    documented."""
    s = log_p[ids]
    a, b = (s, log_q_S) if direction == "reverse" else (log_q_S, s)
    V, k = len(log_p), len(ids)

    def kl(la, lb):
        support = la > -np.inf
        if np.any(support & (lb == -np.inf)):
            return np.inf
        return float(np.sum(np.exp(la[support]) * (la[support] - lb[support])))

    if approximation == "ignore":
        return kl(a, b)
    log_A, log_B = (np.logaddexp.reduce(x) if np.any(x > -np.inf) else -np.inf for x in (a, b))
    if approximation == "renormalize":
        if log_A == -np.inf:
            return 0.0
        return kl(a - log_A, b - (log_B if log_B > -np.inf else 0.0))
    off = np.delete(log_p, ids)
    student_tail = np.logaddexp.reduce(off) if np.any(off > -np.inf) else -np.inf
    teacher_mass = np.exp(np.logaddexp.reduce(log_q_S)) if np.any(log_q_S > -np.inf) else 0.0
    teacher_tail = -np.inf if k == V or teacher_mass >= 1 else math.log1p(-teacher_mass)
    if direction == "reverse" and k < V:
        teacher_tail = max(teacher_tail, math.log(k * eps(dtype)))
    tails = (student_tail, teacher_tail) if direction == "reverse" else (teacher_tail,
                                                                          student_tail)
    return kl(np.append(a, tails[0]), np.append(b, tails[1]))


@st.composite
def topk_case(draw):
    lead = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
    V = draw(st.integers(1, 6))
    k = draw(st.integers(1, V))
    dtype, teacher_dtype = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(draw, g, lead + (V,), dtype)
    teacher = draw_logits(draw, g, lead + (V,), torch.float64)
    log_q = torch.log_softmax(teacher, -1)
    ids = torch.from_numpy(np.argsort(g.random(lead + (V,)), axis=-1)[..., :k].copy())
    teacher_logp = log_q.gather(-1, ids).clamp_max(0.0).to(teacher_dtype)
    return student, teacher_logp, ids, draw(st.sampled_from(APPROXIMATIONS)), \
        draw(st.sampled_from(DIRECTIONS))


# The slowest of the file's properties: the slow tier runs it (and .ci/run's property step
# at 1,000 examples), which keeps the README's command under a minute on 2 cores.
@pytest.mark.slow
@given(topk_case())
def test_topk_kl_finite_in_finite_out_close_to_the_reference(case):
    student, teacher_logp, ids, approximation, direction = case
    z = student.clone().requires_grad_(True)
    try:
        got = topk_kl(z, teacher_logp, ids, approximation, direction)
    except ValueError as error:
        # the only refusal of finite logits: a spread that overflows the compute dtype
        assert "student_logits span more than the range" in str(error)
        spread = student.double().amax(-1) - student.double().where(
            student > -math.inf, torch.tensor(math.inf, dtype=torch.float64)).amin(-1)
        assert bool((spread > torch.finfo(compute_dtype(student.dtype)).max / 2).any())
        return
    dtype = compute_dtype(student.dtype, teacher_logp.dtype)
    assert got.shape == student.shape[:-1] and got.dtype == dtype
    assert got.device == student.device
    assert not bool(got.isnan().any())
    # reference from the values the function received, in float64
    log_p = torch.log_softmax(student.to(dtype).double(), -1).numpy()
    t = teacher_logp.to(dtype).double().numpy()
    flat = got.detach().double().reshape(-1).numpy()
    lp, tt, ii = log_p.reshape(-1, log_p.shape[-1]), t.reshape(-1, t.shape[-1]), \
        ids.reshape(-1, ids.shape[-1]).numpy()
    for i in range(flat.size):
        want = reference_topk(lp[i], tt[i], ii[i], approximation, direction, dtype)
        if math.isinf(want):
            assert flat[i] == math.inf
            continue
        # terms of size |log a - log b| (up to 1e30 here) rounded in the compute dtype; the
        # tail buckets' log-masses come from the whole row, so every log-prob of it counts
        terms = np.concatenate([lp[i], tt[i]])
        magnitude = 1.0 + np.abs(terms[np.isfinite(terms)]).max(initial=0.0)
        assert abs(flat[i] - want) <= 64 * eps(dtype) * magnitude * (ids.shape[-1] + 2), \
            (flat[i], want)
    # gradients: no NaN, and finite wherever the value is
    finite = torch.isfinite(got)
    torch.where(finite, got, torch.zeros_like(got)).sum().backward()
    assert z.grad.dtype == student.dtype and not bool(z.grad.isnan().any())
    # finite where it fits the student's dtype (|gradient| is at most about twice the largest
    # |log p - log q|: fp16 cannot hold the gradient of a 1e5 gap, nor bf16 of a 1e300 one)
    gaps = torch.cat([torch.log_softmax(student.to(dtype), -1).detach().reshape(-1),
                      teacher_logp.to(dtype).reshape(-1)])
    gap = gaps[torch.isfinite(gaps)].abs().max().item() if bool(torch.isfinite(gaps).any()) \
        else 0.0
    if 4 * gap < torch.finfo(student.dtype).max:
        assert bool(torch.isfinite(z.grad).all())


@given(topk_case(), st.data())
def test_topk_kl_with_k_equal_to_v_is_the_full_kl(case, data):
    student, _, _, _, direction = case
    V = student.shape[-1]
    student = student.double().clamp(-1e4, 1e4)  # finite or -inf, moderate
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    teacher = draw_logits(data.draw, g, student.shape, torch.float64, cap=1e4)
    log_q = torch.log_softmax(teacher, -1)
    ids = torch.from_numpy(np.argsort(g.random(student.shape), axis=-1).copy())
    lead = student.shape[:-1]
    dense = (opd.reverse_kl_per_position if direction == "reverse"
             else opd.forward_kl_per_position)
    want = dense(student.reshape(1, -1, V), teacher.reshape(1, -1, V)).reshape(lead)
    for approximation in APPROXIMATIONS:
        got = topk_kl(student, log_q.gather(-1, ids), ids, approximation, direction)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (approximation, got, want)
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-9, atol=1e-9)


@given(topk_case(), st.sampled_from(["student", "teacher"]), st.data())
def test_topk_kl_nan_input_is_a_named_error(case, where, data):
    student, teacher_logp, ids, approximation, direction = case
    if student.numel() == 0:
        return
    target = student.clone() if where == "student" else teacher_logp.clone()
    flat = target.view(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1))] = math.nan
    name = "student_logits" if where == "student" else "teacher_topk_logp"
    args = (target, teacher_logp) if where == "student" else (student, target)
    with pytest.raises(ValueError, match=name):
        topk_kl(*args, ids, approximation, direction)


# ---------------------------------------------------------------------------------------------
# chunked_divergence
# ---------------------------------------------------------------------------------------------
@st.composite
def chunked_case(draw):
    N, H, V = draw(st.integers(0, 7)), draw(st.integers(0, 3)), draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(DTYPES))
    teacher_dtype = draw(st.sampled_from([dtype] + DTYPES))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = g.random(N) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    largest = torch.finfo(dtype).max
    scale = draw(st.sampled_from([1e-3, 1.0, 5.0, 1e3, "huge"]))
    scale = min(largest, 1e30) ** 0.5 if scale == "huge" else scale  # W h up to about 1e30
    hidden = torch.from_numpy(scale * g.standard_normal((N, H))).to(dtype)
    weight = torch.from_numpy(scale * g.standard_normal((V, H))).to(dtype)
    bias = None
    if draw(st.booleans()):
        b = g.standard_normal(V)
        b[(g.random(V) < 0.3) & (np.arange(V) != g.integers(0, V))] = -np.inf
        bias = torch.from_numpy(b).to(dtype)
    teacher = {}
    if draw(st.booleans()):
        teacher["teacher_logits"] = draw_logits(draw, g, (N, V), teacher_dtype,
                                                finite_rows=mask, cap=1e30)
    else:
        H_T = draw(st.integers(0, 3))
        teacher["teacher_hidden"] = torch.from_numpy(g.standard_normal((N, H_T))).to(
            teacher_dtype)
        teacher["teacher_weight"] = torch.from_numpy(3 * g.standard_normal((V, H_T))).to(
            teacher_dtype)
    divergence = draw(st.sampled_from(DIVERGENCES))
    beta = draw(st.sampled_from([0.0, 0.3, 1.0]))
    options = dict(divergence=divergence, beta=beta, normalize=draw(st.booleans()),
                   chunk_size=draw(st.integers(1, 9)), **teacher)
    return hidden, weight, bias, torch.from_numpy(mask), options


def with_garbage(x, mask, g):
    """``x`` with its masked-out rows overwritten by NaN, +-inf and huge numbers."""
    x = x.clone()
    if x.shape[-1]:
        rows = ~mask
        junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30], dtype=torch.float64)
        x[rows] = junk[torch.from_numpy(g.integers(0, 4, tuple(x[rows].shape)))].to(x.dtype)
    return x


def leaves(hidden, weight, bias):
    return [None if x is None else x.detach().clone().requires_grad_(True)
            for x in (hidden, weight, bias)]


def dense_reference(hidden, weight, bias, mask, options):
    """The dense opd.py loss in float64 on the masked-in rows only (the others are never
    passed), and its gradients (masked-out rows of the hidden states: 0)."""
    h, W, b = leaves(*(None if x is None else x.double() for x in (hidden, weight, bias)))
    rows = mask.nonzero().reshape(-1)
    z = h[rows] @ W.T + (0.0 if b is None else b)
    if "teacher_logits" in options:
        t = options["teacher_logits"][rows].double()
    else:
        t = options["teacher_hidden"][rows].double() @ options["teacher_weight"].double().T
    full = torch.ones(1, len(rows), dtype=torch.bool)
    if options["divergence"] == "reverse_kl":
        loss = opd.full_vocab_reverse_kl(z[None], t[None], full)
    elif options["divergence"] == "forward_kl":
        loss = opd.forward_kl(z[None], t[None], full)
    else:
        loss = opd.generalized_jsd(z[None], t[None], full, beta=options["beta"],
                                   normalize=options["normalize"])
    loss = loss * len(rows) / max(int(mask.sum()), 1)
    if loss.requires_grad and torch.isfinite(loss):
        loss.backward()
    return loss.detach(), [None if x is None else x.grad for x in (h, W, b)]


# The slowest of the file's properties: the slow tier runs it (and .ci/run's property step
# at 1,000 examples), which keeps the README's command under a minute on 2 cores.
@pytest.mark.slow
@given(chunked_case(), st.integers(0, 2**32 - 1))
def test_chunked_finite_in_finite_out_and_masked_rows_have_no_influence(case, seed):
    hidden, weight, bias, mask, options = case
    g = np.random.default_rng(seed)
    h, W, b = leaves(hidden, weight, bias)
    try:
        got = chunked_divergence(h, W, mask, student_bias=b, **options)
    except ValueError as error:
        # the only refusal of finite input: logits that overflow the compute dtype
        assert "overflowed the compute dtype" in str(error), error
        assert re.search(r"the (student|teacher)'s logits", str(error)), error
        return
    dtypes = [x.dtype for x in (hidden, weight, bias) if x is not None]
    dtypes += [v.dtype for v in options.values() if isinstance(v, torch.Tensor)]
    dtype = compute_dtype(*dtypes)
    assert got.shape == () and got.dtype == dtype and got.device == hidden.device
    assert not got.isnan()
    want, want_grads = dense_reference(hidden, weight, bias, mask, options)
    if math.isinf(want):
        assert got.item() == math.inf
    else:
        z = hidden.double() @ weight.double().T
        magnitude = 1.0 + (z.abs().max().item() if z.numel() else 0.0)
        if "teacher_logits" in options:
            t = options["teacher_logits"][mask].double()
            finite = t[torch.isfinite(t)]
            magnitude += finite.abs().max().item() if finite.numel() else 0.0
        scale = 4.0 if options["normalize"] and 0 < options["beta"] < 1 else 1.0
        assert abs(got.item() - want.item()) <= 256 * eps(dtype) * magnitude * scale, \
            (got.item(), want.item())
    got.backward()
    for x, reference in zip((h, W, b), want_grads):
        if x is None:
            continue
        assert x.grad.dtype == x.dtype and not bool(x.grad.isnan().any())
        if x.dtype != torch.float16:
            assert bool(torch.isfinite(x.grad).all())
        if reference is not None and magnitude < 1e3 and x.dtype == torch.float64:
            torch.testing.assert_close(x.grad, reference, rtol=1e-8, atol=1e-10)
    assert bool((h.grad[~mask] == 0).all())
    # garbage in the masked-out rows of every (N, .) input changes nothing, bit for bit
    garbage = dict(options)
    for name in ("teacher_logits", "teacher_hidden"):
        if name in garbage:
            garbage[name] = with_garbage(garbage[name], mask, g)
    h2, W2, b2 = leaves(with_garbage(hidden, mask, g), weight, bias)
    again = chunked_divergence(h2, W2, mask, student_bias=b2, **garbage)
    assert torch.equal(again, got)
    again.backward()
    assert torch.equal(h2.grad, h.grad) and torch.equal(W2.grad, W.grad)


NAN_TARGETS = ["student_hidden", "student_weight", "student_bias", "teacher_logits",
               "teacher_hidden", "teacher_weight"]


@given(chunked_case(), st.sampled_from(NAN_TARGETS), st.sampled_from([math.nan, math.inf]),
       st.data())
def test_chunked_nan_or_inf_where_it_is_read_is_a_named_error(case, target, bad, data):
    hidden, weight, bias, mask, options = case
    try:
        chunked_divergence(hidden, weight, mask, student_bias=bias, **options)
    except ValueError:  # logits that overflow: refused before the poisoned entry is read
        return
    tensors = {"student_hidden": hidden, "student_weight": weight, "student_bias": bias,
               **{k: v for k, v in options.items() if isinstance(v, torch.Tensor)}}
    x = tensors.get(target)
    if x is None or x.numel() == 0:
        return
    x = x.clone()
    if target in ("student_hidden", "teacher_logits", "teacher_hidden"):
        if not bool(mask.any()) or x.shape[1] == 0:
            return
        row = data.draw(st.sampled_from(mask.nonzero().reshape(-1).tolist()))
        x[row, data.draw(st.integers(0, x.shape[1] - 1))] = bad
    else:
        x.view(-1)[data.draw(st.integers(0, x.numel() - 1))] = bad
    tensors[target] = x
    options = {k: v for k, v in options.items() if not isinstance(v, torch.Tensor)}
    teacher = {k: tensors[k] for k in ("teacher_logits", "teacher_hidden", "teacher_weight")
               if k in tensors}
    with pytest.raises(ValueError, match=target):
        chunked_divergence(tensors["student_hidden"], tensors["student_weight"], mask,
                           student_bias=tensors["student_bias"], **teacher, **options)


# ---------------------------------------------------------------------------------------------
# The dense losses of opd.py that take logits: NaN at a masked-in position is an error
# ---------------------------------------------------------------------------------------------
DENSE = {
    "full_vocab_reverse_kl": lambda s, t, m: opd.full_vocab_reverse_kl(s, t, m),
    "forward_kl": lambda s, t, m: opd.forward_kl(s, t, m),
    "generalized_jsd": lambda s, t, m: opd.generalized_jsd(s, t, m, beta=0.3),
    "reverse_kl_per_position": lambda s, t, m: opd.reverse_kl_per_position(s, t, m),
    "forward_kl_per_position": lambda s, t, m: opd.forward_kl_per_position(s, t, m),
    "generalized_jsd_per_position": lambda s, t, m: opd.generalized_jsd_per_position(
        s, t, mask=m),
}


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.sampled_from(DTYPES),
       st.sampled_from(list(DENSE)), st.sampled_from(["student", "teacher"]), st.data())
def test_dense_losses_refuse_nan_at_masked_in_positions_only(B, T, V, dtype, name, side, data):
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    student = torch.from_numpy(g.standard_normal((B, T, V))).to(dtype)
    teacher = torch.from_numpy(g.standard_normal((B, T, V))).to(dtype)
    mask = torch.from_numpy(g.random((B, T)) < 0.5)
    b, t = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, T - 1))
    poisoned = (student if side == "student" else teacher).clone()
    poisoned[b, t, data.draw(st.integers(0, V - 1))] = math.nan
    args = (poisoned, teacher) if side == "student" else (student, poisoned)
    if bool(mask[b, t]):
        with pytest.raises(ValueError, match=f"{side}_logits holds NaN"):
            DENSE[name](*args, mask)
    else:
        got = DENSE[name](*args, mask)
        want = DENSE[name](student, teacher, mask)
        assert torch.equal(got[mask] if got.ndim else got, want[mask] if want.ndim else want)


# ---------------------------------------------------------------------------------------------
# The study's functions
# ---------------------------------------------------------------------------------------------
@given(st.integers(1, 12), st.floats(0.0, 3.0), st.floats(0.05, 5.0), st.floats(0.0, 3.0),
       st.integers(0, 2**31 - 1), st.data())
def test_bias_table_is_finite_or_a_named_error(V, exponent, temperature, noise, seed, data):
    student, teacher = zipf_pair(V, exponent, temperature, noise, seed)
    assert student.shape == teacher.shape == (V,) and student.dtype == torch.float64
    ks = data.draw(st.lists(st.integers(1, V), min_size=1, max_size=3, unique=True))
    try:
        rows = topk_bias_table(ks, student, teacher)
    except ValueError as error:
        assert "the true KLs and their gradients must be nonzero" in str(error)
        return
    assert len(rows) == len(ks) * len(DIRECTIONS) * len(APPROXIMATIONS)
    for row in rows:
        for key in ("teacher_mass", "student_mass", "true", "approx", "rel_bias",
                    "rel_grad_bias"):
            assert math.isfinite(row[key]), row
        if row["k"] == V:  # nothing left out: exact up to the rounding of two float64 sums
            # of at most 12 terms p (log p - log q), each within a few ulps of its own size (a
            # few units at most): an absolute 1e-12, whatever the KL's size. A relative bound
            # alone fails where the KL is tiny (noise 0.002: KL 1e-4, rel_bias 1.2e-9).
            assert abs(row["approx"] - row["true"]) <= 1e-12 + 1e-9 * abs(row["true"]), row
            assert row["rel_grad_bias"] < 1e-9
    data_ = {"V": V, "exponent": exponent, "noise": noise, "ks": ks,
             "rows": {float(temperature): rows}}
    table = format_topk_bias_table(data_, ks=ks)
    assert len(table.splitlines()) == 2 + len(ks) and "nan" not in table


# ---------------------------------------------------------------------------------------------
# supports: the builders and the loss on a support
# ---------------------------------------------------------------------------------------------
def reference_support(log_p, t, ids, valid, beta, approximation):
    """The support's D_beta at one position in float64 numpy, with TRL's cap on the masses."""
    s, t = np.where(valid, log_p[ids], -np.inf), np.where(valid, t, -np.inf)

    def lse(x):
        return np.logaddexp.reduce(x) if np.any(x > -np.inf) else -np.inf

    if approximation == "renormalize":
        s = s - (lse(s) if lse(s) > -np.inf else 0.0)
        t = t - (lse(t) if lse(t) > -np.inf else 0.0)
    else:
        cap = supports.TAIL_MAX_LOG_MASS
        s = np.append(s, math.log(-math.expm1(min(lse(s), cap))))
        t = np.append(t, math.log(-math.expm1(min(lse(t), cap))))

    def kl(la, lb):
        support = la > -np.inf
        if np.any(support & (lb == -np.inf)):
            return np.inf
        return float(np.sum(np.exp(la[support]) * (la[support] - lb[support])))

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    log_m = np.logaddexp(math.log(beta) + t, math.log1p(-beta) + s)  # never underflows
    return beta * kl(t, log_m) + (1 - beta) * kl(s, log_m)


@st.composite
def support_case(draw):
    lead = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
    V = draw(st.integers(1, 6))
    k = draw(st.integers(1, V))
    rule = draw(st.sampled_from(supports.SUPPORTS))
    dtype, teacher_dtype = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(draw, g, lead + (V,), dtype)
    teacher = draw_logits(draw, g, lead + (V,), teacher_dtype)
    tokens = torch.from_numpy(np.asarray(g.integers(0, V, size=lead))) if rule in (
        "sampled", "teacher_top1_sampled") else None
    mask = torch.from_numpy(np.asarray(g.random(lead) < draw(st.sampled_from([1.0, 0.6])))).long()
    return student, teacher, rule, k, tokens, mask, draw(st.sampled_from([0.0, 0.3, 1.0])), \
        draw(st.sampled_from(supports.LOSSES_ON_SUPPORT))


@given(support_case(), st.integers(1, 5))
def test_supports_finite_in_finite_out_close_to_the_reference(case, chunk_size):
    student, teacher, rule, k, tokens, mask, beta, approximation = case
    try:
        support = supports.build_support(rule, k, student, teacher, tokens=tokens,
                                         chunk_size=chunk_size)
    except ValueError as error:
        assert "teacher_logits span more than the range" in str(error)
        return
    # any chunk size builds the same support, bit for bit
    whole = supports.build_support(rule, k, student, teacher, tokens=tokens, chunk_size=10**6)
    assert all(torch.equal(a, b) for a, b in zip(support, whole))
    assert support.ids.device == student.device
    keep = mask.bool()
    z = torch.where(keep.unsqueeze(-1), student, torch.full_like(student, math.nan))
    z.requires_grad_(True)
    try:
        got = supports.support_divergence(z, support, beta=beta, approximation=approximation,
                                          mask=mask)
    except ValueError as error:
        assert "student_logits span more than the range" in str(error)
        return
    dtype = compute_dtype(student.dtype, teacher.dtype)
    assert got.shape == student.shape[:-1] and got.dtype == dtype
    assert not bool(got.isnan().any()) and bool((got[~keep] == 0).all())
    log_p = torch.log_softmax(student.to(dtype).double(), -1).numpy()
    t = support.teacher_logp.to(dtype).double().numpy()
    flat, V = got.detach().double().reshape(-1).numpy(), student.shape[-1]
    lp, tt = log_p.reshape(-1, V), t.reshape(-1, t.shape[-1])
    ii = support.ids.reshape(-1, t.shape[-1]).numpy()
    vv = support.valid.reshape(-1, t.shape[-1]).numpy()
    for i in np.flatnonzero(keep.reshape(-1).numpy()):
        want = reference_support(lp[i], tt[i], ii[i], vv[i], beta, approximation)
        if math.isinf(want):
            assert flat[i] == math.inf
            continue
        terms = np.concatenate([lp[i], tt[i]])
        magnitude = 1.0 + np.abs(terms[np.isfinite(terms)]).max(initial=0.0)
        assert abs(flat[i] - want) <= 64 * eps(dtype) * magnitude * (ii.shape[-1] + 2), \
            (flat[i], want)
    # gradients: no NaN, exactly 0 in the masked rows (which held NaN)
    finite = torch.isfinite(got)
    torch.where(finite, got, torch.zeros_like(got)).sum().backward()
    assert z.grad.dtype == student.dtype and not bool(z.grad.isnan().any())
    assert bool((z.grad[~keep] == 0).all())


@given(support_case(), st.sampled_from(["student", "teacher"]), st.data())
def test_supports_nan_input_is_a_named_error(case, where, data):
    student, teacher, rule, k, tokens, _, beta, _ = case
    if student.numel() == 0:
        return
    target = (student if where == "student" else teacher).clone()
    flat = target.view(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1))] = math.nan
    args = (target, teacher) if where == "student" else (student, target)
    with pytest.raises(ValueError, match=f"{where}_logits holds NaN"):
        supports.build_support(rule, k, *args, tokens=tokens)
    if where == "student":
        try:
            support = supports.build_support(rule, k, student, teacher, tokens=tokens)
        except ValueError as error:  # the one refusal of finite logits
            assert "teacher_logits span more than the range" in str(error)
            return
        with pytest.raises(ValueError, match="student_logits holds NaN"):
            supports.support_divergence(target, support, beta=beta)


@given(st.integers(2, 8), st.floats(0.0, 3.0), st.floats(0.05, 5.0), st.floats(0.05, 3.0),
       st.integers(0, 2**31 - 1), st.sampled_from([0.4, 1.0]))
def test_the_expected_sampled_loss_is_a_finite_lower_bound(V, exponent, temperature, noise,
                                                          seed, beta):
    student, teacher = zipf_pair(V, exponent, temperature, noise, seed)
    z = student.clone().requires_grad_(True)
    value = supports.expected_sampled_divergence(z, teacher, beta=beta, max_log_mass=None)
    full = opd.generalized_jsd_per_position(student[None, None], teacher[None, None],
                                            beta=beta)[0, 0]
    # a log-probability near 0 is rounded to about eps absolutely, so a mass 1 - q_x is known
    # to eps / (1 - q_x) relatively: the bucket of a token of probability near 1 carries that
    p, q = torch.softmax(student, -1), torch.softmax(teacher, -1)
    slack = 16 * torch.finfo(torch.float64).eps * float((p / torch.minimum(1 - p, 1 - q)).sum())
    assert math.isfinite(value.item()) and value.item() <= full.item() + 1e-12 + slack
    value.backward()
    assert bool(torch.isfinite(z.grad).all())


# ---------------------------------------------------------------------------------------------
# topk_kl: positions are independent, a report without mass is defined, masked rows leave none
# ---------------------------------------------------------------------------------------------
def hand_value_without_teacher_mass(log_p, ids, approximation, direction):
    """topk_kl at a position whose reported log-probabilities are all -inf (module docstring,
    "Conventions"), from the student's log-probabilities in plain floats."""
    P = sum(math.exp(log_p[v]) for v in ids)
    if direction == "reverse":
        return math.inf if P > 0 else 0.0
    if approximation != "tail":
        return 0.0
    # -log(1 - P), with 1 - P summed over the tokens off S (no cancellation where P is near 1)
    tail = sum(math.exp(log_p[v]) for v in range(len(log_p)) if v not in ids)
    return math.inf if tail == 0 else -math.log(tail)


@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_topk_kl_positions_are_independent_and_a_report_without_mass_is_defined(B, V, data):
    k = data.draw(st.integers(1, V))
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(data.draw, g, (B, V), torch.float64, cap=30.0)
    teacher = draw_logits(data.draw, g, (B, V), torch.float64, cap=30.0)
    ids = torch.from_numpy(np.argsort(g.random((B, V)), axis=-1)[:, :k].copy())
    report = torch.log_softmax(teacher, -1).gather(-1, ids)
    empty = torch.from_numpy(g.random(B) < 0.4)  # positions the teacher gives S no mass
    report[empty] = -math.inf
    mask = torch.from_numpy(g.random(B) < 0.6)
    for approximation in APPROXIMATIONS:
        for direction in DIRECTIONS:
            z = student.clone().requires_grad_(True)
            try:
                value = topk_kl(z, report, ids, approximation, direction)
            except ValueError as error:  # k = V and no mass: not a distribution
                assert k == V and bool(empty.any())
                assert str(error).startswith("teacher_topk_logp must be log-probabilities of "
                                             "one distribution")
                continue
            assert not bool(value.isnan().any())
            # the caller masks positions afterwards, infinite ones too
            keep = mask & torch.isfinite(value)
            torch.where(keep, value, torch.zeros_like(value)).sum().backward()
            assert not bool(z.grad.isnan().any()) and bool(torch.isfinite(z.grad).all())
            assert bool((z.grad[~keep] == 0).all())
            log_p = torch.log_softmax(student, -1).tolist()
            for i in range(B):
                x = student[i].clone().requires_grad_(True)
                alone = topk_kl(x, report[i], ids[i], approximation, direction)
                if bool(empty[i]):
                    want = hand_value_without_teacher_mass(log_p[i], ids[i].tolist(),
                                                           approximation, direction)
                    assert value[i].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
                if math.isinf(alone.item()):
                    assert value[i].item() == alone.item()
                    continue
                torch.testing.assert_close(value[i], alone.detach(), rtol=1e-12, atol=1e-15)
                if bool(keep[i]):
                    alone.backward()
                    torch.testing.assert_close(z.grad[i], x.grad, rtol=1e-12, atol=1e-15)


@given(topk_case(), st.floats(0.0, 1.0), st.data())
def test_topk_kl_refuses_a_report_of_more_than_one_in_probability_by_name(case, lift, data):
    student, teacher_logp, ids, approximation, direction = case
    if student.numel() == 0:
        return
    # lift every reported probability by a factor 1 + lift (still <= 1 each, the sum not)
    t = (teacher_logp.double() + math.log1p(lift)).clamp_max(0.0).to(teacher_logp.dtype)
    k, V = ids.shape[-1], student.shape[-1]
    dtype = compute_dtype(student.dtype, teacher_logp.dtype)
    # the documented tolerance: sqrt(eps) of the report (float32's at least) and 4 k eps
    tolerance = math.sqrt(max(eps(teacher_logp.dtype), eps(torch.float32))) + 4 * k * eps(dtype)
    mass = torch.logsumexp(t.double(), -1).exp()
    if bool((mass > 1 + 2 * tolerance).any()) or (k == V and bool((mass < 1 - 2 * tolerance)
                                                                   .any())):
        with pytest.raises(ValueError, match="^teacher_topk_logp must be log-probabilities of "
                                             "one distribution: the reported probabilities sum"):
            topk_kl(student, t, ids, approximation, direction)


# ---------------------------------------------------------------------------------------------
# chunked_divergence: the dense loss, whatever the chunks and whatever the masked rows hold
# ---------------------------------------------------------------------------------------------
@st.composite
def moderate_chunked_case(draw):
    """float64 inputs of moderate size (logits within about 30): the dense loss's gradients
    are then a reference to 1e-8."""
    N, H, V = draw(st.integers(0, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = torch.from_numpy(g.random(N) < draw(st.sampled_from([0.0, 0.6, 1.0])))
    hidden = torch.from_numpy(2 * g.standard_normal((N, H)))
    weight = torch.from_numpy(2 * g.standard_normal((V, H)))
    bias = None
    if draw(st.booleans()):
        b = g.standard_normal(V)
        b[(g.random(V) < 0.3) & (np.arange(V) != g.integers(0, V))] = -np.inf
        bias = torch.from_numpy(b)
    if draw(st.booleans()):
        teacher = {"teacher_logits": draw_logits(draw, g, (N, V), torch.float64,
                                                 finite_rows=mask.numpy(), cap=10.0)}
    else:
        H_T = draw(st.integers(1, 3))
        teacher = {"teacher_hidden": torch.from_numpy(g.standard_normal((N, H_T))),
                   "teacher_weight": torch.from_numpy(2 * g.standard_normal((V, H_T)))}
    options = dict(divergence=draw(st.sampled_from(DIVERGENCES)),
                   beta=draw(st.sampled_from([0.0, 0.3, 1.0])), normalize=draw(st.booleans()),
                   **teacher)
    chunks = (draw(st.integers(1, 7)), draw(st.integers(1, 7)))
    return hidden, weight, bias, mask, options, chunks, g


@given(moderate_chunked_case())
def test_chunked_is_the_dense_loss_for_any_chunks_and_ignores_masked_rows(case):
    hidden, weight, bias, mask, options, (c1, c2), g = case
    h, W, b = leaves(hidden, weight, bias)
    got = chunked_divergence(h, W, mask, student_bias=b, chunk_size=c1, **options)
    want, want_grads = dense_reference(hidden, weight, bias, mask, options)
    assert not got.isnan() and got.dtype == torch.float64
    got.backward()
    if math.isinf(want):
        assert got.item() == math.inf
    else:
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)
        for x, reference in zip((h, W, b), want_grads):
            if x is not None and reference is not None:
                torch.testing.assert_close(x.grad, reference, rtol=1e-8, atol=1e-10)
    for x in (h, W, b):
        assert x is None or bool(torch.isfinite(x.grad).all())
    assert bool((h.grad[~mask] == 0).all())
    # another chunk size: the same loss to rounding (the chunks' sums are added in another order)
    other = chunked_divergence(hidden, weight, mask, student_bias=bias, chunk_size=c2, **options)
    if math.isinf(got.item()):
        assert other.item() == math.inf
    else:
        torch.testing.assert_close(other, got.detach(), rtol=1e-12, atol=1e-14)
    # NaN, infinities and huge numbers in every masked-out row: bit for bit the same
    garbage = dict(options)
    for name in ("teacher_logits", "teacher_hidden"):
        if name in garbage:
            garbage[name] = with_garbage(garbage[name], mask, g)
    h2, W2, b2 = leaves(with_garbage(hidden, mask, g), weight, bias)
    again = chunked_divergence(h2, W2, mask, student_bias=b2, chunk_size=c1, **garbage)
    again.backward()
    assert torch.equal(again, got) and torch.equal(h2.grad, h.grad) and torch.equal(W2.grad,
                                                                                   W.grad)
    # the wrappers are chunked_divergence with their divergence, bit for bit
    teacher = {k: v for k, v in options.items() if k.startswith("teacher")}
    wrapper = {"reverse_kl": chunked_reverse_kl, "forward_kl": chunked_forward_kl,
               "jsd": lambda *a, **kw: chunked_generalized_jsd(
                   *a, beta=options["beta"], normalize=options["normalize"], **kw)}
    wrapped = wrapper[options["divergence"]](hidden, weight, mask, student_bias=bias,
                                             chunk_size=c1, **teacher)
    assert torch.equal(wrapped, got.detach())


# ---------------------------------------------------------------------------------------------
# supports: Tinker's REINFORCE form, the worst tail, the whole vocabulary, TRL's dispatch
# ---------------------------------------------------------------------------------------------
@given(st.integers(1, 4), st.integers(2, 6), st.sampled_from(["teacher_topk", "student_topk",
                                                              "union"]), st.data())
def test_reinforce_is_the_renormalised_reverse_kl_and_ignores_masked_positions(B, V, rule, data):
    k = data.draw(st.integers(1, V))
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(data.draw, g, (B, V), torch.float64, cap=30.0)
    teacher = torch.from_numpy(3 * g.standard_normal((B, V)))  # finite: every slot has mass
    support = supports.build_support(rule, k, student, teacher)
    empty = torch.from_numpy(g.random(B) < 0.3)  # positions the teacher gives S no mass
    support.teacher_logp[empty] = -math.inf
    mask = torch.from_numpy(g.random(B) < 0.7).long()
    keep = mask.bool()
    # garbage where masked out: NaN logits, ids out of range, no valid slot, NaN log-probs
    dirty = supports.Support(support.ids.clone(), support.valid.clone(),
                             support.teacher_logp.clone())
    dirty.ids[~keep], dirty.valid[~keep], dirty.teacher_logp[~keep] = V + 3, False, math.nan
    dirty_student = torch.where(keep[:, None], student, torch.full_like(student, math.nan))

    def value_and_grad(fn, z):
        z = z.clone().requires_grad_(True)
        value = fn(z)
        torch.where(torch.isfinite(value), value, torch.zeros_like(value)).sum().backward()
        return value.detach(), z.grad

    value, grad = value_and_grad(lambda z: supports.reinforce_reverse_kl(z, dirty, mask=mask),
                                 dirty_student)
    clean = value_and_grad(lambda z: supports.reinforce_reverse_kl(z, support, mask=mask),
                           student)
    assert torch.equal(value, clean[0]) and torch.equal(grad, clean[1])
    assert not bool(grad.isnan().any()) and bool(torch.isfinite(value).all())
    # masked out, or no teacher mass on S (Tinker's weights NaN, its slot mask empty): 0
    assert bool((value[~keep | empty] == 0).all()) and bool((grad[~keep | empty] == 0).all())
    renormalised = value_and_grad(lambda z: supports.support_divergence(
        z, support, beta=1.0, approximation="renormalize", mask=mask), student)
    rows = keep & ~empty
    torch.testing.assert_close(value[rows], renormalised[0][rows], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad[rows], renormalised[1][rows], rtol=1e-10, atol=1e-14)


@given(st.integers(1, 3), st.integers(2, 7), st.data())
def test_the_worst_tail_brackets_the_forward_kl_and_is_it_at_k_equal_v(B, V, data):
    k = data.draw(st.integers(1, V))
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(data.draw, g, (B, V), torch.float64, cap=10.0)
    teacher = draw_logits(data.draw, g, (B, V), torch.float64, cap=10.0)
    report, ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    z = student.clone().requires_grad_(True)
    bound = supports.forward_kl_upper_bound(z, report, ids)
    forward = opd.forward_kl_per_position(student[None], teacher[None])[0]
    bucket = supports.support_divergence(
        student, supports.Support(ids, torch.ones_like(ids, dtype=torch.bool), report), beta=0.0,
        max_log_mass=None)
    assert not bool(bound.isnan().any())
    # (b) <= KL(q || p) <= the bound, to the rounding of sums of terms up to about 20
    slack = 1e-12 * (1 + forward.where(torch.isfinite(forward), torch.zeros_like(forward)).abs())
    assert bool((bucket <= forward + slack).all()) and bool((forward <= bound + slack).all())
    if k == V:  # nothing unreported: the bound is the forward KL itself
        assert torch.equal(torch.isinf(bound), torch.isinf(forward))
        finite = torch.isfinite(forward)
        torch.testing.assert_close(bound[finite].detach(), forward[finite], rtol=1e-10,
                                   atol=1e-12)
    torch.where(torch.isfinite(bound), bound, torch.zeros_like(bound)).sum().backward()
    assert bool(torch.isfinite(z.grad).all())


@given(st.integers(1, 3), st.integers(1, 6), st.sampled_from(["teacher_topk", "student_topk"]),
       st.sampled_from([0.0, 0.3, 1.0]), st.sampled_from(supports.LOSSES_ON_SUPPORT), st.data())
def test_on_the_whole_vocabulary_the_support_loss_is_the_divergence(B, V, rule, beta,
                                                                     approximation, data):
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(data.draw, g, (B, V), torch.float64, cap=10.0)
    teacher = draw_logits(data.draw, g, (B, V), torch.float64, cap=10.0)
    support = supports.build_support(rule, V, student, teacher)
    assert torch.equal(support.ids.sort(-1).values, torch.arange(V).expand(B, V))
    # the builder's log-normaliser is its own sum: log-probabilities up to about 60, to 1e-13
    torch.testing.assert_close(support.teacher_logp,
                               torch.log_softmax(teacher, -1).gather(-1, support.ids),
                               rtol=1e-14, atol=1e-13)
    z, full_z = (student.clone().requires_grad_(True) for _ in range(2))
    got = supports.support_divergence(z, support, beta=beta, approximation=approximation,
                                      max_log_mass=None)
    want = opd.generalized_jsd_per_position(full_z[None], teacher[None], beta=beta)[0]
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-10, atol=1e-12)
    got[finite].sum().backward()
    want[finite].sum().backward()
    assert not bool(z.grad.isnan().any())
    torch.testing.assert_close(z.grad[finite], full_z.grad[finite], rtol=1e-8, atol=1e-10)


@given(st.floats(0.0, 1.0), st.integers(0, 10), st.sampled_from(["sampled", "argmax"]),
       st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_trls_dispatch_names_a_support_the_builder_accepts(beta, loss_top_k, mode, V, seed):
    rule, k = supports.trl_support_rule(beta, loss_top_k, mode, vocab_size=V)
    if rule == "full":
        assert k == V and (loss_top_k == 0 or loss_top_k >= V)
        assert not (beta > 0 and loss_top_k == 1)
        return
    assert rule in supports.SUPPORTS and 1 <= k <= V
    g = np.random.default_rng(seed)
    student, teacher = (torch.from_numpy(g.standard_normal((2, V))) for _ in range(2))
    tokens = torch.from_numpy(g.integers(0, V, 2)) if rule in ("sampled",
                                                              "teacher_top1_sampled") else None
    support = supports.build_support(rule, k, student, teacher, tokens=tokens)
    value = supports.support_divergence(student, support, beta=beta)
    assert value.shape == (2,) and bool(torch.isfinite(value).all())


@given(st.integers(0, 4), st.integers(0, 8), st.integers(0, 5), st.integers(0, 2**32 - 1))
def test_skip_first_tokens_drops_the_first_n_completion_tokens_of_each_row(B, T, n, seed):
    mask = torch.from_numpy(np.random.default_rng(seed).random((B, T)) < 0.6)
    got = supports.skip_first_tokens(mask.long(), n)
    assert got.dtype == torch.bool and got.shape == (B, T)
    for row in range(B):
        positions = mask[row].nonzero().reshape(-1).tolist()
        want = torch.zeros(T, dtype=torch.bool)
        want[positions[n:]] = True
        assert torch.equal(got[row], want)


@given(st.integers(1, 3), st.integers(1, 6), st.sampled_from(supports.LOSSES_ON_SUPPORT),
       st.sampled_from([(0.0, "forward"), (1.0, "reverse")]), st.data())
def test_the_support_loss_on_a_report_is_topk_kl_in_value_and_gradient(B, V, approximation,
                                                                       direction, data):
    # the same (a) and (b) and the same rounding conventions (exact student tail, no tail at
    # k = V, the reverse floor of the teacher's tail), computed by two implementations
    beta, direction = direction
    k = data.draw(st.integers(1, V))
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    student = draw_logits(data.draw, g, (B, V), torch.float64, cap=1e4)
    teacher = draw_logits(data.draw, g, (B, V), torch.float64, cap=1e4)
    ids = torch.from_numpy(np.argsort(g.random((B, V)), axis=-1)[:, :k].copy())
    report = torch.log_softmax(teacher, -1).gather(-1, ids)
    support = supports.Support(ids, torch.ones_like(ids, dtype=torch.bool), report)
    values, grads = [], []
    for fn in (lambda z: supports.support_divergence(z, support, beta=beta,
                                                     approximation=approximation,
                                                     max_log_mass=None),
               lambda z: topk_kl(z, report, ids, approximation, direction)):
        z = student.clone().requires_grad_(True)
        value = fn(z)
        torch.where(torch.isfinite(value), value, torch.zeros_like(value)).sum().backward()
        values.append(value.detach())
        grads.append(z.grad)
    assert not bool(values[0].isnan().any()) and not bool(grads[0].isnan().any())
    assert torch.equal(torch.isinf(values[0]), torch.isinf(values[1]))
    finite = torch.isfinite(values[1])
    # terms up to |log p - log q| ~ 2e4, each rounded at 2e-16
    scale = 1 + torch.cat([report[torch.isfinite(report)].abs(), torch.zeros(1)]).max().item()
    torch.testing.assert_close(values[0][finite], values[1][finite], rtol=1e-12,
                               atol=1e-14 * scale)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12 * scale)
