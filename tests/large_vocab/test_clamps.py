"""opd_literate.large_vocab.clamps: verl's clamped top-k forward KL, its diagnostics, the study.

The values are checked against plain float64 sums written from verl's formula, the clamp
condition against the log-sum inequality on random reports, and the gradients against the
closed forms; ``tests/integration/test_verl_distillation.py`` compares with verl itself.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_literate.large_vocab import clamps
from opd_literate.large_vocab.topk import topk_kl

F64 = torch.float64


def _plain(student_logits, report, ids, low, high):
    """verl's formula, one position at a time, in Python floats."""
    log_p = torch.log_softmax(student_logits, -1).tolist()
    value = 0.0
    for t, v in zip(report.tolist(), ids.tolist()):
        s = log_p[v]
        t_bar, s_bar = (t, s) if low is None else (max(t, low), max(s, low))
        value += math.exp(t_bar) * (t_bar - s_bar)
    value = max(value, 0.0)
    return value if high is None else min(value, high)


def _random_report(seed, V=9, k=3, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    student = scale * torch.randn(V, generator=g, dtype=F64)
    log_q = torch.log_softmax(scale * torch.randn(V, generator=g, dtype=F64), -1)
    ids = torch.randperm(V, generator=g)[:k]
    return student, log_q[ids], ids


@pytest.mark.parametrize("low, high", [(-10.0, 10.0), (-1.0, 0.05), (None, None)])
def test_values_are_verls_formula(low, high):
    for seed in range(40):
        student, report, ids = _random_report(seed)
        got = clamps.verl_forward_kl_topk(student, report, ids, log_prob_min_clamp=low,
                                          loss_max_clamp=high).item()
        assert got == pytest.approx(_plain(student, report, ids, low, high), rel=1e-12, abs=1e-14)


def test_without_clamps_binding_it_is_the_ignore_approximation():
    # a report whose every log-probability is above -10, and a positive value: no clamp binds
    student = torch.tensor([1.0, 0.5, 0.0, -0.5], dtype=F64)
    log_q = torch.log_softmax(torch.tensor([2.0, 0.0, 0.0, -1.0], dtype=F64), -1)
    ids = torch.tensor([0, 1])
    ours = clamps.verl_forward_kl_topk(student, log_q[ids], ids)
    assert ours.item() > 0
    torch.testing.assert_close(ours, topk_kl(student, log_q[ids], ids, "ignore", "forward"),
                               rtol=1e-14, atol=0)


@settings(deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 12), st.floats(0.1, 6.0))
def test_a_negative_value_needs_the_student_heavier_on_the_report(seed, V, scale):
    """Log-sum inequality: (c) >= Q log(Q / P), so (c) < 0 only where P > Q."""
    g = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(scale * torch.randn(V, generator=g, dtype=F64), -1)
    log_q = torch.log_softmax(scale * torch.randn(V, generator=g, dtype=F64), -1)
    k = int(torch.randint(1, V + 1, (1,), generator=g))
    ids = torch.randperm(V, generator=g)[:k]
    q, p = log_q[ids].exp(), log_p[ids].exp()
    value = float((q * (log_q[ids] - log_p[ids])).sum())
    Q, P = float(q.sum()), float(p.sum())
    assert value >= Q * math.log(Q / P) - 1e-12
    if value < -1e-12:
        assert P > Q
        assert clamps.verl_forward_kl_topk(log_p, log_q[ids], ids,
                                           log_prob_min_clamp=None).item() == 0.0


def test_a_clamped_position_sends_no_gradient_and_an_unclamped_one_the_closed_form():
    student = torch.log(torch.tensor([0.8, 0.1, 0.1], dtype=F64)).requires_grad_(True)
    report, ids = torch.log(torch.tensor([0.5, 0.25], dtype=F64)), torch.tensor([0, 1])
    clamps.verl_forward_kl_topk(student, report, ids).backward()
    assert torch.equal(student.grad, torch.zeros(3, dtype=F64))
    # unclamped: d/dz sum_S q_v (log q_v - log p_v) = Q p - q on S (0 off S)
    z = torch.zeros(3, dtype=F64, requires_grad=True)
    clamps.verl_forward_kl_topk(z, report, ids).backward()
    p, q_on_s = torch.full((3,), 1 / 3, dtype=F64), torch.tensor([0.5, 0.25, 0.0], dtype=F64)
    torch.testing.assert_close(z.grad, 0.75 * p - q_on_s, rtol=1e-14, atol=1e-15)


