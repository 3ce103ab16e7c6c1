"""The OPD lab's hidden tests: the Gradescope autograder runs them (``Lab.hidden_tests``), the
student's folder does not hold them. They check what each task's hint asks beyond the visible
tests: half precision computed in float32, padding that holds ``-inf`` or NaN, large logits.

As with ``test_lab_opd.py``, the lab's copy imports from the folder; every expected value is a
float64 computation written out here.
"""

import math

import pytest
import torch

from opd_literate.opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards

DOUBLE = torch.float64


def reference_reverse_kl(student_logits, teacher_logits, mask):
    """sum_{b,t} mask * KL(p || q) / max(sum mask, 1), in float64, from log_softmax."""
    log_p = torch.log_softmax(student_logits.to(DOUBLE), -1)
    log_q = torch.log_softmax(teacher_logits.to(DOUBLE), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl.sum() / max(mask.sum().item(), 1.0)


@pytest.mark.task(1)
def test_half_precision_rewards_are_float32_differences():
    g = torch.Generator().manual_seed(0)
    student = -torch.rand(3, 5, generator=g).half() * 4
    teacher = -torch.rand(3, 5, generator=g).half() * 4
    rewards = reverse_kl_rewards(student, teacher, torch.ones(3, 5))
    assert rewards.dtype == torch.float32
    # The difference of two float16 values is exact in float64; float32 rounds it once.
    expected = (teacher.to(DOUBLE) - student.to(DOUBLE)).float()
    torch.testing.assert_close(rewards, expected, rtol=1e-6, atol=0)


@pytest.mark.task(1)
def test_rewards_with_a_bool_mask_and_minus_inf_padding():
    student = torch.tensor([[-0.5, -math.inf, -math.inf], [-1.5, -0.25, -math.inf]], dtype=DOUBLE)
    teacher = torch.tensor([[-0.75, -math.inf, -2.0], [-1.0, -3.0, -math.inf]], dtype=DOUBLE)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    rewards = reverse_kl_rewards(student, teacher, mask)
    assert rewards.tolist() == [[-0.25, 0.0, 0.0], [0.5, -2.75, 0.0]]  # exact in binary


@pytest.mark.task(2)
def test_half_precision_loss_is_computed_in_float32():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 6, generator=g) * 5).half().requires_grad_(True)
    rewards = torch.randn(4, 6, generator=g).half()
    mask = torch.ones(4, 6)
    mask[2, 3:] = 0
    loss = opd_pg_loss(logp, rewards, mask)
    assert loss.dtype == torch.float32
    expected = -(mask.to(DOUBLE) * rewards.to(DOUBLE) * logp.detach().to(DOUBLE)).sum() / mask.sum()
    # float32 sums of 21 products: a relative error of a few float32 ulps (1.2e-7 each).
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.task(2)
def test_padding_with_infinities_reaches_neither_loss_nor_gradient():
    logp = torch.tensor([[-0.5, -math.inf], [-2.0, -1.0]], dtype=DOUBLE, requires_grad=True)
    rewards = torch.tensor([[2.0, 1.0], [math.inf, -1.0]], dtype=DOUBLE)
    mask = torch.tensor([[1, 0], [0, 1]])
    loss = opd_pg_loss(logp, rewards, mask)
    loss.backward()
    # -(2 * -0.5 + -1 * -1) / 2 = 0
    assert loss.item() == 0.0
    assert logp.grad.tolist() == [[-1.0, 0.0], [0.0, 0.5]]


@pytest.mark.task(3)
def test_large_logits_stay_finite_and_exact():
    g = torch.Generator().manual_seed(2)
    student = 1e4 * torch.randn(2, 3, 7, generator=g, dtype=DOUBLE)
    teacher = 1e4 * torch.randn(2, 3, 7, generator=g, dtype=DOUBLE)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = full_vocab_reverse_kl(student, teacher, mask)
    # log(softmax) would give 0 * -inf = NaN here; log_softmax keeps every term finite.
    assert math.isfinite(loss.item())
    expected = reference_reverse_kl(student, teacher, mask)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.task(3)
def test_half_precision_logits_give_a_float32_loss():
    g = torch.Generator().manual_seed(3)
    student = (3 * torch.randn(2, 4, 9, generator=g)).half()
    teacher = (3 * torch.randn(2, 4, 9, generator=g)).half()
    mask = torch.ones(2, 4)
    loss = full_vocab_reverse_kl(student, teacher, mask)
    assert loss.dtype == torch.float32
    # log_softmax in float32 of the same float16 inputs: a relative error near 1e-6, far from
    # float16's 1e-3.
    expected = reference_reverse_kl(student, teacher, mask)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.task(3)
def test_a_masked_row_of_minus_inf_reaches_neither_value_nor_gradient():
    g = torch.Generator().manual_seed(4)
    student = torch.randn(1, 2, 4, generator=g, dtype=DOUBLE)
    teacher = torch.randn(1, 2, 4, generator=g, dtype=DOUBLE)
    student[0, 1] = -math.inf
    student.requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0]])
    loss = full_vocab_reverse_kl(student, teacher, mask)
    loss.backward()
    expected = reference_reverse_kl(student.detach()[:, :1], teacher[:, :1], mask[:, :1])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.isfinite(student.grad).all()
    assert student.grad[0, 1].tolist() == [0.0] * 4
