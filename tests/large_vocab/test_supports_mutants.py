"""The cases the mutation run of opd_literate/large_vocab/supports.py found no test held
(docs/mutation.md): refusals and their messages, the chunks build_support checks, the compute
dtype, TRL's cap and its edges, the mass tolerance and the top-k slack at their edges, the rows
_truth refuses, the study's parameters and table, what the figure holds, and NeMo-RL's loss and
references (an invalid slot, mixed at w = 1, one infinite KL) with a tie at k = V.

Each test names the mutants it kills (``supports.x_FUNCTION__mutmut_N``). Expected values come
from the docstrings' definitions, hand arithmetic or plain-Python sums over the vocabulary, not
from the module's output.
"""

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from opd_literate.large_vocab import supports as sp
from opd_literate.large_vocab.supports import (
    CHOICES,
    Choice,
    Support,
    build_support,
    expected_sampled_divergence,
    forward_kl_upper_bound,
    support_bias,
    support_divergence,
)
from opd_literate.large_vocab.topk import zipf_pair
from opd_literate.opd import generalized_jsd_per_position
from tests.helpers.committed import assert_matches_committed

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
EPS32 = torch.finfo(F32).eps
EPS64 = torch.finfo(F64).eps
# Values computed in float32 against a float64 plain-Python sum of a few terms: each float32
# operation rounds by 6e-8 relatively, a few dozen of them at most
FLOAT32_SUMS = 1e-5


def _refused(error, message):
    """pytest.raises for the whole message."""
    return pytest.raises(error, match="^" + re.escape(message) + "$")


def _plain_kl(a, b):
    """KL(a || b) of two lists of probabilities, 0 log 0 = 0."""
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def _one_support(ids, log_q):
    ids = torch.as_tensor(ids)
    return Support(ids, torch.ones_like(ids, dtype=torch.bool), log_q[ids])


# ---------------------------------------------------------------------------------------------
# Refusals: the argument's name and the value given, whole
# ---------------------------------------------------------------------------------------------
REFUSALS = [
    # _check_tokens 4 (bool accepted), 10, 16, 17 (the dtype missing), 18 (type(None))
    (lambda: build_support("sampled", 1, torch.zeros(2, 4), torch.zeros(2, 4),
                           tokens=torch.tensor([True, False])), TypeError,
     "rule 'sampled' needs tokens, an integer torch.Tensor of the sampled ids, got torch.bool"),
    (lambda: build_support("sampled", 1, torch.zeros(2, 4), torch.zeros(2, 4),
                           tokens=torch.tensor([0.0, 1.0])), TypeError,
     "rule 'sampled' needs tokens, an integer torch.Tensor of the sampled ids, got "
     "torch.float32"),
    (lambda: build_support("sampled", 1, torch.zeros(2, 4), torch.zeros(2, 4), tokens=[0, 1]),
     TypeError, "rule 'sampled' needs tokens, an integer torch.Tensor of the sampled ids, got "
     "list"),
    # trl_support_rule 7, 11, 15 (beta's upper end), 17 (vocab_size), 23 (loss_top_k)
    (lambda: sp.trl_support_rule(1.5, 1, vocab_size=8), ValueError,
     "beta must be <= 1.0, got 1.5"),
    (lambda: sp.trl_support_rule(0.5, 1, vocab_size=8.0), ValueError,
     "vocab_size must be a positive int, got 8.0"),
    (lambda: sp.trl_support_rule(0.5, 1, vocab_size=True), ValueError,
     "vocab_size must be a positive int, got True"),
    (lambda: sp.trl_support_rule(0.5, 1.0, vocab_size=8), ValueError,
     "loss_top_k must be an int >= 0, got 1.0"),
    (lambda: sp.trl_support_rule(0.5, True, vocab_size=8), ValueError,
     "loss_top_k must be an int >= 0, got True"),
    # build_support 2, 8, 9 and 11, 17, 18 (the names), 45 (a bool chunk size)
    (lambda: build_support("teacher_topk", 1, torch.zeros(2, 4, dtype=torch.long),
                           torch.zeros(2, 4)), TypeError,
     "student_logits must have a floating dtype, got torch.int64"),
    (lambda: build_support("teacher_topk", 1, torch.zeros(2, 4),
                           torch.zeros(2, 4, dtype=torch.long)), TypeError,
     "teacher_logits must have a floating dtype, got torch.int64"),
    (lambda: build_support("teacher_topk", 1, torch.zeros(2, 4), torch.zeros(2, 4),
                           chunk_size=True), ValueError,
     "chunk_size must be a positive int, got True"),
    # _check_beta_and_approximation 4, 8 (beta's lower end)
    (lambda: support_divergence(torch.zeros(3), _one_support([0], torch.full((3,), -1.1)),
                                beta=-0.5), ValueError, "beta must be >= 0.0, got -0.5"),
    # _check_support 15 (bool ids), 23, 26, 29 and 49, 52, 55 (lists), 31 (another leading shape)
    (lambda: support_divergence(torch.zeros(4), Support(
        torch.tensor([True]), torch.tensor([True]), torch.tensor([-1.0])), beta=0.5), TypeError,
     "support.ids must be an integer torch.Tensor, got torch.bool"),
    (lambda: support_divergence(torch.zeros(4), Support(
        [0], torch.tensor([True]), torch.tensor([-1.0])), beta=0.5), TypeError,
     "support.ids must be an integer torch.Tensor, got list"),
    (lambda: support_divergence(torch.zeros(4), Support(
        torch.tensor([0]), [True], torch.tensor([-1.0])), beta=0.5), TypeError,
     "support.valid must be a bool torch.Tensor, got list"),
    (lambda: support_divergence(torch.zeros(2, 4), Support(
        torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool),
        torch.full((3, 2), -1.0)), beta=0.5), ValueError,
     "support.ids must have shape (..., K), K >= 1, with the leading shape of student_logits "
     "(2,), got (3, 2)"),
    # _check_logits 2, expected_sampled_divergence 3, 7, 8: the student's name (checked there
    # first); forward_kl_upper_bound 1, 5, 6
    (lambda: expected_sampled_divergence(torch.zeros(3, dtype=torch.long), torch.zeros(3),
                                         beta=1.0), TypeError,
     "student_logits must have a floating dtype, got torch.int64"),
    (lambda: forward_kl_upper_bound(torch.zeros(3, dtype=torch.long), torch.tensor([-1.0]),
                                    torch.tensor([0])), TypeError,
     "student_logits must have a floating dtype, got torch.int64"),
    # expected_sampled_divergence 42, 46, 47 and 51, 55, 56; forward_kl_upper_bound 52, 56, 57:
    # the name in the overflow message (3e38 - (-3e38) is beyond float32's range)
    (lambda: expected_sampled_divergence(torch.tensor([3e38, -3e38, 0.0]), torch.zeros(3),
                                         beta=1.0), ValueError,
     "student_logits span more than the range of torch.float32 within a position: "
     "log_softmax overflows (shift or rescale them)"),
    (lambda: expected_sampled_divergence(torch.zeros(3), torch.tensor([3e38, -3e38, 0.0]),
                                         beta=1.0), ValueError,
     "teacher_logits span more than the range of torch.float32 within a position: "
     "log_softmax overflows (shift or rescale them)"),
    (lambda: forward_kl_upper_bound(torch.tensor([3e38, -3e38, 0.0]),
                                    torch.log(torch.tensor([0.5])), torch.tensor([0])),
     ValueError, "student_logits span more than the range of torch.float32 within a position: "
                 "log_softmax overflows (shift or rescale them)"),
    # support_bias 11, 17, 18 (the teacher's name), 13 (its dimensions)
    (lambda: support_bias(CHOICES[0], 1, torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long)),
     TypeError, "teacher_logits must have a floating dtype, got torch.int64"),
    (lambda: support_bias(CHOICES[0], 1, torch.zeros(1, 4), torch.zeros(1, 1, 4)), ValueError,
     "teacher_logits must have 2 dimensions, got shape (1, 1, 4) (3 dimensions)"),
    # _check_choice 9, 13 (low=0.0 dropped: a negative beta reached the loss, whose message
    # names beta, not choice.beta)
    (lambda: support_bias(Choice("x", "y", "union", -0.5, "tail"), 1, torch.zeros(1, 4),
                          torch.zeros(1, 4)), ValueError, "choice.beta must be >= 0.0, got -0.5"),
    # support_study 8 (a float V), 14 (a bool positions), 29 (a bool k)
    (lambda: sp.support_study(V=4.0), ValueError, "V must be an int >= 2, got 4.0"),
    (lambda: sp.support_study(V=8, positions=True), ValueError,
     "positions must be a positive int, got True"),
    (lambda: sp.support_study(V=8, ks=[True]), ValueError,
     "ks must hold ints in [1, V] = [1, 8], got True"),
    # skip_first_tokens 28
    (lambda: sp.skip_first_tokens(torch.ones(1, 3), True), ValueError,
     "n must be an int >= 0, got True"),
]


