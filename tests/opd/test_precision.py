"""``opd_literate.opd`` at the edges of floating point: ``-inf`` logits through a linear head, the
expected k-estimator gradient in float32, half precision in every function, empty batches, and
the dtype each loss computes in. References are written here, never the function under test.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opd_literate import opd
from opd_literate._numerics import check_finite_number
from tests.opd._inputs import ONES, D, _logp

INF = math.inf


DOUBLE = torch.float64


FULL_VOCAB_LOSSES = {
    "reverse": opd.full_vocab_reverse_kl,
    "forward": opd.forward_kl,
    "jsd_0.5": lambda s, t, m: opd.generalized_jsd(s, t, m, beta=0.5),
    "jsd_0.1_normalized": lambda s, t, m: opd.generalized_jsd(s, t, m, beta=0.1, normalize=True),
    "reverse_per_position": lambda s, t, m: opd.reverse_kl_per_position(s, t, m).sum(),
    "forward_per_position": lambda s, t, m: opd.forward_kl_per_position(s, t, m).sum(),
    "jsd_per_position": lambda s, t, m: opd.generalized_jsd_per_position(s, t, 0.3, mask=m).sum(),
}


# ------------------------------------------------------------ -inf at masked-out positions
@pytest.mark.parametrize("name", FULL_VOCAB_LOSSES)
def test_minus_inf_teacher_at_a_masked_out_position_through_a_linear_head(name):
    loss_fn = FULL_VOCAB_LOSSES[name]
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 3).double()
    hidden = torch.randn(2, 3, 4, dtype=DOUBLE)
    teacher = torch.randn(2, 3, 3, dtype=DOUBLE)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    teacher[0, 2] = -INF  # a whole row, as a padded teacher returns
    teacher[1, 1, 0] = -INF  # one entry
    teacher[1, 2] = torch.tensor([-INF, 0.0, -INF])
    loss = loss_fn(head(hidden), teacher, mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(head.weight.grad).all() and torch.isfinite(head.bias.grad).all()
    # the same loss without the masked-out positions at all: value and gradient agree
    grad = head.weight.grad.clone()
    head.zero_grad()
    inside = mask.bool()
    teacher_clean = torch.where(inside[..., None], teacher, torch.zeros_like(teacher))
    reference = loss_fn(head(hidden), teacher_clean, mask)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, head.weight.grad, rtol=1e-12, atol=1e-14)


def test_minus_inf_student_at_masked_out_positions_gets_zero_gradient():
    student = torch.randn(1, 2, 3, dtype=DOUBLE)
    student[0, 1] = -INF
    student.requires_grad_(True)
    teacher = torch.randn(1, 2, 3, dtype=DOUBLE)
    for loss_fn in FULL_VOCAB_LOSSES.values():
        student.grad = None
        loss_fn(student, teacher, torch.tensor([[1.0, 0.0]])).backward()
        assert torch.isfinite(student.grad).all() and (student.grad[0, 1] == 0).all()


# ------------------------------------------------------------------- padded vocabulary
def direct_jsd(p, q, beta):
    """beta KL(q || m) + (1 - beta) KL(p || m) in probability space, float64."""
    m = beta * q + (1 - beta) * p
    return beta * (q * (q / m).log()).sum(-1) + (1 - beta) * (p * (p / m).log()).sum(-1)


@pytest.mark.parametrize("beta", [1e-3, 0.3, 0.5, 0.9])
def test_padded_vocabulary_entry_gives_finite_jsd_gradients(beta):
    student_real = torch.tensor([[[0.2, -1.0, 0.7]]], dtype=DOUBLE)
    teacher_real = torch.tensor([[[1.0, 0.0, -0.5]]], dtype=DOUBLE)
    pad = torch.full((1, 1, 2), -INF, dtype=DOUBLE)
    student = torch.cat([student_real, pad], -1).requires_grad_(True)
    teacher = torch.cat([teacher_real, pad], -1)
    loss = opd.generalized_jsd(student, teacher, torch.ones(1, 1), beta=beta)
    loss.backward()
    assert torch.isfinite(student.grad).all() and (student.grad[..., 3:] == 0).all()
    # equals the JSD on the 3 real entries, value and gradient
    z = student_real.clone().requires_grad_(True)
    reference = direct_jsd(F.softmax(z, -1), F.softmax(teacher_real, -1), beta).sum()
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(student.grad[..., :3], z.grad, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------- expected k-estimator gradient
def enumerated_expected_gradient(z, zt, kind, mode):
    """float64: sum over the tokens v the student can sample of p_v * grad (one token)."""
    z, zt = z.double(), zt.double()
    log_q = F.log_softmax(zt, -1)
    p = F.softmax(z, -1)
    total = torch.zeros_like(z)
    for v in range(z.shape[-1]):
        if p[v] == 0:
            continue  # never sampled
        x = z.clone().requires_grad_(True)
        log_p_v = F.log_softmax(x, -1)[v]
        d = log_p_v - log_q[v]
        k = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[kind]
        surrogate = k if mode == "loss" else k.detach() * log_p_v
        surrogate.backward()
        total += p[v] * x.grad
    return total


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_expected_k_gradient_is_finite_and_right_in_float32(kind, mode):
    z = torch.tensor([0.0, -90.0, 0.0])  # e^{90} overflows float32
    zt = torch.zeros(3)  # d_v = -89.6 for the rare entry: e^{-d} = 9e38 > float32 max
    got = opd.expected_kl_estimator_gradient(z, zt, kind, mode)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    expected = enumerated_expected_gradient(z, zt, kind, mode)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_expected_k_gradient_with_an_impossible_student_entry(kind, mode):
    z = torch.tensor([[0.2, -INF, 1.0, -0.4]], dtype=DOUBLE)
    zt = torch.tensor([[0.0, 0.5, -1.0, 0.3]], dtype=DOUBLE)
    got = opd.expected_kl_estimator_gradient(z, zt, kind, mode)
    assert torch.isfinite(got).all() and got[0, 1].item() == 0.0
    torch.testing.assert_close(got[0], enumerated_expected_gradient(z[0], zt[0], kind, mode),
                               rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------- half precision
def logp_batch(dtype, seed=0, B=8, T=512):
    g = torch.Generator().manual_seed(seed)
    student = -20 * torch.rand(B, T, generator=g, dtype=DOUBLE)
    teacher = -20 * torch.rand(B, T, generator=g, dtype=DOUBLE)
    return student.to(dtype), teacher.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_token_losses_are_computed_in_float32(dtype):
    s, t = logp_batch(dtype)
    s64, t64 = s.double(), t.double()  # the exact values the function received
    mask = torch.ones(8, 512)
    r64 = t64 - s64
    # opd.opd_pg_loss: -mean(r * logp), about 33 for uniform [-20, 0] draws; fp16 overflows
    expected = -(r64 * s64).mean()
    assert 30 < expected.item() < 36
    checks = [
        (opd.opd_pg_loss(s, t - s, mask), -((t - s).double() * s64).mean()),
        (opd.sampled_token_opd_loss(s, t, mask), expected),
        (opd.sampled_token_opd_loss(s, t, mask, gamma=1.0, reduction="seq-mean-token-sum"),
         -(r64.flip(1).cumsum(1).flip(1) * s64).sum(1).mean()),
        (opd.aggregate_loss(s * t, mask, "sum"), (s64 * t64).sum()),
        (opd.kl_estimator(s, t, "k3"), torch.expm1(t64 - s64) + s64 - t64),
        (opd.reverse_kl_rewards(s, t, mask), r64),
        (opd.discounted_returns(t, mask, 1.0), t64.flip(1).cumsum(1).flip(1)),
    ]
    for got, ref in checks:
        assert got.dtype == torch.float32, got.dtype
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=1e-5)


def test_half_precision_gradient_flows_back_in_the_input_dtype():
    s, t = logp_batch(torch.float16, T=16)
    s.requires_grad_(True)
    opd.sampled_token_opd_loss(s, t, torch.ones(8, 16)).backward()
    assert s.grad.dtype == torch.float16 and torch.isfinite(s.grad).all()


def test_gamma_zero_keeps_a_finite_reward_before_an_infinite_one():
    # G_0 = r_0 at gamma = 0; the recursion r_0 + 0 * G_1 gave NaN when G_1 = -inf
    returns = opd.discounted_returns(torch.tensor([[1.0, -INF]]), torch.ones(1, 2), 0.0)
    assert returns.tolist() == [[1.0, -INF]]


# --------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("shape", [(2, 0), (0, 3), (0, 0)])
def test_empty_batches_give_zero_losses_and_empty_results(shape):
    s = torch.zeros(shape, requires_grad=True)
    t, m = torch.zeros(shape), torch.ones(shape)
    assert opd.discounted_returns(t, m, 0.5).shape == shape
    assert opd.reverse_kl_rewards(s, t, m).shape == shape
    for reduction in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm", "sum"):
        loss = opd.sampled_token_opd_loss(s, t, m, gamma=1.0, reduction=reduction)
        loss.backward()
        assert loss.item() == 0.0
    assert opd.opd_pg_loss(s, t, m).item() == 0.0
    logits = torch.zeros(*shape, 4, requires_grad=True)
    for loss_fn in FULL_VOCAB_LOSSES.values():
        loss = loss_fn(logits, torch.zeros(*shape, 4), m)
        loss.backward()
        assert loss.item() == 0.0 and logits.grad.shape == logits.shape


def test_empty_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"vocabulary of at least 1 entry.*V = 0"):
        opd.full_vocab_reverse_kl(torch.zeros(1, 2, 0), torch.zeros(1, 2, 0), torch.ones(1, 2))


# ------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("name", [n for n in FULL_VOCAB_LOSSES if "per_position" not in n])
def test_mask_none_is_a_type_error_naming_mask_for_the_losses(name):
    z = torch.zeros(1, 2, 3)
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got NoneType"):
        FULL_VOCAB_LOSSES[name](z, z, None)


def test_mask_none_in_token_losses():
    z = torch.zeros(1, 2)
    for call in (lambda: opd.opd_pg_loss(z, z, None),
                 lambda: opd.sampled_token_opd_loss(z, z, None),
                 lambda: opd.aggregate_loss(z, None), lambda: opd.discounted_returns(z, None, 0.5),
                 lambda: opd.reverse_kl_rewards(z, z, None)):
        with pytest.raises(TypeError, match="mask must be a torch.Tensor, got NoneType"):
            call()


@pytest.mark.parametrize("value", [True, False, np.True_, torch.tensor(True), "0.5", b"1"])
def test_check_finite_number_refuses_bools_and_strings(value):
    with pytest.raises(TypeError, match="x must be a real number"):
        check_finite_number("x", value)


def test_bool_and_string_arguments_are_refused_by_name():
    z = torch.zeros(1, 1, 3)
    with pytest.raises(TypeError, match="beta must be a real number, got bool True"):
        opd.generalized_jsd(z, z, torch.ones(1, 1), beta=True)
    with pytest.raises(TypeError, match="gamma must be a real number, got str '0.5'"):
        opd.discounted_returns(torch.zeros(1, 2), torch.ones(1, 2), "0.5")
    with pytest.raises(TypeError, match="normalize must be a bool"):
        opd.generalized_jsd(z, z, torch.ones(1, 1), beta=0.5, normalize=1)
    from opd_literate.mismatch import estimators

    one = estimators.toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    with pytest.raises(TypeError, match="cap must be a real number, got bool True"):
        estimators.token_tis(one, cap=True)


def test_numbers_that_are_numbers_still_pass():
    assert check_finite_number("x", np.float32(0.5)) == 0.5
    assert check_finite_number("x", 3) == 3.0
    assert check_finite_number("x", torch.tensor(0.25)) == 0.25


def test_checks_module_does_not_load_torch():
    code = ("import sys, opd_literate.mismatch.estimators, opd_literate.mismatch.toy, "
            "opd_literate._numerics; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_infinite_reverse_kl_position_has_zero_gradient_and_leaves_the_others_alone():
    # Position 0: the teacher rules out entry 2, which the student can emit: KL = +inf there.
    # Position 1: an ordinary position. The module docstring says position 0's gradient is 0
    # and position 1 keeps the gradient it has alone.
    student = torch.tensor([[[0.1, 0.2, 0.3], [0.5, -0.5, 0.0]]], dtype=torch.float64,
                           requires_grad=True)
    teacher = torch.tensor([[[0.0, 0.0, -math.inf], [0.0, 1.0, -1.0]]], dtype=torch.float64)
    loss = opd.full_vocab_reverse_kl(student, teacher, torch.ones(1, 2))
    loss.backward()
    assert loss.item() == math.inf
    assert student.grad[0, 0].tolist() == [0.0, 0.0, 0.0]
    # Position 1 alone, with the same token-mean normaliser (2 positions): p (log p - log q - KL)
    p = torch.softmax(student.detach()[0, 1], -1)
    log_q = torch.log_softmax(teacher[0, 1], -1)
    d = p.log() - log_q
    expected = p * (d - (p * d).sum()) / 2
    assert torch.allclose(student.grad[0, 1], expected, atol=1e-14)


# Found by mutation testing (docs/mutation.md): the lab's losses compute in the promoted dtype.










def test_pg_loss_computes_in_the_promoted_dtype():
    s32 = _logp(seed=1).to(torch.float32)
    r64 = _logp(seed=2)
    loss = opd.opd_pg_loss(s32, r64, ONES)
    assert loss.dtype == D
    torch.testing.assert_close(loss, -(r64 * s32.to(D)).sum() / 6, rtol=1e-15, atol=0)


@pytest.mark.parametrize("student, other", [(torch.float32, D), (D, torch.float32)])
def test_rewards_and_pg_loss_in_the_promoted_dtype(student, other):
    s, t = _logp(seed=1).to(student), _logp(seed=2).to(other)
    rewards = opd.reverse_kl_rewards(s, t, ONES)
    assert rewards.dtype == D
    assert torch.equal(rewards, t.to(D) - s.to(D))  # exact: both are float64 values
    loss = opd.opd_pg_loss(s, t, ONES)
    assert loss.dtype == D
    torch.testing.assert_close(loss, -(t.to(D) * s.to(D)).sum() / 6, rtol=1e-15, atol=0)
