"""The variants of ``opd_literate.opd`` beyond the lab's three tasks.

k1/k2/k3 gradient facts, forward KL and generalized JSD, ``-inf`` logits and half precision,
discounts and reductions, and bad input. Expected values come from independent computations.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from test_opd import DOUBLE, analytic_reverse_kl_grad, random_batch

from opd_literate.opd import (
    REDUCTIONS,
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
    sampled_token_opd_loss,
)


# ------------------------------------------------------------------- k1, k2, k3 gradients
def _grad_of(fn, z):
    z = z.detach().clone().requires_grad_(True)
    fn(z).backward()
    return z.grad


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


# ------------------------------------------------------------------- discount, reductions
class TestDiscountAndReductions:
    def test_discounted_returns_by_hand(self):
        r = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0]])
        mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        out = discounted_returns(r, mask, 0.5)
        expected = torch.tensor([[1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 0.0],
                                 [4 + 2.5 + 1.5 + 0.875, 5 + 3 + 1.75, 6 + 3.5, 7.0]])
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(discounted_returns(r, mask, 0.0), r * mask)

    def test_gamma_zero_token_mean_is_the_lab_loss(self):
        student, teacher, mask = random_batch(seed=14)
        s_logp = F.log_softmax(student, -1)[..., 0].clone().requires_grad_(True)
        t_logp = F.log_softmax(teacher, -1)[..., 0]
        lab = opd_pg_loss(s_logp, reverse_kl_rewards(s_logp, t_logp, mask), mask)
        ours = sampled_token_opd_loss(s_logp, t_logp, mask, gamma=0.0)
        torch.testing.assert_close(ours, lab, rtol=0, atol=0)

    def test_gamma_one_is_unbiased_for_the_sequence_reverse_kl_gradient(self):
        """Two-step toy LM, enumerated: E[grad of gamma=1 loss] = grad of sequence KL."""
        g = torch.Generator().manual_seed(15)
        V = 3
        theta = torch.randn(1 + V, V, generator=g, dtype=DOUBLE)  # row 0: first step; 1+y1
        phi = torch.randn(1 + V, V, generator=g, dtype=DOUBLE)

        def seq_kl(th):
            lp, lq = F.log_softmax(th, -1), F.log_softmax(phi, -1)
            total = 0
            for y1 in range(V):
                for y2 in range(V):
                    logp = lp[0, y1] + lp[1 + y1, y2]
                    total = total + logp.exp() * (logp - lq[0, y1] - lq[1 + y1, y2])
            return total

        true_grad = _grad_of(seq_kl, theta)
        expected_grad = torch.zeros_like(theta)
        lp = F.log_softmax(theta, -1).detach()
        for y1 in range(V):
            for y2 in range(V):
                th = theta.clone().requires_grad_(True)
                l_s = F.log_softmax(th, -1)
                l_t = F.log_softmax(phi, -1)
                s = torch.stack([l_s[0, y1], l_s[1 + y1, y2]]).reshape(1, 2)
                t = torch.stack([l_t[0, y1], l_t[1 + y1, y2]]).reshape(1, 2)
                sampled_token_opd_loss(s, t, torch.ones(1, 2), gamma=1.0,
                                       reduction="sum").backward()
                expected_grad += (lp[0, y1] + lp[1 + y1, y2]).exp() * th.grad
        torch.testing.assert_close(expected_grad, true_grad, rtol=1e-12, atol=1e-14)

    def test_reductions_on_a_ragged_mask(self):
        loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0],
                             [5.0, 5.0, 5.0, 5.0]])
        mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
        # tokens: 1+2+3+4 = 10, 10+20 = 30, none
        assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(40 / 6)
        assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(40 / 3)
        assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(
            (10 / 4 + 30 / 2 + 0) / 3
        )
        assert aggregate_loss(loss, mask, "sum").item() == pytest.approx(40.0)
        # a constant 1 / T (T = 4, the padded length), not 1 / B nor 1 / (tokens)
        assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10.0)
        # the fully masked third sequence counts in 1 / B (verl's agg_loss would divide by 2)
        assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() != pytest.approx(20.0)

    @pytest.mark.parametrize("reduction", REDUCTIONS)
    def test_masked_tokens_never_contribute(self, reduction):
        loss = torch.tensor([[1.0, 2.0, math.inf], [3.0, math.nan, -math.inf]],
                            requires_grad=True)
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        out = aggregate_loss(loss, mask, reduction)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(loss.grad).all()
        assert (loss.grad[mask == 0] == 0).all()
        assert aggregate_loss(loss.detach(), torch.zeros(2, 3), reduction).item() == 0.0


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