@pytest.mark.parametrize("call, error, message", REFUSALS)
def test_a_refusal_names_the_argument_and_the_value(call, error, message):
    with _refused(error, message):
        call()


def test_the_mass_message_names_the_first_position_above_one():
    # _check_support 202 (mass > 1 - tolerance picks the index): masses 1.0 and 1.5, the
    # second is the one refused
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.75, 0.75]], dtype=F64))
    support = Support(torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.bool), logp)
    with _refused(ValueError, "support.teacher_logp must be log-probabilities of one "
                              "distribution: its valid slots sum to 1.5 > 1 in probability at "
                              "position (1,)"):
        support_divergence(torch.zeros(2, 3, dtype=F64), support, beta=0.5)


def test_the_smallest_vocabulary_and_a_single_position_are_accepted():
    # support_study 10, 11 (V <= 2, V < 3), 16, 17 (positions <= 1, < 2) and 34 (k < V)
    data = sp.support_study(V=2, positions=1, ks=[1, 2], choices=CHOICES[:1])
    assert (data["V"], data["positions"], [r["k"] for r in data["rows"]]) == (2, 1, [1, 2])


# ---------------------------------------------------------------------------------------------
# build_support: the chunks it checks, its compute dtype
# ---------------------------------------------------------------------------------------------
def test_the_logits_are_checked_one_chunk_at_a_time(monkeypatch):
    # build_support 1 (a default of 129 rows), 7, 10, 16, 19 (values=True: the whole (N, V)
    # checked at once, the bool tensor the chunks avoid), 106 (a step of 1), 108 to 111 (other
    # slices): 300 rows are 128 + 128 + 44 by default, 3 x 100 with chunk_size=100
    seen = []
    original = sp._check_values
    monkeypatch.setattr(sp, "_check_values",
                        lambda name, read: (seen.append((name, tuple(read.shape))),
                                            original(name, read))[1])
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 300, 5, generator=g)
    whole = build_support("teacher_topk", 2, s, t)
    assert seen == [(name, (c, 5)) for c in (128, 128, 44)
                    for name in ("student_logits", "teacher_logits")]
    seen.clear()
    by_100 = build_support("teacher_topk", 2, s, t, chunk_size=100)
    assert seen == [(name, (100, 5)) for _ in range(3)
                    for name in ("student_logits", "teacher_logits")]
    assert all(torch.equal(a, b) for a, b in zip(whole, by_100))
    assert torch.equal(whole.ids, t.topk(2, dim=-1).indices)


def test_the_teachers_log_probabilities_are_in_the_compute_dtype():
    # build_support 53 (the dtype of the teacher only): a float64 student with a float32
    # teacher computes in float64
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 6, generator=g, dtype=F64)
    t = torch.randn(3, 6, generator=g, dtype=F64).float()
    support = build_support("teacher_topk", 2, s, t)
    assert support.teacher_logp.dtype == F64
    want = torch.log_softmax(t.double(), -1).gather(-1, support.ids)
    # float64 from the same float32 values: a few float64 roundings of log-probabilities ~ 1
    torch.testing.assert_close(support.teacher_logp, want, rtol=0, atol=1e-14)


def test_a_bfloat16_teacher_is_normalised_in_float32():
    # build_support 141, 143 (the chunk kept in bfloat16: its sum of V = 1000 exponentials
    # rounds to 2^-8, a log-probability off by about 1e-2)
    g = torch.Generator().manual_seed(2)
    s, t = (3 * torch.randn(2, 4, 1000, generator=g)).bfloat16()
    support = build_support("union", 3, s, t)
    want = torch.log_softmax(t.double(), -1).gather(-1, support.ids)
    # a float32 sum of 1000 terms: a relative error of a few 1e-7 in the normaliser
    torch.testing.assert_close(support.teacher_logp.double(), want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# support_divergence: the compute dtype, the softmax's dimension, the renormalised empty side,
# TRL's cap at 0, a support that covers one position only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("student_dtype, report_dtype", [(F64, F32),   # _slots 4
                                                         (F32, F64)])  # _slots 5
