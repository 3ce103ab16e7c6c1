"""Property tests of ``opd_literate.opd`` against a float64 reference (Hypothesis).

Cases: random shapes (B or T may be 0), dtypes (fp16, bf16, fp32, fp64), scales up to 1e4,
random masks, and ``-inf`` patterns in either model at masked-in and masked-out positions (a
masked-out position may even hold NaN or a whole row of ``-inf``). Every loss must

* return a value that is finite exactly when the true value is (the float64 reference,
  computed here in numpy from the values the function received), and close to it;
* have a gradient in the student that is finite at every entry whenever the value is finite;
* send no gradient to the teacher.

The example count comes from the Hypothesis profile (conftest.py): "fast" by default,
``--hypothesis-profile=ci`` for 1,000 examples a property. ``EXAMPLES`` counts the examples
each property ran, for the figure in the CI log (printed with ``-s``).
"""

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate import opd

# Every test here takes its example count from the Hypothesis profile (conftest.py): .ci/run
# runs them again with `-m properties --hypothesis-profile=ci`.
pytestmark = pytest.mark.properties

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
EXAMPLES = Counter()
NAN_FOUND = Counter()


def compute_eps(dtype):
    return 2.2e-16 if dtype == torch.float64 else 1.2e-7  # half precision computes in float32


@st.composite
def logits_case(draw):
    B, T, V = draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = g.random((B, T)) < 0.7
    models = []
    for _ in range(2):
        z = np.clip(scale * g.standard_normal((B, T, V)), -6e4, 6e4)  # fp16 holds 6.5e4
        impossible = g.random((B, T, V)) < draw(st.sampled_from([0.0, 0.3, 0.7]))
        # a masked-in row keeps one possible entry (a distribution); masked-out rows anything
        keep = g.integers(0, V, size=(B, T))
        for b, t in zip(*np.nonzero(mask)):
            impossible[b, t, keep[b, t]] = False
        z[impossible] = -np.inf
        garbage = (~mask) & (g.random((B, T)) < 0.3)
        z[garbage] = np.nan
        models.append(torch.from_numpy(z).to(dtype))
    return models[0], models[1], torch.from_numpy(mask)


def reference_divergence(student, teacher, mask, kind, beta=0.5):
    """Token-mean divergence in float64 numpy, with 0 log 0 = 0 and a / 0 = inf."""
    s, t = student.double().numpy(), teacher.double().numpy()
    m = mask.numpy()
    per_position = []
    for b, i in zip(*np.nonzero(m)):
        lp = s[b, i] - np.logaddexp.reduce(s[b, i])
        lq = t[b, i] - np.logaddexp.reduce(t[b, i])

        def kl(la, lb):
            support = la > -np.inf
            if np.any(support & (lb == -np.inf)):
                return np.inf
            return float(np.sum(np.exp(la[support]) * (la[support] - lb[support])))

        if kind == "reverse" or (kind == "jsd" and beta == 1.0):
            value = kl(lp, lq)
        elif kind == "forward" or (kind == "jsd" and beta == 0.0):
            value = kl(lq, lp)
        else:
            lm = np.logaddexp(math.log(beta) + lq, math.log1p(-beta) + lp)  # never underflows
            value = beta * kl(lq, lm) + (1 - beta) * kl(lp, lm)
        per_position.append(max(value, 0.0))
    if not per_position:
        return 0.0
    return float(np.sum(per_position) / len(per_position))


def largest_finite(x):
    x = x.detach().double()
    x = x[torch.isfinite(x)]
    return x.abs().max().item() if x.numel() else 0.0


