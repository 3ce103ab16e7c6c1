"""The ``temperature`` of the full-vocabulary losses of ``opd_literate.opd``: it divides the logits
before the softmax, 1 is the default bit for bit, and a bad or tiny one is refused, never NaN.
"""

import math

import numpy as np
import pytest
import torch

from opd_literate import opd
from tests.opd._inputs import ONES, D, _kl, _softmax_logs

PER_POSITION = {
    "reverse": lambda s, t, m, **kw: opd.reverse_kl_per_position(s, t, m, **kw),
    "forward": lambda s, t, m, **kw: opd.forward_kl_per_position(s, t, m, **kw),
    "jsd": lambda s, t, m, **kw: opd.generalized_jsd_per_position(s, t, beta=0.3, mask=m, **kw),
}


LOSSES = {
    "reverse": lambda s, t, m, **kw: opd.full_vocab_reverse_kl(s, t, m, **kw),
    "forward": lambda s, t, m, **kw: opd.forward_kl(s, t, m, **kw),
    "jsd": lambda s, t, m, **kw: opd.generalized_jsd(s, t, m, beta=0.3, **kw),
}


def _logits(seed=0, B=2, T=3, V=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3,
            torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3,
            torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))


def _numpy_divergence(kind, s, t, tau):
    """float64 numpy: the divergence of softmax(s / tau) and softmax(t / tau), per position."""
    def log_softmax(z):
        z = z / tau
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(s), log_softmax(t)
    p, q = np.exp(lp), np.exp(lq)
    if kind == "reverse":
        return (p * (lp - lq)).sum(-1)
    if kind == "forward":
        return (q * (lq - lp)).sum(-1)
    m = 0.3 * q + 0.7 * p
    return 0.3 * (q * (lq - np.log(m))).sum(-1) + 0.7 * (p * (lp - np.log(m))).sum(-1)


@pytest.mark.parametrize("kind", sorted(PER_POSITION))
@pytest.mark.parametrize("tau", [0.5, 2.0, 7.0])
def test_temperature_divides_the_logits_before_the_softmax(kind, tau):
    s, t, mask = _logits()
    got = PER_POSITION[kind](s, t, mask, temperature=tau)
    expected = _numpy_divergence(kind, s.numpy(), t.numpy(), tau) * mask.numpy()
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-14)
    loss = LOSSES[kind](s, t, mask, temperature=tau)
    assert loss.item() == pytest.approx(expected.sum() / mask.sum().item(), rel=1e-10)
    # and it changes the value: the test would see a temperature that is ignored
    assert not np.allclose(PER_POSITION[kind](s, t, mask).numpy(), expected)


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_temperature_one_is_the_default_bit_for_bit(kind):
    s, t, mask = _logits(1)
    assert torch.equal(LOSSES[kind](s, t, mask, temperature=1.0), LOSSES[kind](s, t, mask))


def test_reverse_kl_gradient_at_a_temperature():
    # d KL / d z_j = (1 / tau) p_j (log p_j - log q_j - KL), p = softmax(z / tau)
    s, t, _ = _logits(2, B=1, T=1)
    tau = 2.5
    z = s.clone().requires_grad_()
    opd.full_vocab_reverse_kl(z, t, torch.ones(1, 1), temperature=tau).backward()
    lp, lq = torch.log_softmax(s / tau, -1), torch.log_softmax(t / tau, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1, keepdim=True)
    torch.testing.assert_close(z.grad, lp.exp() * (lp - lq - kl) / tau, rtol=1e-12, atol=1e-15)


def test_masked_rows_stay_out_at_any_temperature():
    s, t, mask = _logits(3)
    s = s.clone()
    s[mask == 0] = -math.inf
    z = s.clone().requires_grad_()
    loss = opd.generalized_jsd(z, t, mask, beta=0.5, temperature=0.3)
    loss.backward()
    assert torch.isfinite(loss) and torch.all(z.grad[mask == 0] == 0)


def test_half_precision_with_a_temperature_is_float32():
    s, t, mask = _logits(4)
    got = opd.full_vocab_reverse_kl(s.bfloat16(), t.bfloat16(), mask, temperature=2.0)
    ref = opd.full_vocab_reverse_kl(s.bfloat16().float(), t.bfloat16().float(), mask,
                                    temperature=2.0)
    assert got.dtype == torch.float32 and torch.equal(got, ref)


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-1.0, ValueError),
                                        (math.nan, ValueError), (math.inf, ValueError),
                                        (True, TypeError), ("2", TypeError)])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_bad_temperature_is_refused_by_name(kind, bad, error):
    s, t, mask = _logits()
    with pytest.raises(error, match="temperature"):
        LOSSES[kind](s, t, mask, temperature=bad)
    with pytest.raises(error, match="temperature"):
        PER_POSITION[kind](s, t, mask, temperature=bad)