def test_the_loss_is_computed_in_the_promoted_dtype(student_dtype, report_dtype):
    g = torch.Generator().manual_seed(3)
    s = torch.randn(4, 7, generator=g, dtype=F64).to(student_dtype)
    t = torch.randn(4, 7, generator=g, dtype=F64)
    support = build_support("union", 2, s.double(), t)
    narrow = support._replace(teacher_logp=support.teacher_logp.to(report_dtype))
    got = support_divergence(s, narrow, beta=0.5)
    assert got.dtype == F64
    # the same float64 computation on the same values
    want = support_divergence(s.double(), narrow._replace(
        teacher_logp=narrow.teacher_logp.double()), beta=0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_the_softmax_is_over_the_vocabulary_of_a_3d_batch():
    # _log_softmax 5, 7 (dim=None or omitted: torch takes dimension 0 of a 3-D tensor)
    g = torch.Generator().manual_seed(4)
    s = torch.randn(2, 2, 5, generator=g, dtype=F64)
    t = torch.randn(2, 2, 5, generator=g, dtype=F64)
    support = build_support("teacher_topk", 2, s, t)
    flat = Support(*(x.reshape(4, 2) for x in support))
    got = support_divergence(s, support, beta=0.5)
    torch.testing.assert_close(got.reshape(4), support_divergence(s.reshape(4, 5), flat,
                                                                  beta=0.5), rtol=0, atol=0)
    got = expected_sampled_divergence(s, t, beta=1.0)
    torch.testing.assert_close(got.reshape(4), expected_sampled_divergence(
        s.reshape(4, 5), t.reshape(4, 5), beta=1.0), rtol=0, atol=0)


def test_a_student_without_mass_on_the_support_renormalises_to_nothing():
    # _sparse_divergence 39 (log_P >= -inf: -inf - (-inf) = NaN for the empty side). The
    # student gives S = {0, 1} no mass: p~ is empty, m = beta q~, and the JSD is
    # beta KL(q~ || beta q~) = -beta log beta
    s = torch.tensor([-math.inf, -math.inf, 0.0], dtype=F64)
    q = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=F64))
    got = support_divergence(s, _one_support([0, 1], q), beta=0.5, approximation="renormalize")
    assert_matches_committed(got.item(), -0.5 * math.log(0.5), rtol=1e-15,
                             why="one logaddexp and log per outcome in float64")


@pytest.mark.parametrize("beta", [0.5, 0.0])
def test_a_cap_of_zero_is_no_cap(beta):
    # _sparse_divergence 97, 101, 102 (log(-expm1(0)): a math domain error), 103 (a cap of
    # +inf): with max_log_mass=0.0 the tail bucket is the exact one
    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, generator=g, dtype=F64)
    t = torch.randn(6, generator=g, dtype=F64)
    ids = [1, 4]
    got = support_divergence(s, _one_support(ids, torch.log_softmax(t, -1)), beta=beta,
                             max_log_mass=0.0).item()
    p, q = torch.softmax(s, -1).tolist(), torch.softmax(t, -1).tolist()
    a = [p[v] for v in ids] + [sum(p[v] for v in range(6) if v not in ids)]
    b = [q[v] for v in ids] + [sum(q[v] for v in range(6) if v not in ids)]
    if beta == 0.0:
        want = _plain_kl(b, a)  # D_0 = KL(q || p)
    else:
        m = [beta * y + (1 - beta) * x for x, y in zip(a, b)]
        want = beta * _plain_kl(b, m) + (1 - beta) * _plain_kl(a, m)
    assert_matches_committed(got, want, rtol=1e-12,
                             why="float64 sums of three terms against Python's")


def test_a_support_that_covers_one_position_gives_it_no_tail():
    # _gathered 34, 36 (in_S.all over every axis): position 0's support holds all V = 3 tokens,
    # position 1's does not. At position 0 the report's mass 1 - 2^-40 must not leave the
    # teacher a tail of 2^-40 against none for the student (+inf at beta = 0)
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.25 - 2.0 ** -40], [0.5, 0.25, 0.25]],
                                  dtype=F64))
    support = Support(torch.tensor([[0, 1, 2], [0, 1, 2]]),
                      torch.tensor([[True, True, True], [True, True, False]]), logp)
    got = support_divergence(torch.zeros(2, 3, dtype=F64), support, beta=0.0,
                             max_log_mass=None)
    q = logp[0].exp().tolist()
    assert_matches_committed(got[0].item(), _plain_kl(q, [1 / 3] * 3), rtol=1e-12,
                             why="a float64 sum of three terms against Python's")
    # position 1: S = {0, 1} and its tail bucket, by hand
    assert_matches_committed(got[1].item(), _plain_kl([0.5, 0.25, 0.25], [1 / 3] * 3),
                             rtol=1e-12, why="a float64 sum of three terms against Python's")


# ---------------------------------------------------------------------------------------------
# expected_sampled_divergence: dtypes, TRL's cap by hand, approximation (a), a token never drawn
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("student_dtype, teacher_dtype, out", [
    (torch.float16, torch.float16, F32),  # expected_sampled_divergence 34 (dtype None)
    (F64, F32, F64),                      # 37 (the teacher's dtype only)
    (F32, F64, F64),                      # 38 (the student's only)
])
def test_the_expected_loss_is_in_the_compute_dtype(student_dtype, teacher_dtype, out):
    s = torch.log(torch.tensor([0.2, 0.3, 0.5])).to(student_dtype)
    t = torch.log(torch.tensor([0.5, 0.3, 0.2])).to(teacher_dtype)
    assert expected_sampled_divergence(s, t, beta=1.0).dtype == out
    # forward_kl_upper_bound 47, 48, on the teacher's top-2 report
    assert forward_kl_upper_bound(s, t[:2], torch.tensor([0, 1])).dtype == out


def _expected_kl2(s, t):
    """sum_x p_x kl2(p_x, q_x), the exact expected sampled bucket (max_log_mass=None)."""
    p, q = torch.softmax(s.double(), -1).tolist(), torch.softmax(t.double(), -1).tolist()
    return sum(px * _plain_kl([px, 1 - px], [qx, 1 - qx]) for px, qx in zip(p, q))


@pytest.mark.parametrize("side", ["student", "teacher"])
def test_a_bfloat16_side_is_read_in_float32(side):
    # expected_sampled_divergence 41, 50 (a log-softmax in bfloat16, 3 significant digits)
    g = torch.Generator().manual_seed(6)
    s, t = torch.randn(2, 9, generator=g)  # float32: with bfloat16, computed in float32
    if side == "student":
        s = s.bfloat16()
    else:
        t = t.bfloat16()
    got = expected_sampled_divergence(s, t, beta=1.0, max_log_mass=None)
    assert got.dtype == F32
    assert_matches_committed(got.item(), _expected_kl2(s, t), rtol=FLOAT32_SUMS,
                             why="float32 log-softmaxes and a sum of 9 terms against float64")


def test_trls_cap_applies_to_the_expected_loss():
    # expected_sampled_divergence 22, 143 (max_log_mass dropped). V = 2, p = (1 - a, a),
    # q = (1/2, 1/2), beta = 1: at x = 0, log P = log(1 - a) > -1e-7, so the student's bucket
    # holds c = 1 - e^(-1e-7) instead of a; at x = 1 it is 1 - a (no cap)
    a = 1e-9
    c = -math.expm1(sp.TAIL_MAX_LOG_MASS)
    s = torch.log(torch.tensor([1 - a, a], dtype=F64))
    t = torch.zeros(2, dtype=F64)
    at_0 = (1 - a) * math.log(2 * (1 - a)) + c * math.log(2 * c)
    at_1 = a * math.log(2 * a) + (1 - a) * math.log(2 * (1 - a))
    got = expected_sampled_divergence(s, t, beta=1.0).item()
    # the exact bucket is lower by (1 - a)(c log 2c - a log 2a), about 1.5e-6
    assert_matches_committed(got, (1 - a) * at_0 + a * at_1, rtol=1e-12,
                             why="four float64 terms against Python's")


