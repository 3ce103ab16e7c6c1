"""Property tests of the divergences: random shapes, scales up to 1e4, random masks.

Hypothesis draws the cases; each property is a mathematical fact, so no expected value is
copied from the code.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_literate.opd import (
    forward_kl,
    full_vocab_reverse_kl,
    generalized_jsd,
    generalized_jsd_per_position,
    reverse_kl_per_position,
)


@st.composite
def logits_and_mask(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 4))
    V = draw(st.integers(1, 9))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    student = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    teacher = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    return student, teacher, mask


SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@SETTINGS
@given(logits_and_mask())
def test_divergences_are_nonnegative_and_finite(case):
    student, teacher, mask = case
    for loss in (full_vocab_reverse_kl(student, teacher, mask),
                 forward_kl(student, teacher, mask),
                 generalized_jsd(student, teacher, mask, beta=0.3)):
        assert torch.isfinite(loss) and loss.item() >= 0


@SETTINGS
@given(logits_and_mask(), st.floats(0.01, 0.99))
def test_jsd_is_bounded_by_the_binary_entropy_of_beta(case, beta):
    student, teacher, _ = case
    jsd = generalized_jsd_per_position(student, teacher, beta=beta)
    entropy = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert (jsd <= entropy + 1e-9).all() and entropy <= math.log(2)


@SETTINGS
@given(logits_and_mask(), st.floats(-1e4, 1e4))
def test_invariant_to_a_constant_added_to_the_logits(case, shift):
    student, teacher, _ = case
    base = reverse_kl_per_position(student, teacher)
    shifted = reverse_kl_per_position(student + shift, teacher - shift)
    # log_softmax of a shifted row loses about |shift| * eps of absolute precision.
    assert torch.allclose(base, shifted, rtol=1e-6, atol=1e-9 * (1 + abs(shift)))


@SETTINGS
@given(logits_and_mask())
def test_gradients_have_no_nan(case):
    student, teacher, mask = case
    student = student.clone().requires_grad_(True)
    (full_vocab_reverse_kl(student, teacher, mask)
     + forward_kl(student, teacher, mask)
     + generalized_jsd(student, teacher, mask)).backward()
    assert torch.isfinite(student.grad).all()