def test_a_tiny_temperature_is_exact_or_refused_never_nan():
    # softmax([1, 0] / tau) -> (1, e^{-1/tau}); against the teacher (e^{-1/tau}, 1) the reverse
    # KL is (1 - 2 e^{-1/tau}) / tau ~ 1 / tau: 1e30 at tau = 1e-30 (float32), 1e300 at 1e-300.
    for dtype, tau in ((torch.float32, 1e-30), (torch.float64, 1e-300)):
        student = torch.tensor([[[1.0, 0.0]]], dtype=dtype, requires_grad=True)
        teacher = torch.tensor([[[0.0, 1.0]]], dtype=dtype)
        loss = opd.full_vocab_reverse_kl(student, teacher, torch.ones(1, 1), temperature=tau)
        loss.backward()
        assert loss.item() == pytest.approx(1 / tau, rel=1e-6)
        assert torch.isfinite(student.grad).all()
    # 1 / tau beyond the dtype's range: refused, naming the argument.
    for dtype, tau in ((torch.float32, 1e-39), (torch.float64, 1e-310)):
        with pytest.raises(ValueError, match="temperature must be at least"):
            zeros = torch.zeros(1, 1, 2, dtype=dtype)
            opd.full_vocab_reverse_kl(zeros, zeros, torch.ones(1, 1), temperature=tau)


# Found by mutation testing (docs/mutation.md).




def _float64_logits(B=2, T=3, V=4, seed=0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g, dtype=D).to(dtype)




# -------------------------------------------------------------------------------------------
# Defaults, against float64 formulas
# -------------------------------------------------------------------------------------------




@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_default_temperature_is_one(temperature):
    s, t = _float64_logits(seed=1), _float64_logits(seed=2)
    want = _kl(_softmax_logs(s / temperature), _softmax_logs(t / temperature))
    kwargs = {} if temperature == 1.0 else {"temperature": temperature}
    torch.testing.assert_close(opd.reverse_kl_per_position(s, t, **kwargs), want)
    torch.testing.assert_close(opd.full_vocab_reverse_kl(s, t, ONES, **kwargs), want.mean())


# -------------------------------------------------------------------------------------------
# Survivors of the measurement on the current code
# -------------------------------------------------------------------------------------------
def test_temperature_with_huge_and_impossible_logits():
    # z / tau would overflow for z = 1e308, tau = 0.5: each row is shifted by its own largest
    # finite entry first. Rows: p = (1, 0, 0) twice, then softmax((0, 1, 2) / 0.5).
    s = torch.tensor([[[1e308, 0.0, 0.0], [1e308, -math.inf, 0.0], [0.0, 1.0, 2.0]]], dtype=D)
    t = torch.zeros(1, 3, 3, dtype=D)  # a uniform teacher
    log_p2 = torch.log_softmax(torch.tensor([0.0, 2.0, 4.0], dtype=D), -1)
    want = [math.log(3.0), math.log(3.0), float((log_p2.exp() * (log_p2 + math.log(3))).sum())]
    got = opd.reverse_kl_per_position(s, t, temperature=0.5)
    assert torch.allclose(got[0], torch.tensor(want, dtype=D), rtol=1e-12, atol=0)


@pytest.mark.parametrize("call", [
    lambda: opd.full_vocab_reverse_kl(_float64_logits(), _float64_logits(), ONES, temperature=0.0),
    lambda: opd.generalized_jsd_per_position(_float64_logits(), _float64_logits(), temperature=0.0),
    lambda: opd.generalized_jsd(_float64_logits(), _float64_logits(), ONES, temperature=-1.0),
    lambda: opd.forward_kl_per_position(_float64_logits(), _float64_logits(), temperature=0.0),
])
def test_temperature_is_named(call):
    with pytest.raises(ValueError, match="^temperature must be > 0, got "):
        call()


def test_the_smallest_temperature_is_one_over_the_largest_number():
    big = torch.finfo(torch.float32).max
    s = torch.tensor([[[0.0, 1.0]]])
    t = torch.tensor([[[0.5, 1.0]]])
    # 1 / tau = big exactly, and 1 / tau = big / 1.5: accepted; the limit tau -> 0 is the argmax,
    # the same token for both, so the KL is 0
    for tau in (1.0 / big, 1.5 / big):
        assert 1.0 / tau <= big
        assert opd.reverse_kl_per_position(s, t, temperature=tau).tolist() == [[0.0]]
    with pytest.raises(ValueError, match=r"^temperature must be at least 1 / \(the largest "
                       r"torch.float32 number\), got "):
        opd.reverse_kl_per_position(s, t, temperature=0.5 / big)