def test_one_token_renormalised_carries_nothing_in_expectation():
    # expected_sampled_divergence 142 (approximation dropped: the tail's value); _choice_loss 33
    # (the same in support_bias): the relative bias is -1 and the gradient error 1, exactly
    g = torch.Generator().manual_seed(7)
    s, t = torch.randn(2, 6, generator=g, dtype=F64)
    z = s.clone().requires_grad_(True)
    value = expected_sampled_divergence(z, t, beta=1.0, approximation="renormalize")
    value.backward()
    assert value.item() == 0.0 and torch.equal(z.grad, torch.zeros(6, dtype=F64))
    bias = support_bias(Choice("x", "y", "sampled", 1.0, "renormalize"), 1, s[None], t[None])
    assert bias["rel_bias"].item() == -1.0 and bias["rel_grad_error"].item() == 1.0


def test_a_token_the_student_never_samples_adds_nothing_even_an_infinite_loss():
    # expected_sampled_divergence 158 (weight >= 0: 0 * inf = NaN). The student always samples
    # token 0, which the teacher never emits: +inf; token 1's loss is +inf too, with weight 0
    s = torch.tensor([0.0, -math.inf], dtype=F64)
    t = torch.tensor([-math.inf, 0.0], dtype=F64)
    assert expected_sampled_divergence(s, t, beta=1.0, max_log_mass=0.0).item() == math.inf


# ---------------------------------------------------------------------------------------------
# forward_kl_upper_bound: the dtype of its parts, the slack 4 k eps at its edge
# ---------------------------------------------------------------------------------------------
def _worst_tail_bound(s, report, ids):
    """The docstring's formula in plain Python: the reported part and the worst tail."""
    p = torch.softmax(s.double(), -1).tolist()
    q = torch.as_tensor(report).double().exp().tolist()
    ids = list(ids)
    mu, rest = min(q), 1 - sum(q)
    tail = sorted(p[v] for v in range(len(p)) if v not in ids)
    value = sum(qv * math.log(qv / p[v]) for qv, v in zip(q, ids))
    for i, pv in enumerate(tail):
        w = min(mu, max(rest - i * mu, 0.0))
        if w > 0:
            value += w * math.log(w / pv)
    return value


@pytest.mark.parametrize("side", ["student", "report"])
def test_a_bfloat16_input_of_the_bound_is_read_in_float32(side):
    # forward_kl_upper_bound 51 (the student's log-softmax in bfloat16), 59 (the report kept
    # in bfloat16: 1 - Q and mu rounded to 2^-8)
    g = torch.Generator().manual_seed(8)
    s, t = torch.randn(2, 10, generator=g)
    report, ids = torch.log_softmax(t, -1).topk(3)
    if side == "student":
        s = s.bfloat16()
    else:
        report = report.bfloat16()
    got = forward_kl_upper_bound(s, report, ids)
    assert got.dtype == F32
    assert_matches_committed(got.item(), _worst_tail_bound(s, report, ids.tolist()),
                             rtol=FLOAT32_SUMS,
                             why="float32 log-softmax and sums of 10 terms against float64")


def test_the_top_k_slack_at_its_edge():
    # forward_kl_upper_bound 94 (slack 5 k eps), 97 (>=), 159, 160 (w read at i >= V - k).
    # V = 2, k = 1, a uniform student, the report e = q_0 just below 1/2: it is a top-k report
    # while 1 - e <= e + 4 eps. Walking e down ulp by ulp (the same exp on the same shape as
    # the function) finds 1 - e == e + 4 eps exactly, then e + 4 eps < 1 - e <= e + 5 eps.
    tie = refuse = None
    for j in range(64):
        t0 = math.log(0.5) - j * 2.0 ** -53
        e = torch.tensor([t0], dtype=F64).exp()
        rest, edge = (1.0 - e).item(), (e + 4 * EPS64).item()
        if rest == edge and tie is None:
            tie = (t0, e.item())
        if edge < rest <= (e + 5 * EPS64).item() and refuse is None:
            refuse = t0
    assert tie is not None and refuse is not None
    t0, e = tie
    bound = forward_kl_upper_bound(torch.zeros(2, dtype=F64), torch.tensor([t0], dtype=F64),
                                   torch.tensor([0])).item()
    # e log(2e) reported, e log(2e) on the tail token; the mutants add w log w = 4 eps
    # log(4 eps) = -3.1e-14 for a token that is not in the tail
    assert_matches_committed(bound, 2 * e * math.log(2 * e), rtol=0, atol=5e-15,
                             why="two float64 terms of about 1e-15 each")
    with _refused(ValueError, "teacher_topk_logp is not a top-k report: its unreported mass "
                              "1 - Q exceeds (V - k) times its smallest reported probability"):
        forward_kl_upper_bound(torch.zeros(2, dtype=F64), torch.tensor([refuse], dtype=F64),
                               torch.tensor([0]))


# ---------------------------------------------------------------------------------------------
# _check_support: the mass tolerance sqrt(eps_report) + 4 K eps_compute at its edges
# ---------------------------------------------------------------------------------------------
def _equal_report(K, mass, dtype):
    """A (K,) report of K equal probabilities summing to ``mass``, and its float64 mass."""
    logp = torch.full((K,), math.log(mass / K), dtype=F64).to(dtype)
    return logp, logp.double().exp().sum().item()


def _mass_check(student_dtype, logp):
    K = logp.shape[-1]
    support = Support(torch.arange(K), torch.ones(K, dtype=torch.bool), logp)
    return lambda: support_divergence(torch.zeros(2 * K, dtype=student_dtype), support, beta=0.5)


@pytest.mark.parametrize("student_dtype, report_dtype", [(F64, F32),   # _check_support 158
                                                         (F32, F64)])  # _check_support 159
def test_the_mass_tolerance_is_that_of_the_promoted_dtype(student_dtype, report_dtype):
    # K = 2. Computed in float64 the tolerance is sqrt(eps32) + 8 eps64; in float32 it would be
    # 9.5e-7 wider. A mass 5e-7 beyond sqrt(eps32) is refused.
    logp, mass = _equal_report(2, 1 + math.sqrt(EPS32) + 5e-7, report_dtype)
    assert 1 + math.sqrt(EPS32) + 3e-7 < mass < 1 + math.sqrt(EPS32) + 7e-7
    with pytest.raises(ValueError, match=r"its valid slots sum to 1\.00035 > 1"):
        _mass_check(student_dtype, logp)()