def check_loss(name, loss_fn, student, teacher, mask, reference):
    EXAMPLES[name] += 1
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    loss = loss_fn(student, teacher, mask)
    value = loss.item()
    NAN_FOUND[name] += math.isnan(value)
    assert math.isfinite(value) == math.isfinite(reference), (name, value, reference)
    if not math.isfinite(reference):
        assert value == reference  # +inf: the student can say what the teacher cannot
        return
    eps = compute_eps(student.dtype)
    size = 1.0 + abs(reference) + largest_finite(student) + largest_finite(teacher)
    assert abs(value - reference) <= 1e3 * eps * size, (name, value, reference)
    loss.backward()
    NAN_FOUND[name + " grad"] += int(torch.isnan(student.grad).any())
    assert teacher.grad is None, name
    if student.dtype != torch.float16:
        assert torch.isfinite(student.grad).all(), name
        return
    # fp16 inputs get their gradient back in fp16, which overflows above 65504 in magnitude
    # (k3's 1 - e^{-d} for d < -11.1): the float32 gradient must be finite, and the fp16 one
    # wherever the float32 one fits in fp16.
    student32 = student.detach().float().requires_grad_(True)
    loss_fn(student32, teacher.detach(), mask).backward()
    assert torch.isfinite(student32.grad).all(), name
    fits = student32.grad.abs() < 65504
    assert torch.isfinite(student.grad[fits]).all(), name


# The slowest of the file's properties: the slow tier runs it (and .ci/run's property step
# at 1,000 examples), which keeps the README's command under a minute on 2 cores.
@pytest.mark.slow
@given(logits_case())
def test_full_vocabulary_losses_against_float64(case):
    student, teacher, mask = case
    check_loss("full_vocab_reverse_kl", opd.full_vocab_reverse_kl, student, teacher, mask,
               reference_divergence(student, teacher, mask, "reverse"))
    check_loss("forward_kl", opd.forward_kl, student, teacher, mask,
               reference_divergence(student, teacher, mask, "forward"))
    check_loss("reverse_kl_per_position",
               lambda s, t, m: opd.reverse_kl_per_position(s, t, m).sum() / m.sum().clamp_min(1),
               student, teacher, mask, reference_divergence(student, teacher, mask, "reverse"))


@given(logits_case(), st.sampled_from([0.0, 1e-6, 0.1, 0.5, 0.9, 1.0 - 1e-6, 1.0]))
def test_generalized_jsd_against_float64(case, beta):
    student, teacher, mask = case
    check_loss(f"generalized_jsd beta={beta}",
               lambda s, t, m: opd.generalized_jsd(s, t, m, beta=beta),
               student, teacher, mask, reference_divergence(student, teacher, mask, "jsd", beta))
    if beta in (0.1, 0.5, 0.9):  # where the float64 reference itself is accurate after / beta
        check_loss(f"generalized_jsd normalize beta={beta}",
                   lambda s, t, m: opd.generalized_jsd(s, t, m, beta=beta, normalize=True),
                   student, teacher, mask,
                   reference_divergence(student, teacher, mask, "jsd", beta) / beta / (1 - beta))


@st.composite
def token_case(draw):
    B, T = draw(st.integers(0, 3)), draw(st.integers(0, 6))
    dtype = draw(st.sampled_from(DTYPES))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = g.random((B, T)) < 0.7
    student = -20 * g.random((B, T))
    teacher = -20 * g.random((B, T))
    student[(~mask) & (g.random((B, T)) < 0.5)] = -np.inf  # padding
    teacher[(~mask) & (g.random((B, T)) < 0.5)] = -np.inf
    teacher[g.random((B, T)) < draw(st.sampled_from([0.0, 0.1]))] = -np.inf  # anywhere
    to = lambda x: torch.from_numpy(x).to(dtype)  # noqa: E731
    return to(student), to(teacher), torch.from_numpy(mask)