def test_a_student_log_probability_below_the_clamp_sends_no_gradient_through_it():
    student = torch.tensor([0.0, -20.0, 0.0], dtype=F64, requires_grad=True)
    report, ids = torch.log(torch.tensor([0.5, 0.4], dtype=F64)), torch.tensor([0, 1])
    clamps.verl_forward_kl_topk(student, report, ids).backward()
    # token 1's log-probability (about -20.7) is clamped at -10: only token 0's term moves z
    p = torch.softmax(student.detach(), -1)
    expected = 0.5 * p - torch.tensor([0.5, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(student.grad, expected, rtol=1e-12, atol=1e-15)


def test_diagnostics_against_sets_and_sums():
    g = torch.Generator().manual_seed(3)
    student = torch.randn(5, 12, generator=g, dtype=F64)
    log_q = torch.log_softmax(torch.randn(5, 12, generator=g, dtype=F64), -1)
    report, ids = log_q.topk(4, -1)
    mask = torch.tensor([1, 1, 0, 1, 1])
    d = clamps.topk_diagnostics(student, report, ids, mask, log_prob_min_clamp=None)
    log_p = torch.log_softmax(student, -1)
    for row in range(5):
        mine = set(student[row].topk(4).indices.tolist())
        theirs = ids[row].tolist()
        assert d["overlap_count"][row].item() == len(mine & set(theirs))
        assert d["student_mass"][row].item() == pytest.approx(
            sum(math.exp(log_p[row, v]) for v in theirs), rel=1e-12)
        shared = [v for v in theirs if v in mine]
        want = (sum(-math.exp(log_q[row, v]) * float(log_q[row, v] - log_p[row, v])
                    for v in shared) / len(shared)) if shared else 0.0
        assert d["overlap_token_advantage"][row].item() == pytest.approx(want, rel=1e-12,
                                                                         abs=1e-15)
    kept = [0, 1, 3, 4]
    assert d["metrics"]["overlap_ratio"] == pytest.approx(
        sum(d["overlap_count"][r].item() for r in kept) / len(kept) / 4)
    assert d["metrics"]["teacher_mass_min"] == pytest.approx(
        min(d["teacher_mass"][r].item() for r in kept))
    empty = clamps.topk_diagnostics(student, report, ids, torch.zeros(5))
    assert math.isnan(empty["metrics"]["student_mass"])


def test_the_study_is_consistent_with_its_definitions():
    rows = clamps.clamp_study(V=256, temperatures=(1.0,), noises=(0.5,), ks=(1, 8, 128),
                              positions=8)
    assert [r["k"] for r in rows] == [1, 8, 128]
    for r in rows:
        assert 0 <= r["clamped"] <= r["p_above_q"] <= 1  # a clamp needs P > Q
        assert 0 <= r["lost"] <= 1 and (r["lost"] == 0) == (r["clamped"] == 0)
        assert r["c_grad_error"] >= 0 and r["b_grad_error"] >= 0
    # k = 1 on a noisy student: about half the positions have P > Q, and they are clamped
    assert rows[0]["clamped"] > 0


BAD = [
    (dict(teacher_topk_ids=torch.tensor([0.0, 1.0])), TypeError,
     "teacher_topk_ids must be an integer"),
    (dict(teacher_topk_ids=torch.tensor([0, 1, 2])), ValueError,
     "teacher_topk_ids must have the shape of teacher_topk_logp"),
    (dict(teacher_topk_ids=torch.tensor([0, 5])), ValueError, r"must lie in \[0, V\)"),
    (dict(teacher_topk_logp=torch.tensor([0.5, -1.0])), ValueError, "log-probabilities"),
    (dict(teacher_topk_logp=torch.tensor([math.nan, -1.0])), ValueError, "log-probabilities"),
    (dict(student_logits=torch.tensor([0.0, math.nan, 0.0])), ValueError, "no NaN"),
    (dict(student_logits=torch.zeros(2, 3)), ValueError, "leading shape of student_logits"),
    (dict(log_prob_min_clamp=1.0), ValueError, "log_prob_min_clamp"),
    (dict(loss_max_clamp=-1.0), ValueError, "loss_max_clamp"),
    (dict(loss_max_clamp=math.nan), ValueError, "loss_max_clamp"),
]


@pytest.mark.parametrize("change, error, message", BAD)
def test_bad_input_is_a_named_error(change, error, message):
    arguments = dict(student_logits=torch.zeros(3), teacher_topk_logp=torch.log(
        torch.tensor([0.5, 0.25])), teacher_topk_ids=torch.tensor([0, 1]))
    arguments.update(change)
    with pytest.raises(error, match=message):
        clamps.verl_forward_kl_topk(**arguments)


def test_half_precision_is_computed_in_float32():
    student = torch.zeros(3, dtype=torch.bfloat16)
    out = clamps.verl_forward_kl_topk(student, torch.log(torch.tensor([0.5, 0.25])).bfloat16(),
                                      torch.tensor([0, 1]))
    assert out.dtype == torch.float32