@pytest.mark.parametrize("K, excess, accepted", [
    (2, 0, True),      # _check_support 168 (sqrt - 4 K eps)
    (16, 32, True),    # _check_support 171 (4 / K: sqrt + eps / 4)
    (16, 72, False),   # _check_support 172 (5 K eps: sqrt + 80 eps)
])
def test_the_mass_tolerance_in_float32_at_its_edges(K, excess, accepted):
    # the band is sqrt(eps32) + 4 K eps32; the masses lie 8 eps32 or more from each edge,
    # against the rounding of K equal float32 log-probabilities and their sum (about 2 eps)
    logp, mass = _equal_report(K, 1 + math.sqrt(EPS32) + excess * EPS32, F32)
    edge = 1 + math.sqrt(EPS32) + 4 * K * EPS32
    assert abs(mass - edge) > 6 * EPS32
    check = _mass_check(F32, logp)
    if accepted:
        check()
    else:
        with pytest.raises(ValueError, match="must be log-probabilities of one distribution"):
            check()


def test_a_bfloat16_report_is_summed_in_float32():
    # _check_support 184 (the mass summed in bfloat16, whose ulp at 1 is 2^-7): the two bfloat16
    # log-probabilities -0.625 and -0.5859375 have the mass 1.0918, above 1 + sqrt(2^-7) + 8
    # eps32 = 1.0884; in bfloat16 it rounds to 1.0859 and would pass
    logp = torch.tensor([-0.625, -0.5859375], dtype=BF16)
    mass = logp.double().exp().sum().item()
    assert mass > 1 + math.sqrt(2.0 ** -7) + 8 * EPS32 + 1e-3
    with pytest.raises(ValueError, match=rf"its valid slots sum to {mass:.4f}\d* > 1"):
        _mass_check(F32, logp)()


def test_a_mass_exactly_at_the_tolerance_is_accepted():
    # _check_support 196 (>= in the test), 201 (>= in the index the message names): position
    # 0's mass is exactly 1 + tolerance in float32 (found by walking one log-probability ulp by
    # ulp, with the same logsumexp on the same (2, 2) tensor as the check); it is accepted, and
    # with position 1's mass 1.5 the message names position 1
    edge = torch.tensor(1 + math.sqrt(EPS32) + 8 * EPS32, dtype=F32)
    half = torch.tensor(math.log(edge.item() / 2), dtype=F32)
    over = torch.log(torch.tensor([0.75, 0.75]))
    found = None
    for step in range(-64, 64):
        x = half
        for _ in range(abs(step)):
            x = torch.nextafter(x, torch.tensor(-1.0 if step < 0 else 0.0))
        logp = torch.stack([torch.stack([half, x]), over])
        mass = torch.logsumexp(logp, dim=-1, keepdim=True)[..., 0].exp()
        if mass[0] == edge:
            found = logp
            break
    assert found is not None
    ids, valid = torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.bool)
    below = torch.stack([found[0], torch.log(torch.tensor([0.25, 0.25]))])
    assert torch.logsumexp(below, dim=-1, keepdim=True)[0, 0].exp() == edge
    support_divergence(torch.zeros(2, 4), Support(ids, valid, below), beta=0.5)
    support = Support(ids, valid, found)
    with pytest.raises(ValueError, match=r"sum to 1\.5 > 1 in probability at position \(1,\)$"):
        support_divergence(torch.zeros(2, 4), support, beta=0.5)


# ---------------------------------------------------------------------------------------------
# support_bias: float64 inside, the rows _truth refuses
# ---------------------------------------------------------------------------------------------
def test_the_bias_is_computed_in_float64_from_float32_inputs():
    # support_bias 33, 35 (.to(None): the study's arithmetic in float32; for the teacher, verl's
    # report is then its float32 log-softmax)
    student, teacher = zipf_pair(V=16, noise=1.0, seed=2)
    for choice in (next(c for c in CHOICES if c.rule == "union"),
                   next(c for c in CHOICES if c.loss == "verl")):
        got = support_bias(choice, 3, student[None].float(), teacher[None].float())
        keys = ("value", "true", "rel_bias", "rel_grad_error")
        assert all(got[key].dtype == F64 for key in keys)
        # the same float64 computation on the same values
        want = support_bias(choice, 3, student[None].float().double(),
                            teacher[None].float().double())
        for key in keys:
            torch.testing.assert_close(got[key], want[key], rtol=1e-13, atol=0)