def reference_sampled_token(student, teacher, mask, gamma, reduction):
    """-sum A_t log p_t, reduced; A_t the discounted reward-to-go, all in float64 numpy."""
    s, t, m = student.double().numpy(), teacher.double().numpy(), mask.numpy()
    B, T = m.shape
    with np.errstate(invalid="ignore"):
        r = np.where(m, t - s, 0.0)
    advantage = np.zeros((B, T))
    running = np.zeros(B)
    for i in reversed(range(T)):
        running = r[:, i] + (gamma * running if gamma else 0.0)  # gamma = 0: A_t = r_t
        advantage[:, i] = running
    with np.errstate(invalid="ignore", over="ignore"):  # a -inf teacher: the true loss is inf
        per_token = np.where(m, -advantage * np.where(m, s, 0.0), 0.0)
    n = m.sum(1)
    if reduction == "token-mean":
        return per_token.sum() / max(n.sum(), 1)
    if reduction == "seq-mean-token-sum":
        return per_token.sum() / max(B, 1)
    if reduction == "seq-mean-token-mean":
        return (per_token.sum(1) / np.maximum(n, 1)).sum() / max(B, 1)
    if reduction == "seq-mean-token-sum-norm":
        return per_token.sum() / max(B, 1) / max(T, 1)
    if reduction == "token-sum-norm":
        return per_token.sum() / max(T, 1)
    return per_token.sum()  # "sum", "token-sum"


@given(token_case(), st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from(opd.REDUCTIONS))
def test_sampled_token_losses_against_float64(case, gamma, reduction):
    student, teacher, mask = case
    reference = reference_sampled_token(student, teacher, mask, gamma, reduction)
    check_loss(f"sampled_token_opd_loss {reduction}",
               lambda s, t, m: opd.sampled_token_opd_loss(s, t, m, gamma=gamma,
                                                          reduction=reduction),
               student, teacher, mask, reference)
    if gamma == 0.0 and reduction == "token-mean":
        check_loss("opd_pg_loss",
                   lambda s, t, m: opd.opd_pg_loss(s, opd.reverse_kl_rewards(s, t, m), m),
                   student, teacher, mask, reference)


@given(token_case(), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators_against_float64(case, kind):
    student, teacher, mask = case
    finite = torch.isfinite(student) & torch.isfinite(teacher)
    s, t = student[finite], teacher[finite]
    d = (s.double() - t.double()).numpy()
    reference = {"k1": d, "k2": 0.5 * d**2, "k3": np.expm1(-d) + d}[kind].sum()
    check_loss(f"kl_estimator {kind}", lambda a, b, m: opd.kl_estimator(a, b, kind).sum(),
               s, t, None, float(reference))


def test_hypothesis_counts_are_reported():
    """Runs last in this file: prints the examples per property (for the CI log)."""
    for name in sorted(EXAMPLES):
        print(f"{name}: {EXAMPLES[name]} examples, NaN values {NAN_FOUND[name]}, "
              f"NaN gradients {NAN_FOUND[name + ' grad']}")
    assert sum(NAN_FOUND.values()) == 0


# ------------------------------------------------------------- mathematical properties
@given(logits_case(), st.floats(0.01, 0.99))
def test_jsd_is_bounded_by_the_binary_entropy_of_beta(case, beta):
    student, teacher, mask = case
    jsd = opd.generalized_jsd_per_position(student, teacher, beta=beta, mask=mask)
    entropy = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert (jsd <= entropy * (1 + 1e-5) + 1e-6).all() and entropy <= math.log(2)


@given(logits_case(), st.floats(-1e3, 1e3))
def test_invariant_to_a_constant_added_to_the_logits(case, shift):
    student, teacher, mask = case
    student, teacher = student.double(), teacher.double()
    base = opd.reverse_kl_per_position(student, teacher, mask)
    shifted = opd.reverse_kl_per_position(student + shift, teacher - shift, mask)
    finite = torch.isfinite(base)
    assert torch.equal(finite, torch.isfinite(shifted))
    # log_softmax of a shifted row loses about |shift| * eps of absolute precision.
    scale = 1 + shift.__abs__() + torch.nan_to_num(student, 0, 0, 0).abs().max().item() \
        if student.numel() else 1.0
    assert torch.allclose(base[finite], shifted[finite], rtol=1e-6, atol=1e-12 * scale)
