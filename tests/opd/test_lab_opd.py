"""The OPD lab's tests: Tasks 1-3 (``reverse_kl_rewards``, ``opd_pg_loss``,
``full_vocab_reverse_kl``) and the identity that connects them.

This file is also the test file of the generated lab handout (``opd_literate.course.handout``),
where it imports from the lab folder; each test is marked with the task(s) it checks. Every expected
value comes from an independent computation: a hand-derived formula, a different torch routine
(``F.kl_div``), or an exact sum over the vocabulary.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from opd_literate.opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards

DOUBLE = torch.float64


def random_batch(B=3, T=4, V=5, seed=0, scale=1.0, dtype=DOUBLE):
    g = torch.Generator().manual_seed(seed)
    student = scale * torch.randn(B, T, V, generator=g, dtype=dtype)
    teacher = scale * torch.randn(B, T, V, generator=g, dtype=dtype)
    mask = torch.ones(B, T, dtype=dtype)
    mask[0, 2:] = 0  # a ragged batch: response 0 ends after two tokens
    mask[1, 3:] = 0
    return student, teacher, mask


def analytic_reverse_kl_grad(student_logits, teacher_logits):
    """d KL(p||q) / d z_j = p_j (log p_j - log q_j - KL), derived by hand."""
    p = F.softmax(student_logits, -1)
    log_ratio = F.log_softmax(student_logits, -1) - F.log_softmax(teacher_logits, -1)
    kl = (p * log_ratio).sum(-1, keepdim=True)
    return p * (log_ratio - kl)


# ------------------------------------------------------------------------------ Task 1
@pytest.mark.task(1)
class TestTask1Rewards:
    def test_values_and_zeros_where_masked(self):
        student_logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
        teacher_logp = torch.tensor([[-1.5, -0.25, -9.0], [-0.4, -0.2, -0.0]])
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        r = reverse_kl_rewards(student_logp, teacher_logp, mask)
        expected = torch.tensor([[-1.0, 0.75, 0.0], [-0.3, 0.0, 0.0]])
        torch.testing.assert_close(r, expected)
        assert (r[mask == 0] == 0).all()

    def test_no_gradient_attached(self):
        student_logp = torch.randn(2, 3, requires_grad=True)
        r = reverse_kl_rewards(student_logp, torch.randn(2, 3), torch.ones(2, 3))
        assert not r.requires_grad and r.grad_fn is None

    def test_padding_with_minus_inf_gives_exact_zero(self):
        student_logp = torch.tensor([[-0.5, -math.inf]])
        teacher_logp = torch.tensor([[-0.7, -math.inf]])
        r = reverse_kl_rewards(student_logp, teacher_logp, torch.tensor([[1.0, 0.0]]))
        assert r[0, 1].item() == 0.0 and torch.isfinite(r).all()

    def test_bool_mask_equals_float_mask(self):
        s, t = torch.randn(2, 3), torch.randn(2, 3)
        m = torch.tensor([[1, 1, 0], [1, 0, 0]])
        torch.testing.assert_close(
            reverse_kl_rewards(s, t, m.bool()), reverse_kl_rewards(s, t, m.float())
        )


# ------------------------------------------------------------------------------ Task 2
@pytest.mark.task(2)
class TestTask2PolicyGradientLoss:
    def test_gradient_is_minus_reward_times_mask_over_count(self):
        _, _, mask = random_batch()
        student_logp = torch.randn(3, 4, dtype=DOUBLE, requires_grad=True)
        rewards = torch.randn(3, 4, dtype=DOUBLE)
        opd_pg_loss(student_logp, rewards, mask).backward()
        torch.testing.assert_close(student_logp.grad, -rewards * mask / mask.sum())

    def test_loss_value(self):
        student_logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
        rewards = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
        # -(1 * -1 + 2 * -2 + 3 * -3) / 3 = 14 / 3
        assert opd_pg_loss(student_logp, rewards, mask).item() == pytest.approx(14 / 3)

    def test_no_gradient_reaches_rewards(self):
        student_logp = torch.randn(2, 3, requires_grad=True)
        rewards = torch.randn(2, 3, requires_grad=True)
        opd_pg_loss(student_logp, rewards, torch.ones(2, 3)).backward()
        assert rewards.grad is None
        assert student_logp.grad is not None

    def test_all_zero_mask_gives_zero_loss_and_finite_zero_gradient(self):
        student_logp = torch.randn(2, 3, requires_grad=True)
        loss = opd_pg_loss(student_logp, torch.randn(2, 3), torch.zeros(2, 3))
        loss.backward()
        assert loss.item() == 0.0
        assert torch.equal(student_logp.grad, torch.zeros(2, 3))

    def test_minus_inf_logp_in_padding_gives_no_nan(self):
        student_logp = torch.tensor([[-0.5, -math.inf]], requires_grad=True)
        rewards = torch.tensor([[1.0, math.inf]])
        loss = opd_pg_loss(student_logp, rewards, torch.tensor([[1.0, 0.0]]))
        loss.backward()
        assert loss.item() == pytest.approx(0.5)
        assert student_logp.grad.tolist() == [[-1.0, 0.0]]


# ------------------------------------------------------------------------------ Task 3
@pytest.mark.task(3)
class TestTask3FullVocabReverseKL:
    def test_matches_torch_kl_div(self):
        student, teacher, mask = random_batch()
        ours = full_vocab_reverse_kl(student, teacher, mask)
        # F.kl_div(input=log q, target=log p, log_target=True) = sum p (log p - log q)
        per_position = F.kl_div(
            F.log_softmax(teacher, -1), F.log_softmax(student, -1),
            reduction="none", log_target=True,
        ).sum(-1)
        reference = (per_position * mask).sum() / mask.sum()
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)

    def test_nonnegative_and_zero_when_equal(self):
        student, _, mask = random_batch(seed=3)
        assert full_vocab_reverse_kl(student, student.clone(), mask).item() == pytest.approx(
            0.0, abs=1e-14
        )
        # Adding a constant to a row of logits leaves the distribution unchanged.
        shifted = student + 7.5
        assert full_vocab_reverse_kl(student, shifted, mask).item() == pytest.approx(0, abs=1e-12)
        assert full_vocab_reverse_kl(*random_batch(seed=4)).item() > 0

    def test_autograd_equals_analytic_softmax_kl_gradient(self):
        student, teacher, mask = random_batch(seed=1)
        student.requires_grad_(True)
        teacher.requires_grad_(True)
        full_vocab_reverse_kl(student, teacher, mask).backward()
        expected = analytic_reverse_kl_grad(student.detach(), teacher.detach())
        expected = expected * mask[..., None] / mask.sum()
        torch.testing.assert_close(student.grad, expected, rtol=1e-12, atol=1e-14)
        assert teacher.grad is None  # the teacher is a constant

    def test_all_zero_mask(self):
        student, teacher, _ = random_batch()
        student.requires_grad_(True)
        loss = full_vocab_reverse_kl(student, teacher, torch.zeros(3, 4))
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(student.grad, torch.zeros_like(student))


# --------------------------------------------------------- the identity that makes OPD work
def enumerate_sampled_token_gradients(student_logits, teacher_logits):
    """Gradient of the Task-2 loss w.r.t. one state's logits, for every possible next token.

    Returns (V, V): row v is the gradient when the student sampled token v, computed with the
    lab functions and autograd.
    """
    V = student_logits.shape[-1]
    rows = []
    for v in range(V):
        z = student_logits.detach().clone().requires_grad_(True)
        student_logp = F.log_softmax(z, -1)[v].reshape(1, 1)
        teacher_logp = F.log_softmax(teacher_logits, -1)[v].reshape(1, 1)
        mask = torch.ones(1, 1, dtype=z.dtype)
        rewards = reverse_kl_rewards(student_logp, teacher_logp, mask)
        opd_pg_loss(student_logp, rewards, mask).backward()
        rows.append(z.grad)
    return torch.stack(rows)


@pytest.mark.task(2)
def test_expected_policy_gradient_with_hand_rewards_is_the_analytic_kl_gradient():
    """Task 2 alone: with the rewards log q(v) - log p(v) written out here (not Task 1's), the
    loss's gradient averaged over the sampled token v ~ p is the analytic reverse-KL gradient."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, generator=g, dtype=DOUBLE) * 2
    zt = torch.randn(6, generator=g, dtype=DOUBLE) * 2
    p, mean = F.softmax(z, -1), torch.zeros(6, dtype=DOUBLE)
    for v in range(6):
        zv = z.clone().requires_grad_(True)
        student_logp = F.log_softmax(zv, -1)[v].reshape(1, 1)
        rewards = (F.log_softmax(zt, -1)[v] - student_logp).detach()
        opd_pg_loss(student_logp, rewards, torch.ones(1, 1, dtype=DOUBLE)).backward()
        mean += p[v] * zv.grad
    torch.testing.assert_close(mean, analytic_reverse_kl_grad(z, zt), rtol=1e-12, atol=1e-14)


@pytest.mark.task(1, 2, 3)
@pytest.mark.parametrize("seed", range(5))
def test_expected_sampled_token_gradient_equals_full_vocab_gradient(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(7, generator=g, dtype=DOUBLE) * 2
    zt = torch.randn(7, generator=g, dtype=DOUBLE) * 2
    per_token = enumerate_sampled_token_gradients(z, zt)  # (V, V)
    p = F.softmax(z, -1)
    expected_over_student_token = (p[:, None] * per_token).sum(0)

    z_full = z.clone().requires_grad_(True)
    full_vocab_reverse_kl(z_full.reshape(1, 1, -1), zt.reshape(1, 1, -1),
                          torch.ones(1, 1)).backward()
    torch.testing.assert_close(expected_over_student_token, z_full.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.task(1, 2, 3)
def test_monte_carlo_sampled_token_gradient_agrees_within_variance():
    """Average N sampled-token gradients; tolerance = 5 exact standard errors per coordinate."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(6, generator=g, dtype=DOUBLE)
    zt = torch.randn(6, generator=g, dtype=DOUBLE)
    per_token = enumerate_sampled_token_gradients(z, zt)
    p = F.softmax(z, -1)
    exact_mean = (p[:, None] * per_token).sum(0)
    exact_var = (p[:, None] * (per_token - exact_mean) ** 2).sum(0)  # per coordinate
    assert (exact_var > 0).all()  # the sampled-token estimator is noisy...

    N = 20_000
    tokens = torch.multinomial(p, N, replacement=True, generator=g)
    mc_mean = per_token[tokens].mean(0)
    tolerance = 5 * torch.sqrt(exact_var / N)  # P(|z| > 5) < 6e-7 per coordinate
    assert ((mc_mean - exact_mean).abs() < tolerance).all()

    # ...while the full-vocabulary gradient at this state is its mean, with no variance.
    z_full = z.clone().requires_grad_(True)
    full_vocab_reverse_kl(z_full.reshape(1, 1, -1), zt.reshape(1, 1, -1),
                          torch.ones(1, 1)).backward()
    torch.testing.assert_close(exact_mean, z_full.grad, rtol=1e-12, atol=1e-14)