def _first_row(beta, wanted):
    """The first of the rows teacher + 0.1 (V = 6) whose full D_beta and gradient, computed as
    _truth computes them on one (1, V) row, satisfy ``wanted(value, norm)``."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        t = torch.randn(1, 6, generator=g, dtype=F64)
        z = (t + 0.1).requires_grad_(True)
        value = generalized_jsd_per_position(z[None], t[None], beta=beta)[0]
        (grad,) = torch.autograd.grad(value.sum(), z)
        if wanted(value.item(), grad.norm(dim=-1).item()):
            return z.detach(), t
    raise AssertionError("no such row")


@pytest.mark.parametrize("beta, wanted", [
    # _truth 46, 47, 48: a divergence rounded to exactly 0 with a nonzero gradient
    (1.0, lambda value, norm: value == 0.0 and norm > 0.0),
    # _truth 51: a divergence above 0 whose gradient rounds to exactly 0
    (0.5, lambda value, norm: value > 0.0 and norm == 0.0),
])
def test_a_zero_divergence_or_gradient_is_refused(beta, wanted):
    # the student is the teacher shifted by 0.1: the same distribution, up to rounding
    student, teacher = _first_row(beta, wanted)
    choice = next(c for c in CHOICES if c.beta == beta and c.rule != "sampled")
    with pytest.raises(ValueError, match="^the full divergence and its gradient must be nonzero"):
        support_bias(choice, 2, student, teacher)


def test_an_infinite_divergence_is_refused():
    # _truth 47 ((true > 0) | ...): the student cannot emit token 3, which the teacher can: the
    # forward KL is +inf
    student = torch.tensor([[0.0, 0.5, 1.0, -math.inf]], dtype=F64)
    teacher = torch.zeros(1, 4, dtype=F64)
    with pytest.raises(ValueError, match="^the full divergence and its gradient must be nonzero"):
        support_bias(CHOICES[0], 2, student, teacher)


# ---------------------------------------------------------------------------------------------
# support_study: its parameters reach the pairs and the clamp study, its rows and keys
# ---------------------------------------------------------------------------------------------
def test_the_studys_parameters_reach_verls_fractions():
    # support_study 74, 75, 79 (exponent, temperature, seed dropped from the clamp study), 145
    # (p_above_q on every row), 161, 162 (the exponent's key). P > Q by hand on the same pairs.
    V, exponent, temperature, noise, positions, seed, ks = 32, 2.0, 0.7, 1.0, 8, 3, [1, 4]
    verl = next(c for c in CHOICES if c.loss == "verl")
    data = sp.support_study(V=V, exponent=exponent, temperature=temperature, noise=noise,
                            positions=positions, seed=seed, ks=ks, choices=(CHOICES[0], verl))

    def above(exponent, temperature, seed, k):
        count = 0
        for i in range(positions):
            s, t = zipf_pair(V, exponent, temperature, noise, seed + i)
            ids = t.topk(k).indices
            count += torch.softmax(s, -1)[ids].sum() > torch.softmax(t, -1)[ids].sum()
        return count / positions

    rows = {(r["label"], r["k"]): r for r in data["rows"]}
    for k in ks:
        want = above(exponent, temperature, seed, k)
        assert rows[verl.label, k]["p_above_q"] == want
        assert rows[CHOICES[0].label, k]["p_above_q"] is None
    # the parameters matter: the defaults the mutants fall back to (exponent 1.1, the last
    # temperature 1.0 of clamp_study's, seed 0) give other fractions
    mine = [above(exponent, temperature, seed, k) for k in ks]
    for other in ((1.1, temperature, seed), (exponent, 1.0, seed), (exponent, temperature, 0)):
        assert [above(*other, k) for k in ks] != mine
    assert set(data) == {"V", "exponent", "temperature", "noise", "positions", "ks", "rows"}
    assert (data["V"], data["exponent"], data["temperature"], data["noise"], data["positions"],
            data["ks"]) == (V, exponent, temperature, noise, positions, ks)


# ---------------------------------------------------------------------------------------------
# format_support_table: every line, on hand-made data
# ---------------------------------------------------------------------------------------------
_TABLE_ROWS = [
    {"label": "tail", "framework": "TRL", "k": 1, "rel_bias": 0.5, "rel_grad_error": 0.125,
     "clamped": None},
    {"label": "tail", "framework": "TRL", "k": 8, "rel_bias": -0.25, "rel_grad_error": 0.0625,
     "clamped": None},
    {"label": "clamped", "framework": "verl", "k": 1, "rel_bias": -0.75, "rel_grad_error": 1.5,
     "clamped": 0.25},
    {"label": "clamped", "framework": "verl", "k": 8, "rel_bias": -0.0, "rel_grad_error": 0.5,
     "clamped": 0.0},
    {"label": "bound", "framework": "none", "k": 1, "rel_bias": 2.0, "rel_grad_error": None,
     "clamped": None},
    {"label": "bound", "framework": "none", "k": 8, "rel_bias": 1.0, "rel_grad_error": None,
     "clamped": None},
    {"label": "top-1", "framework": "TRL top-1", "k": 1, "rel_bias": -1.0,
     "rel_grad_error": 1.0, "clamped": None},
]


def test_the_table_line_by_line():
    # format_support_table 19, 21, 22, 23 (the separator), 39 (the framework), 67 (the cell),
    # 60 (- 0.0: a bias of -0.0 printed "-0.000")
    table = sp.format_support_table({"ks": [1, 8], "rows": _TABLE_ROWS}, ks=(1, 8))
    assert table.splitlines() == [
        "| choice | used by | k = 1 | k = 8 |",
        "| --- | --- | ---: | ---: |",
        "| tail | TRL | +0.500 / 0.125 | -0.250 / 0.062 |",
        "| clamped | verl | -0.750 / 1.500; clamped 0.25 | +0.000 / 0.500; clamped 0.00 |",
        "| bound | none | +2.000 | +1.000 |",
        "| top-1 | TRL top-1 | -1.000 / 1.000 |  |",
    ]


def test_the_table_refuses_a_k_that_no_row_has():
    # format_support_table 46 (a top-1 row asked for a k that is not in the data), 48 (a row
    # of two k's asked for a third)
    top1 = [r for r in _TABLE_ROWS if r["label"] == "top-1"]
    with _refused(ValueError, "k = 8 is not in the data (ks = [1])"):
        sp.format_support_table({"ks": [1], "rows": top1}, ks=(1, 8))
    with _refused(ValueError, "k = 64 is not in the data (ks = [1, 8, 64])"):
        sp.format_support_table({"ks": [1, 8, 64], "rows": _TABLE_ROWS[:2]}, ks=(1, 64))


# ---------------------------------------------------------------------------------------------
# Devices and warnings
# ---------------------------------------------------------------------------------------------
def test_tensors_are_created_on_the_inputs_device():
    # Under a meta default device with CPU inputs, a factory without device= lands on meta:
    # build_support 83, 86, 90, 93, 97, 100 (its buffers), _check_support 105, 108 (rows), 121,
    # 123 (slot), 188, 192 (the -inf fill), expected_sampled_divergence 62, 64 (x),
    # forward_kl_upper_bound 138, 141 (i)
    g = torch.Generator().manual_seed(9)
    s, t = torch.randn(2, 3, 6, generator=g, dtype=F64)
    support = build_support("union", 2, s, t)
    report, ids = torch.log_softmax(t, -1).topk(2)
    with torch.device("meta"):
        on_meta = (build_support("union", 2, s, t), support_divergence(s, support, beta=0.5),
                   expected_sampled_divergence(s, t, beta=0.5),
                   forward_kl_upper_bound(s, report, ids))
    built, value, expected, bound = on_meta
    assert all(x.device.type == "cpu" for x in (*built, value, expected, bound))
    assert all(torch.equal(a, b) for a, b in zip(built, support))
    assert torch.equal(value, support_divergence(s, support, beta=0.5))
    assert torch.equal(expected, expected_sampled_divergence(s, t, beta=0.5))
    assert torch.equal(bound, forward_kl_upper_bound(s, report, ids))


def test_the_bias_names_the_softmax_dimension():
    # _choice_loss 10, 12 (verl's report from F.log_softmax(teacher, None) or with no dim: the
    # same values on (P, V), with torch's "Implicit dimension choice" deprecation warning)
    student, teacher = zipf_pair(V=16, noise=1.0, seed=1)
    verl = next(c for c in CHOICES if c.loss == "verl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bias = support_bias(verl, 2, student[None], teacher[None])
    report, ids = F.log_softmax(teacher, -1).topk(2)
    assert torch.equal(bias["value"], sp.verl_forward_kl_topk(student[None], report[None],
                                                               ids[None]))


# ---------------------------------------------------------------------------------------------
# plot_support_bias: what the figure holds
# ---------------------------------------------------------------------------------------------
_KS = [1, 4, 32]


def _figure_data():
    """Rows by hand for every label of CHOICES: verl's fractions rise to 1 at the largest k, so
    that the third panel's top right holds data."""
    rows = []
    for n, choice in enumerate(CHOICES):
        top1 = choice.rule not in ("teacher_topk", "student_topk", "union")
        for j, k in enumerate([1] if top1 else _KS):
            verl = choice.loss == "verl"
            rows.append({"label": choice.label, "framework": choice.framework, "k": k,
                         "rel_bias": -0.1 * (n + 1) / (j + 1),
                         "rel_grad_error": None if choice.loss == "upper_bound"
                         else 0.05 * (n + 1) * (j + 1),
                         "clamped": [0.0, 0.5, 1.0][j] if verl else None,
                         "p_above_q": [0.25, 0.75, 1.0][j] if verl else None,
                         "lower_bound": True})
    return {"V": 64, "positions": 3, "ks": _KS, "rows": rows}


