"""The divergences of ``opd_literate.opd`` beyond the lab's three tasks: the k1/k2/k3 estimators
and their expected gradients, forward KL and the generalized JSD, ``-inf`` logits and half
precision, and bad input. Expected values come from independent computations.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from opd_literate import opd
from opd_literate.opd import (
    aggregate_loss,
    discounted_returns,
    expected_kl_estimator_gradient,
    forward_kl,
    forward_kl_per_position,
    full_vocab_reverse_kl,
    generalized_jsd,
    generalized_jsd_per_position,
    kl_estimator,
    opd_pg_loss,
    reverse_kl_per_position,
    reverse_kl_rewards,
)
from tests.opd._inputs import ONES, D, _grad_of, _kl, _logits, _logp, _softmax_logs
from tests.opd.test_lab_opd import DOUBLE, analytic_reverse_kl_grad, random_batch

# ------------------------------------------------------------------- k1, k2, k3 gradients


@pytest.mark.parametrize("seed", range(4))
def test_k_estimator_gradient_facts(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 3, 6, generator=g, dtype=DOUBLE)
    zt = torch.randn(2, 3, 6, generator=g, dtype=DOUBLE)
    ones = torch.ones(2, 3, dtype=DOUBLE)
    n = ones.sum()
    grad_reverse = _grad_of(lambda x: full_vocab_reverse_kl(x, zt, ones) * n, z)
    grad_forward = _grad_of(lambda x: forward_kl(x, zt, ones) * n, z)

    def expected(kind, mode):
        return expected_kl_estimator_gradient(z, zt, kind, mode)

    tol = dict(rtol=1e-10, atol=1e-13)
    # as a loss
    torch.testing.assert_close(expected("k1", "loss"), torch.zeros_like(z), **tol)
    torch.testing.assert_close(expected("k2", "loss"), grad_reverse, **tol)
    torch.testing.assert_close(expected("k3", "loss"), grad_forward, **tol)
    # as a reward (cost in a REINFORCE surrogate): only k1 gives the reverse-KL gradient
    torch.testing.assert_close(expected("k1", "reward"), grad_reverse, **tol)
    # k3's value has mean KL(p||q); its score-function term misses E[grad k3] = grad forward KL
    torch.testing.assert_close(expected("k3", "reward"), grad_reverse - grad_forward, **tol)
    assert (expected("k2", "reward") - grad_reverse).abs().max() > 1e-3


def test_k_estimator_values_are_unbiased_for_k1_k3():
    g = torch.Generator().manual_seed(5)
    z, zt = torch.randn(8, generator=g, dtype=DOUBLE), torch.randn(8, generator=g, dtype=DOUBLE)
    log_p, log_q = F.log_softmax(z, -1), F.log_softmax(zt, -1)
    p = log_p.exp()
    true_kl = (p * (log_p - log_q)).sum()
    for kind in ("k1", "k3"):
        assert (p * kl_estimator(log_p, log_q, kind)).sum().item() == pytest.approx(
            true_kl.item(), abs=1e-14
        )
    k2_mean = (p * kl_estimator(log_p, log_q, "k2")).sum()
    assert k2_mean.item() == pytest.approx((p * 0.5 * (log_p - log_q) ** 2).sum().item())
    assert (kl_estimator(log_p, log_q, "k3") >= 0).all()


# ---------------------------------------------------------------------- forward KL, JSD
class TestDivergences:
    def test_forward_kl_matches_kl_div(self):
        student, teacher, mask = random_batch(seed=2)
        per_position = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1),
                                reduction="none", log_target=True).sum(-1)
        reference = (per_position * mask).sum() / mask.sum()
        torch.testing.assert_close(forward_kl(student, teacher, mask), reference,
                                   rtol=1e-12, atol=1e-14)

    def test_forward_kl_gradient_is_p_minus_q(self):
        student, teacher, _ = random_batch(seed=6)
        ones = torch.ones(3, 4, dtype=DOUBLE)
        grad = _grad_of(lambda x: forward_kl(x, teacher, ones), student)
        expected = (F.softmax(student, -1) - F.softmax(teacher, -1)) / ones.sum()
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)

    def test_jsd_endpoints_are_exact(self):
        student, teacher, mask = random_batch(seed=7)

        def kl_div_mean(a, b):  # KL(softmax a || softmax b), token-mean, by F.kl_div
            per = F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1),
                           reduction="none", log_target=True).sum(-1)
            return (per * mask).sum() / mask.sum()

        torch.testing.assert_close(generalized_jsd(student, teacher, mask, beta=0.0),
                                   kl_div_mean(teacher, student), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(generalized_jsd(student, teacher, mask, beta=1.0),
                                   kl_div_mean(student, teacher), rtol=1e-12, atol=1e-14)

    def test_jsd_discontinuity_and_normalized_continuity(self):
        student, teacher, mask = random_batch(seed=8)
        fwd = forward_kl(student, teacher, mask).item()
        rev = full_vocab_reverse_kl(student, teacher, mask).item()
        eps = 1e-7
        near0 = generalized_jsd(student, teacher, mask, beta=eps).item()
        near1 = generalized_jsd(student, teacher, mask, beta=1 - eps).item()
        # The plain formula tends to 0, far from the endpoint values.
        assert near0 < 1e-5 < fwd and near1 < 1e-5 < rev
        # First order: JSD_beta ~ beta * forward KL and (1 - beta) * reverse KL.
        assert near0 / eps == pytest.approx(fwd, rel=1e-4)
        assert near1 / eps == pytest.approx(rev, rel=1e-4)
        n0 = generalized_jsd(student, teacher, mask, beta=eps, normalize=True).item()
        n1 = generalized_jsd(student, teacher, mask, beta=1 - eps, normalize=True).item()
        assert n0 == pytest.approx(fwd, rel=1e-4) and n1 == pytest.approx(rev, rel=1e-4)

    def test_jsd_matches_direct_probability_space_formula(self):
        student, teacher, _ = random_batch(seed=9)
        beta = 0.3
        p, q = F.softmax(student, -1), F.softmax(teacher, -1)
        m = beta * q + (1 - beta) * p
        direct = beta * (q * (q / m).log()).sum(-1) + (1 - beta) * (p * (p / m).log()).sum(-1)
        torch.testing.assert_close(
            generalized_jsd_per_position(student, teacher, beta=beta), direct,
            rtol=1e-12, atol=1e-14,
        )

    def test_jsd_half_is_symmetric_and_bounded(self):
        student, teacher, mask = random_batch(seed=10, scale=20.0)
        a = generalized_jsd_per_position(student, teacher, beta=0.5)
        b = generalized_jsd_per_position(teacher, student, beta=0.5)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert (a <= math.log(2) + 1e-12).all()


# -------------------------------------------------------------- -inf logits, half precision
class TestInfiniteLogitsAndPrecision:
    def test_student_zero_probability_entries_contribute_zero_without_nan_grad(self):
        inf = math.inf
        student = torch.tensor([[[0.0, 0.0, -inf]]], dtype=DOUBLE, requires_grad=True)
        teacher = torch.tensor([[[0.0, math.log(3.0), -inf]]], dtype=DOUBLE)
        loss = full_vocab_reverse_kl(student, teacher, torch.ones(1, 1))
        loss.backward()
        # p = (1/2, 1/2, 0), q = (1/4, 3/4, 0): KL = 0.5 log 2 + 0.5 log(2/3)
        assert loss.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
        assert torch.isfinite(student.grad).all()
        assert student.grad[0, 0, 2].item() == 0.0
        expected = analytic_reverse_kl_grad(
            torch.tensor([0.0, 0.0]), torch.tensor([0.0, math.log(3.0)])
        ).to(DOUBLE)
        torch.testing.assert_close(student.grad[0, 0, :2], expected, rtol=1e-7, atol=1e-9)

    def test_teacher_zero_where_student_positive_is_infinite(self):
        student = torch.zeros(1, 1, 3)
        teacher = torch.tensor([[[0.0, 0.0, -math.inf]]])
        assert reverse_kl_per_position(student, teacher).item() == math.inf
        # the forward KL does not care: the teacher never says entry 3
        assert math.isfinite(forward_kl_per_position(student, teacher).item())

    def test_huge_logits_stay_finite(self):
        student, teacher, mask = random_batch(seed=12, scale=1e4, dtype=torch.float32)
        student.requires_grad_(True)
        loss = full_vocab_reverse_kl(student, teacher, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
        assert torch.isfinite(generalized_jsd(student, teacher, mask)).all()

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_precision_is_computed_in_float32_and_never_negative(self, dtype):
        student, _, mask = random_batch(seed=13, V=50, dtype=torch.float32)
        teacher = student + 0.05 * torch.randn_like(student)  # nearly equal: the hard case
        s, t = student.to(dtype), teacher.to(dtype)
        per_position = reverse_kl_per_position(s, t)
        assert per_position.dtype == torch.float32
        assert (per_position >= 0).all()
        # Independent reference: F.kl_div in float64 on the same (rounded) half inputs.
        s64, t64 = s.double(), t.double()
        reference = F.kl_div(F.log_softmax(t64, -1), F.log_softmax(s64, -1),
                             reduction="none", log_target=True).sum(-1)
        # float32 computation: a few ulps of log-probs of size ~5, times V terms
        torch.testing.assert_close(per_position.double(), reference, rtol=1e-4, atol=2e-5)
        # ...while the same sum done in the half dtype itself is far off (why we upcast)
        in_half = (F.softmax(s, -1) * (F.log_softmax(s, -1) - F.log_softmax(t, -1))).sum(-1)
        assert (in_half.double() - reference).abs().max() > 20 * 2e-5
        assert full_vocab_reverse_kl(s, t, mask).item() >= 0

    def test_normalized_jsd_of_equal_distributions_is_zero_at_tiny_beta_in_float32(self):
        p = torch.tensor([[[0.0, 1.0, 2.0]]])
        ones = torch.ones(1, 1)
        for beta in (1e-6, 1e-9, 1 - 1e-6):
            assert generalized_jsd(p, p, ones, beta=beta, normalize=True).item() < 1e-6
        # and the endpoint limit is right in float32: forward KL at beta -> 0, by hand
        q = torch.zeros(1, 1, 3)
        lq, lp = math.log(1 / 3), F.log_softmax(p, -1)[0, 0]
        forward = sum(math.exp(lq) * (lq - lp[v].item()) for v in range(3))
        got = generalized_jsd(p, q, ones, beta=1e-6, normalize=True).item()
        assert got == pytest.approx(forward, rel=1e-5)


# ---------------------------------------------------------------------------- bad input
class TestBadInput:
    def test_shape_mismatch_student_teacher(self):
        with pytest.raises(ValueError, match=r"teacher_logp must have the same shape .*\(2, 3\)"):
            reverse_kl_rewards(torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3))

    def test_mask_shape_mismatch_is_not_broadcast(self):
        with pytest.raises(ValueError, match=r"mask must have the shape .*\(2, 3\), got \(1, 3\)"):
            opd_pg_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(1, 3))

    def test_vocabulary_mismatch(self):
        with pytest.raises(ValueError, match="vocabulary size .*V = 5.*got V = 6"):
            full_vocab_reverse_kl(torch.zeros(1, 2, 5), torch.zeros(1, 2, 6), torch.ones(1, 2))

    def test_wrong_ndim(self):
        with pytest.raises(ValueError, match=r"student_logits must have 3 dimensions.*\(2, 5\)"):
            full_vocab_reverse_kl(torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(2))

    def test_integer_dtype(self):
        with pytest.raises(TypeError, match="student_logp must have a floating dtype"):
            reverse_kl_rewards(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3),
                               torch.ones(2, 3))

    def test_not_a_tensor(self):
        with pytest.raises(TypeError, match="rewards must be a torch.Tensor, got list"):
            opd_pg_loss(torch.zeros(1, 2), [[0.0, 0.0]], torch.ones(1, 2))

    @pytest.mark.parametrize("bad", [0.5, 2.0, -1.0])
    def test_mask_values_outside_zero_one(self, bad):
        mask = torch.ones(2, 3)
        mask[1, 1] = bad
        with pytest.raises(ValueError, match=f"mask values must be 0 or 1, found {bad}"):
            reverse_kl_rewards(torch.zeros(2, 3), torch.zeros(2, 3), mask)

    def test_bad_beta_gamma_reduction_kind(self):
        z = torch.zeros(1, 1, 3)
        with pytest.raises(ValueError, match="beta must be <= 1.0, got 1.5"):
            generalized_jsd(z, z, torch.ones(1, 1), beta=1.5)
        with pytest.raises(ValueError, match="beta must be a finite number, got nan"):
            generalized_jsd(z, z, torch.ones(1, 1), beta=float("nan"))
        with pytest.raises(ValueError, match="gamma must be >= 0.0, got -0.1"):
            discounted_returns(torch.zeros(1, 2), torch.ones(1, 2), -0.1)
        with pytest.raises(ValueError, match="reduction must be one of"):
            aggregate_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean")
        with pytest.raises(ValueError, match="kind must be one of"):
            kl_estimator(torch.zeros(2), torch.zeros(2), "k4")


# Found by mutation testing (docs/mutation.md): error messages matched in full, so that each
# names the right argument; defaults checked against values computed here in float64.










# (name, call taking the arguments by name, the valid arguments)
TOKEN = {"student_logp": _logp(seed=1), "teacher_logp": _logp(seed=2), "mask": ONES}


LOGITS = {"student_logits": _logits(seed=1), "teacher_logits": _logits(seed=2), "mask": ONES}


FUNCTIONS = {
    "reverse_kl_rewards": (lambda a: opd.reverse_kl_rewards(
        a["student_logp"], a["teacher_logp"], a["mask"]), TOKEN),
    "sampled_token_opd_loss": (lambda a: opd.sampled_token_opd_loss(
        a["student_logp"], a["teacher_logp"], a["mask"]), TOKEN),
    "opd_pg_loss": (lambda a: opd.opd_pg_loss(a["student_logp"], a["rewards"], a["mask"]),
                    {"student_logp": _logp(seed=1), "rewards": _logp(seed=2), "mask": ONES}),
    "full_vocab_reverse_kl": (lambda a: opd.full_vocab_reverse_kl(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "reverse_kl_per_position": (lambda a: opd.reverse_kl_per_position(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "forward_kl": (lambda a: opd.forward_kl(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "forward_kl_per_position": (lambda a: opd.forward_kl_per_position(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "generalized_jsd": (lambda a: opd.generalized_jsd(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "generalized_jsd_per_position": (lambda a: opd.generalized_jsd_per_position(
        a["student_logits"], a["teacher_logits"], mask=a["mask"]), LOGITS),
    "discounted_returns": (lambda a: opd.discounted_returns(a["rewards"], a["mask"], 0.5),
                           {"rewards": _logp(seed=1), "mask": ONES}),
    "aggregate_loss": (lambda a: opd.aggregate_loss(a["per_token_loss"], a["mask"]),
                       {"per_token_loss": _logp(seed=1), "mask": ONES}),
}


def _cases():
    """Every tensor argument of every function, each broken in every way a check catches."""
    for fn_name, (_call, args) in FUNCTIONS.items():
        names = [n for n in args if n != "mask"]
        first = names[0]
        shape = tuple(args[first].shape)
        for name in names:
            x = args[name]
            yield fn_name, name, "int", x.to(torch.int64), TypeError, (
                f"{name} must have a floating dtype, got torch.int64")
            yield fn_name, name, "list", x.tolist(), TypeError, (
                f"{name} must be a torch.Tensor, got list")
            bigger = x[..., None]
            yield fn_name, name, "ndim", bigger, ValueError, (
                f"{name} must have {x.ndim} dimensions, got shape {tuple(bigger.shape)} "
                f"({bigger.ndim} dimensions)")
        for name in names[1:]:
            other = torch.cat([args[name], args[name][:, :1]], dim=1)
            yield fn_name, name, "shape", other, ValueError, (
                f"{name} must have the same shape as {first} {shape}, got {tuple(other.shape)}")
        like = first + ("[..., 0]" if args[first].ndim == 3 else "")
        yield fn_name, "mask", "shape", torch.ones(2, 4), ValueError, (
            f"mask must have the shape of {like} {shape[:2]}, got (2, 4)")


CASES = list(_cases())


@pytest.mark.parametrize("fn_name, name, how, bad, error, message", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_every_error_names_its_argument(fn_name, name, how, bad, error, message):
    call, args = FUNCTIONS[fn_name]
    call(args)  # the valid arguments pass
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        call({**args, name: bad})


def test_ndim_message_of_a_three_d_logits_pair():
    # 4-d teacher logits: the teacher's own ndim check speaks first
    with pytest.raises(ValueError, match=r"^teacher_logits must have 3 dimensions, got shape "
                       r"\(2, 3, 4, 1\) \(4 dimensions\)$"):
        opd.full_vocab_reverse_kl(LOGITS["student_logits"], LOGITS["teacher_logits"][..., None],
                                  ONES)


@pytest.mark.parametrize("call, message", [
    (lambda: opd.full_vocab_reverse_kl(_logits(V=4), _logits(V=5), ONES),
     r"teacher_logits must have the vocabulary size of student_logits \(V = 4\), got V = 5; "
     "student and teacher must share one tokenizer"),
    (lambda: opd.forward_kl(_logits(V=0), _logits(V=0), ONES),
     r"student_logits must have a vocabulary of at least 1 entry, got shape \(2, 3, 0\) "
     r"\(V = 0\)"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits(), "k1", "grad"),
     "mode must be 'loss' or 'reward', got 'grad'"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits(), "k4"),
     r"kind must be one of \('k1', 'k2', 'k3'\), got 'k4'"),
    (lambda: opd.expected_kl_estimator_gradient(torch.tensor(1.0, dtype=D),
                                                torch.tensor(1.0, dtype=D)),
     "student_logits must have a vocabulary axis, got a 0-d tensor"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits(V=5)),
     r"teacher_logits must have the same shape as student_logits \(2, 3, 4\), got \(2, 3, 5\)"),
    (lambda: opd.kl_estimator(_logp(), _logp(), "K1"),
     r"kind must be one of \('k1', 'k2', 'k3'\), got 'K1'"),
    (lambda: opd.kl_estimator(_logp(), _logp()[:, :2]),
     r"teacher_logp must have the same shape as student_logp \(2, 3\), got \(2, 2\)"),
    (lambda: opd.kl_estimator(_logp().long(), _logp()),
     "student_logp must have a floating dtype, got torch.int64"),
    (lambda: opd.kl_estimator(_logp(), _logp().long()),
     "teacher_logp must have a floating dtype, got torch.int64"),
    (lambda: opd.expected_kl_estimator_gradient(_logits().long(), _logits()),
     "student_logits must have a floating dtype, got torch.int64"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits().long()),
     "teacher_logits must have a floating dtype, got torch.int64"),
    (lambda: opd.aggregate_loss(_logp(), ONES, "mean"),
     r"reduction must be one of \('token-mean', 'seq-mean-token-sum', "),
    (lambda: opd.sampled_token_opd_loss(_logp(), _logp(), ONES, reduction="mean"),
     r"reduction must be one of \('token-mean', 'seq-mean-token-sum', "),
    (lambda: opd.discounted_returns(_logp(), ONES, 1.5), "gamma must be <= 1.0, got 1.5"),
    (lambda: opd.discounted_returns(_logp(), ONES, -0.5), "gamma must be >= 0.0, got -0.5"),
    (lambda: opd.generalized_jsd_per_position(_logits(), _logits(), beta=-0.1),
     "beta must be >= 0.0, got -0.1"),
    (lambda: opd.generalized_jsd_per_position(_logits(), _logits(), beta=1.1),
     "beta must be <= 1.0, got 1.1"),
    (lambda: opd.generalized_jsd(_logits(), _logits(), ONES, beta=float("nan")),
     "beta must be a finite number, got nan"),
    (lambda: opd.generalized_jsd_per_position(_logits(), _logits(), normalize=1),
     "normalize must be a bool, got int 1"),
    (lambda: opd.reverse_kl_per_position(_logits(), _logits(), temperature=0.0),
     "temperature must be > 0, got 0.0"),
    (lambda: opd.forward_kl(_logits(), _logits(), ONES, temperature=float("inf")),
     "temperature must be a finite number, got inf"),
])
def test_messages_in_full(call, message):
    with pytest.raises((ValueError, TypeError), match="^" + message):
        call()


# -------------------------------------------------------------------------------------------
# Defaults, against float64 formulas
# -------------------------------------------------------------------------------------------




def test_kl_estimator_default_is_k1_and_each_kind_is_its_formula():
    s, t = _logp(seed=1), _logp(seed=2)
    d = s - t
    torch.testing.assert_close(opd.kl_estimator(s, t), d, rtol=0, atol=0)
    torch.testing.assert_close(opd.kl_estimator(s, t, "k2"), d**2 / 2)
    torch.testing.assert_close(opd.kl_estimator(s, t, "k3"), torch.exp(-d) - 1 + d)


def test_jsd_default_beta_is_one_half():
    s, t = _logits(seed=1), _logits(seed=2)
    log_p, log_q = _softmax_logs(s), _softmax_logs(t)
    log_m = torch.log(0.5 * log_p.exp() + 0.5 * log_q.exp())
    jsd = 0.5 * _kl(log_q, log_m) + 0.5 * _kl(log_p, log_m)
    torch.testing.assert_close(opd.generalized_jsd_per_position(s, t), jsd)
    torch.testing.assert_close(opd.generalized_jsd(s, t, ONES), jsd.mean())


def test_expected_gradient_defaults_are_k1_and_loss():
    s, t = _logits(seed=1), _logits(seed=2)
    torch.testing.assert_close(opd.expected_kl_estimator_gradient(s, t),
                               opd.expected_kl_estimator_gradient(s, t, "k1", "loss"), rtol=0,
                               atol=0)
    # k1 as a loss has expected gradient 0: E_p[grad log p] = 0 (the score has mean zero)
    assert opd.expected_kl_estimator_gradient(s, t).abs().max() < 1e-14
    # k1 as a reward (REINFORCE) gives the gradient of KL(p || q)
    s_var = s.clone().requires_grad_(True)
    _kl(_softmax_logs(s_var), _softmax_logs(t)).sum().backward()
    torch.testing.assert_close(opd.expected_kl_estimator_gradient(s, t, "k1", "reward"),
                               s_var.grad)


# -------------------------------------------------------------------------------------------
# Mixed precision: the promoted dtype
# -------------------------------------------------------------------------------------------
def test_mixed_precision_computes_in_the_wider_dtype():
    s32, t64 = _logits(seed=1, dtype=torch.float32), _logits(seed=2)
    want = _kl(_softmax_logs(s32.to(D)), _softmax_logs(t64))
    for got in (opd.reverse_kl_per_position(s32, t64), opd.forward_kl_per_position(t64, s32)):
        assert got.dtype == D
    torch.testing.assert_close(opd.reverse_kl_per_position(s32, t64), want, rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(opd.full_vocab_reverse_kl(s32, t64, ONES), want.mean(),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_masked_jsd_positions_are_exactly_zero(beta):
    s, t = _logits(V=7, seed=3), _logits(V=7, seed=4)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    got = opd.generalized_jsd_per_position(s, t, beta=beta, mask=mask)
    assert (got[mask == 0] == 0).all() and (got[mask == 1] > 0).all()


@pytest.mark.parametrize("student, teacher", [(torch.float32, D), (D, torch.float32),
                                              (torch.float16, torch.float16)])
def test_kl_estimators_compute_in_the_promoted_dtype(student, teacher):
    s, t = _logp(seed=1).to(student), _logp(seed=2).to(teacher)
    want_dtype = D if D in (student, teacher) else torch.float32
    d = s.to(D) - t.to(D)  # exact: float16/32 values are float64 values
    for kind, value in (("k1", d), ("k2", d**2 / 2), ("k3", torch.expm1(-d) + d)):
        got = opd.kl_estimator(s, t, kind)
        assert got.dtype == want_dtype
        tol = 1e-15 if want_dtype == D else 1e-6
        torch.testing.assert_close(got.to(D), value, rtol=tol, atol=tol)
    zs, zt = _logits(seed=1, dtype=student), _logits(seed=2, dtype=teacher)
    for kind in ("k1", "k2", "k3"):
        got = opd.expected_kl_estimator_gradient(zs, zt, kind, "reward")
        assert got.dtype == want_dtype
        want = opd.expected_kl_estimator_gradient(zs.to(D), zt.to(D), kind, "reward")
        tol = 1e-14 if want_dtype == D else 1e-6
        torch.testing.assert_close(got.to(D), want, rtol=tol, atol=tol)