def test_the_figure_holds_its_data_styles_and_layout(tmp_path, monkeypatch):
    # one test draws the figure (about a second) and reads it: mutmut runs only the tests that
    # call plot_support_bias, so a module fixture would leave the other tests out
    import matplotlib.pyplot as plt

    data = _figure_data()
    captured = []
    monkeypatch.setattr(plt, "close", captured.append)
    sp.plot_support_bias(tmp_path / "s.svg", data)
    monkeypatch.undo()
    (fig,) = captured
    fig.canvas.draw()
    try:
        _check_size_and_shared_axis(fig)
        _check_lines(fig, data)
        _check_axes(fig)
        _check_legends_and_layout(fig)
    finally:
        plt.close(fig)


def test_the_default_data_is_the_study(tmp_path, monkeypatch):
    # plot_support_bias 2 (data=None drawn as None)
    import matplotlib.pyplot as plt

    data = _figure_data()
    monkeypatch.setattr(sp, "support_study", lambda: data)
    captured = []
    monkeypatch.setattr(plt, "close", captured.append)
    sp.plot_support_bias(tmp_path / "s.svg")
    monkeypatch.undo()
    (fig,) = captured
    assert fig.axes[2].get_xlabel() == "k (support size; V = 64, 3 positions)"
    plt.close(fig)


def _check_size_and_shared_axis(fig):
    # plot_support_bias 26, 30, 34 (the height), 27, 31, 35 (the k axis not shared)
    assert tuple(fig.get_size_inches()) == (7.0, 9.0)
    value, gradient, clamped = fig.axes
    shared = value.get_shared_x_axes()
    assert shared.joined(value, gradient) and shared.joined(value, clamped)


def _check_lines(fig, data):
    from matplotlib.colors import to_rgba

    value, gradient, clamped = fig.axes
    choices = {c.label: c for c in CHOICES}
    for axis, key in ((value, "rel_bias"), (gradient, "rel_grad_error"), (clamped, "clamped")):
        lines = [ln for ln in axis.get_lines() if ln.get_label() in choices]
        want = [c.label for c in CHOICES
                if next(r for r in data["rows"] if r["label"] == c.label)[key] is not None]
        assert [ln.get_label() for ln in lines] == want
        for line in lines:
            rows = [r for r in data["rows"] if r["label"] == line.get_label()]
            # plot_support_bias 170, 171, 182, 183 (the k's dropped from a panel)
            assert list(line.get_xdata()) == [r["k"] for r in rows]
            assert list(line.get_ydata()) == [r[key] for r in rows]
            if choices[line.get_label()].rule in ("teacher_topk", "student_topk", "union"):
                assert line.get_markersize() == 3.5  # 148, 153, 155
            else:
                # 122 to 124, 129 to 131, 135, 138: the large single markers, edged in black
                assert line.get_markersize() == 11
                assert to_rgba(line.get_markeredgecolor()) == to_rgba("black")
                assert line.get_markeredgewidth() == 0.6
    # 190 to 198, 206: the grey P > Q line of the third panel
    grey = [ln for ln in clamped.get_lines() if ln.get_label() not in choices]
    assert [ln.get_label() for ln in grey] == ["fraction with P > Q (a clamp needs it)"]
    (grey,) = grey
    verl = [r for r in data["rows"] if choices[r["label"]].loss == "verl"]
    assert list(grey.get_xdata()) == _KS and list(grey.get_ydata()) == [r["p_above_q"]
                                                                        for r in verl]
    assert to_rgba(grey.get_color()) == to_rgba("0.55")
    assert grey.get_marker() == "o" and grey.get_markersize() == 3.5
    # 211, 214 to 217, 220: one unlabelled line, the first panel's y = 0, black, width 0.6
    zero = [ln for ln in value.get_lines() if ln.get_label() not in choices]
    assert len(zero) == 1 and not [ln for ln in gradient.get_lines()
                                   if ln.get_label() not in choices]
    (zero,) = zero
    assert list(zero.get_ydata()) == [0.0, 0.0]
    assert to_rgba(zero.get_color()) == to_rgba("black") and zero.get_linewidth() == 0.6


def _check_axes(fig):
    value, gradient, clamped = fig.axes
    # 225, 226, 230, 231: symlog linear in [-1, 1], its linear part two decades wide
    scale = value.yaxis.get_transform()
    assert (scale.linthresh, scale.linscale) == (1.0, 2.0)
    # 256, 257, 259, 260, 264 to 268: the third panel's limits and label
    assert clamped.get_ylim() == (-0.02, 1.02)
    assert clamped.get_ylabel() == "verl: fraction of\npositions"
    # 279, 281, 282, 283: the major and the minor gridlines, on every axis
    for axis in fig.axes:
        for ticks in (axis.xaxis.get_major_ticks(), axis.xaxis.get_minor_ticks(),
                      axis.yaxis.get_major_ticks()):
            assert ticks and all(tick.gridline.get_visible() for tick in ticks)


def _extent(artist, fig):
    """The artist's drawn box in figure fractions."""
    return artist.get_window_extent(fig.canvas.get_renderer()).transformed(
        fig.transFigure.inverted())


def _check_legends_and_layout(fig):
    value, gradient, clamped = fig.axes
    # 275 (loc="best"): the third panel's legend in its upper right corner (its data fill the
    # top right, so "best" would put it elsewhere); the corner's pad is 0.4 font sizes
    box, panel = _extent(clamped.get_legend(), fig), clamped.get_position()
    assert 0 < panel.x1 - box.x1 < 0.02 and 0 < panel.y1 - box.y1 < 0.02
    # the figure legend: centred at the bottom, under the panels (290, 297: loc; 305, 306:
    # the anchor), in two columns (298, 304), with its spacing and handle length (293, 294,
    # 300, 301, 307, 308)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [c.label for c in CHOICES]
    box = _extent(legend, fig)
    assert abs((box.x0 + box.x1) / 2 - 0.5) < 0.01 and box.y0 < 0.02
    assert box.y1 <= min(ax.get_tightbbox(fig.canvas.get_renderer()).transformed(
        fig.transFigure.inverted()).y0 for ax in fig.axes)
    columns = {round(_extent(t, fig).x0, 3) for t in legend.get_texts()}
    assert len(columns) == 2
    assert (legend.columnspacing, legend.handlelength) == (1.0, 2.6)
    # 309 to 313: tight_layout in the rect (0, 0.165, 1, 1), which the panels fill (its pad
    # is 1.08 font sizes, about 0.02 of the figure)
    boxes = [ax.get_tightbbox(fig.canvas.get_renderer()).transformed(
        fig.transFigure.inverted()) for ax in fig.axes]
    x0, x1 = min(b.x0 for b in boxes), max(b.x1 for b in boxes)
    y0, y1 = min(b.y0 for b in boxes), max(b.y1 for b in boxes)
    assert 0 <= x0 < 0.03 and 0.97 < x1 <= 1 and 0.165 <= y0 < 0.2 and 0.97 < y1 <= 1


# ---------------------------------------------------------------------------------------------
# The run on the current code: NeMo-RL's references and loss, _truth's default, a tie at k = V
# ---------------------------------------------------------------------------------------------
# A teacher that cannot emit token 3, a student that can: KL(q || p) is finite, KL(p || q) +inf
_STUDENT = torch.tensor([[0.3, -0.2, 0.5, 0.1]], dtype=F64)
_TEACHER = torch.tensor([[0.0, 0.4, -0.3, -math.inf]], dtype=F64)


def _rows_kl(a, b):
    """KL(softmax(a) || softmax(b)) of one (1, V) row, in plain Python (+inf where b = 0 < a)."""
    p, q = torch.softmax(a[0], -1).tolist(), torch.softmax(b[0], -1).tolist()
    if any(x > 0 and y == 0 for x, y in zip(p, q)):
        return math.inf
    return _plain_kl(p, q)


@pytest.mark.parametrize("kl_type, student, teacher", [
    ("forward", _STUDENT, _TEACHER),  # the reverse KL is +inf
    ("reverse", _TEACHER, _STUDENT),  # the student cannot emit token 3: the forward is +inf
])
def test_a_nemo_kl_is_measured_against_that_kl_alone(kl_type, student, teacher):
    # _reference 13 (mixture True for "forward" and "reverse": 1 KL + 0 (other KL), and
    # 0 * inf = NaN is refused). The other KL is infinite; the reference is the finite one
    choice = next(c for c in sp.NEMO_CHOICES if c.kl_type == kl_type)
    a, b = (teacher, student) if kl_type == "forward" else (student, teacher)
    assert _rows_kl(b, a) == math.inf
    bias = support_bias(choice, 2, student, teacher)
    assert_matches_committed(bias["true"].item(), _rows_kl(a, b), rtol=1e-13,
                             why="a float64 sum of four terms against Python's")


@pytest.mark.parametrize("choice", [c for c in sp.NEMO_CHOICES if c.kl_type == "mixed"])
def test_a_mixed_reference_with_an_infinite_kl_is_refused(choice):
    # _truth 50 (true <= inf): w KL(q || p) + (1 - w) KL(p || q) is +inf here, but its gradient,
    # w times the forward KL's, is nonzero: only the test true < inf refuses it
    assert _rows_kl(_TEACHER, _STUDENT) < math.inf == _rows_kl(_STUDENT, _TEACHER)
    with pytest.raises(ValueError, match="^the full divergence and its gradient must be nonzero"):
        support_bias(choice, 2, _STUDENT, _TEACHER)


def test_the_truth_is_the_jsd_unless_a_mixture_is_asked():
    # _truth 1 (mixture=True by default): without mixture, _truth(student, teacher, beta) is
    # D_beta, here the JSD at beta = 0.5 by hand, not (KL(q || p) + KL(p || q)) / 2
    g = torch.Generator().manual_seed(10)
    s, t = torch.randn(2, 1, 5, generator=g, dtype=F64)
    true, _, _ = sp._truth(s, t, 0.5)
    p, q = torch.softmax(s[0], -1).tolist(), torch.softmax(t[0], -1).tolist()
    m = [(x + y) / 2 for x, y in zip(p, q)]
    assert_matches_committed(true.item(), (_plain_kl(q, m) + _plain_kl(p, m)) / 2, rtol=1e-12,
                             why="float64 sums of five terms against Python's")


@pytest.mark.parametrize("zero", [False, True])
def test_mixed_at_weight_one_does_not_read_an_infinite_reverse_kl(zero):
    # nemo_rl_topk_kl 145, 146, 148 (mixed at w = 1 computed as 1 forward + 0 reverse: 0 * inf
    # is NaN). The teacher's top-2 report gives slot 1 no mass: q~ = (1, 0), so the reverse KL
    # is +inf wherever the student has mass on slot 1; the forward KL is -log p~_0, with
    # p~ = (1/2, 1/2) renormalised or p_0 = 0.4 with zero_outside_topk
    student = torch.log(torch.tensor([0.4, 0.4, 0.2], dtype=F64))
    report = Support(torch.tensor([0, 1]), torch.tensor([True, True]),
                     torch.tensor([math.log(0.6), -math.inf], dtype=F64))
    got = sp.nemo_rl_topk_kl(student, report, kl_type="mixed", mixed_kl_weight=1.0,
                             zero_outside_topk=zero).item()
    assert_matches_committed(got, math.log(2.5 if zero else 2.0), rtol=1e-14,
                             why="one float64 log-probability difference")
    reverse = sp.nemo_rl_topk_kl(student, report, kl_type="reverse", zero_outside_topk=zero)
    assert reverse.item() == math.inf


@pytest.mark.parametrize("zero", [False, True])
def test_an_invalid_slot_is_read_by_neither_side_of_nemo_rls_loss(zero):
    # nemo_rl_topk_kl 51, 63 (an invalid slot filled with +inf, not -inf: log P or log Q is
    # +inf). Slot 2 is invalid (its teacher value 0.0, probability 1, is not read); the loss is
    # the docstring's on S = {0, 1}: q~ = (3/4, 1/4), p = (0.4, 0.4, 0.2), p~ = (1/2, 1/2)
    student = torch.log(torch.tensor([0.4, 0.4, 0.2], dtype=F64))
    report = Support(torch.tensor([0, 1, 2]), torch.tensor([True, True, False]),
                     torch.tensor([math.log(0.6), math.log(0.2), 0.0], dtype=F64))
    q = [0.75, 0.25]
    a = [0.4, 0.4] if zero else [0.5, 0.5]
    forward = sum(x * math.log(x / y) for x, y in zip(q, a))
    reverse = sum(y * math.log(y / x) for x, y in zip(q, a))
    if zero:
        reverse += 0.2 * (math.log(0.2) + 100.0)  # token 2 is off S: the teacher's e^-100
    for kl_type, want in (("forward", forward), ("reverse", reverse),
                          ("mixed", (forward + reverse) / 2)):
        got = sp.nemo_rl_topk_kl(student, report, kl_type=kl_type, zero_outside_topk=zero)
        assert_matches_committed(got.item(), want, rtol=1e-13,
                                 why="float64 sums of two or three terms against Python's")


def test_a_value_equal_to_the_divergence_is_a_lower_bound(monkeypatch):
    # support_study 156 (value < true): at k = V = 2 the tail (b) of the forward KL is the KL
    # itself, and with a teacher of one possible token (q = (1, 0)) both sums hold the single
    # term 1 (0 - log p_0), from the same log_softmax of the same student row, and zeros (the
    # capped tails give (-16.1) - (-16.1) = 0): the value equals the truth exactly, on any CPU
    pair = (torch.zeros(2, dtype=F64), torch.tensor([0.0, -math.inf], dtype=F64))
    monkeypatch.setattr(sp, "zipf_pair", lambda *args: pair)
    data = sp.support_study(V=2, positions=1, ks=[2], choices=CHOICES[:1])
    (row,) = data["rows"]
    assert row["lower_bound"] is True and row["rel_bias"] == 0.0
