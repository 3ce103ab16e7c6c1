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
    clamps.verl_forward_kl_topk(student, report, ids,
                                log_prob_min_clamp=clamps.DATACLASS_LOG_PROB_MIN_CLAMP).backward()
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
    for row in [0, 1, 3, 4]:
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
    for name in ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
        assert d[name][2].item() == 0  # the masked-out position
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
    (dict(student_logits=torch.zeros(3, dtype=torch.long)), TypeError,
     "student_logits must have a floating dtype"),
    (dict(teacher_topk_logp=torch.tensor([-1, -2])), TypeError,
     "teacher_topk_logp must have a floating dtype"),
    (dict(student_logits=torch.tensor([0.0, math.inf, 0.0])), ValueError, "no \\+inf"),
    (dict(student_logits=torch.full((3,), -math.inf)), ValueError,
     "must not be -inf at every token of a position"),
    (dict(teacher_topk_logp=torch.full((2,), -math.inf)), ValueError,
     r"must not be -inf at every reported token of a position .*Q = 0"),
    (dict(teacher_topk_ids=torch.tensor([1, 1])), ValueError, "must not repeat an id"),
    (dict(teacher_topk_ids=torch.tensor([-1, 1])), ValueError, r"must lie in \[0, V\)"),
    (dict(teacher_topk_logp=torch.zeros(0), teacher_topk_ids=torch.zeros(0, dtype=torch.long)),
     ValueError, "1 <= k <= V = 3"),
    (dict(log_prob_min_clamp=True), TypeError, "log_prob_min_clamp must be a real number"),
    (dict(mask=torch.ones(2)), ValueError, r"mask must have the shape of the leading shape"),
    (dict(mask=torch.tensor(0.5)), ValueError, "mask values must be 0 or 1"),
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


# ---------------------------------------------------------------------------------------------
# Masks, impossible tokens and the rows that used to put NaN into the gradient
# ---------------------------------------------------------------------------------------------


def _three_positions():
    student = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=F64)
    report = torch.log(torch.tensor([[0.5, 0.25], [0.6, 0.3], [0.5, 0.25]], dtype=F64))
    return student, report, torch.tensor([[0, 1], [0, 1], [0, 1]])


@pytest.mark.parametrize("student_row, teacher_row", [
    ([-math.inf] * 3, [math.log(0.5), math.log(0.25)]),   # a padded student position
    ([0.0, 0.0, 0.0], [-math.inf, -math.inf]),              # a report of nothing
    ([math.nan] * 3, [math.nan, math.nan]),                 # garbage
])
@pytest.mark.parametrize("low", [None, -10.0])
def test_a_masked_out_position_gives_zero_value_and_zero_gradient(student_row, teacher_row, low):
    student, report, ids = _three_positions()
    student[1], report[1] = torch.tensor(student_row, dtype=F64), torch.tensor(teacher_row,
                                                                              dtype=F64)
    mask = torch.tensor([1, 0, 1])
    z = student.clone().requires_grad_(True)
    value = clamps.verl_forward_kl_topk(z, report, ids, mask, log_prob_min_clamp=low)
    value.sum().backward()
    assert value[1].item() == 0.0
    assert torch.equal(z.grad[1], torch.zeros(3, dtype=F64))
    assert bool(torch.isfinite(z.grad).all())
    # the other positions are what they are without the bad one
    kept = [0, 2]
    z_kept = student[kept].clone().requires_grad_(True)
    alone = clamps.verl_forward_kl_topk(z_kept, report[kept], ids[kept], log_prob_min_clamp=low)
    alone.sum().backward()
    torch.testing.assert_close(value[kept], alone, rtol=0, atol=0)
    torch.testing.assert_close(z.grad[kept], z_kept.grad, rtol=0, atol=0)
    d = clamps.topk_diagnostics(student, report, ids, mask, log_prob_min_clamp=low)
    for name in ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
        assert d[name][1].item() == 0, name
        assert bool(torch.isfinite(d[name].double()).all()), name
    assert all(math.isfinite(v) for v in d["metrics"].values())


@pytest.mark.parametrize("student_row, teacher_row, message", [
    ([-math.inf] * 3, [math.log(0.5), math.log(0.25)], "-inf at every token"),
    ([0.0, 0.0, 0.0], [-math.inf, -math.inf], "-inf at every reported token"),
])
def test_the_same_row_masked_in_is_refused(student_row, teacher_row, message):
    student, report, ids = _three_positions()
    student[1], report[1] = torch.tensor(student_row, dtype=F64), torch.tensor(teacher_row,
                                                                              dtype=F64)
    for call in (lambda: clamps.verl_forward_kl_topk(student, report, ids),
                 lambda: clamps.topk_diagnostics(student, report, ids, torch.ones(3))):
        with pytest.raises(ValueError, match=message + ".*mask selects|" + message):
            call()


def test_an_impossible_student_token_the_teacher_reports_is_an_infinite_value_no_gradient():
    # the student gives token 1 probability 0; the teacher 0.25: q log(q / 0) = +inf
    z = torch.tensor([[0.0, -math.inf, 0.0], [1.0, 0.0, -1.0]], dtype=F64, requires_grad=True)
    report = torch.log(torch.tensor([[0.5, 0.25], [0.6, 0.3]], dtype=F64))
    ids = torch.tensor([[0, 1], [0, 1]])
    value = clamps.verl_forward_kl_topk(z, report, ids)
    value.sum().backward()
    assert value[0].item() == math.inf and math.isfinite(value[1].item())
    assert torch.equal(z.grad[0], torch.zeros(3, dtype=F64))
    z.grad = None
    capped = clamps.verl_forward_kl_topk(z, report, ids, loss_max_clamp=10.0)
    capped.sum().backward()
    assert capped[0].item() == 10.0 and torch.equal(z.grad[0], torch.zeros(3, dtype=F64))
    # a reported probability of 0 where the student's is 0 too contributes nothing
    report[0, 1] = -math.inf
    assert clamps.verl_forward_kl_topk(z.detach(), report, ids)[0].item() == pytest.approx(
        0.5 * math.log(0.5 / 0.5))


def test_the_defaults_are_the_composed_config_and_the_dataclass_clamps_are_opt_in():
    """The defaults are the trainer's composed config (test_verl_config.py compares them with
    verl): no log-probability clamp, no cap, only the max(., 0)."""
    assert (clamps.VERL_LOG_PROB_MIN_CLAMP, clamps.VERL_LOSS_MAX_CLAMP) == (None, None)
    student = torch.tensor([0.0, -40.0, 0.0], dtype=F64)
    report, ids = torch.log(torch.tensor([0.9, 1e-6], dtype=F64)), torch.tensor([1, 2])
    # 0.9 (log 0.9 - log p_1) > 10 and log q_2 < -10: the cap alone, or the clamp, would bind
    stock = clamps.verl_forward_kl_topk(student, report, ids).item()
    assert stock == pytest.approx(_plain(student, report, ids, None, None), rel=1e-12)
    assert stock > 10
    cap = clamps.DATACLASS_LOSS_MAX_CLAMP
    assert clamps.verl_forward_kl_topk(student, report, ids, loss_max_clamp=cap).item() == cap
    low = clamps.DATACLASS_LOG_PROB_MIN_CLAMP
    dataclass = clamps.verl_forward_kl_topk(student, report, ids, log_prob_min_clamp=low,
                                            loss_max_clamp=cap).item()
    assert dataclass == pytest.approx(_plain(student, report, ids, low, None), rel=1e-12)
    assert dataclass < cap  # the clamp at c bounds the value by |c| Q: the cap cannot bind


@settings(deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 12), scale=st.floats(0.1, 60.0),
       low=st.floats(-30.0, -0.1))
def test_with_the_log_probability_clamp_the_value_is_at_most_minus_c_times_q(seed, V, scale, low):
    r"""Each term $e^{\bar t}(\bar t - \bar s)$ is $\le 0$ where $\bar t = c$ (as
    $\bar s \ge c$) and $\le q (0 - c)$ elsewhere: (c) $\le -c\,Q \le -c$, so the dataclass's
    cap $M = 10 = -c$ never binds beside its clamp $c = -10$."""
    g = torch.Generator().manual_seed(seed)
    student = scale * torch.randn(V, generator=g, dtype=F64)
    log_q = torch.log_softmax(scale * torch.randn(V, generator=g, dtype=F64), -1)
    k = int(torch.randint(1, V + 1, (1,), generator=g))
    ids = torch.randperm(V, generator=g)[:k]
    value = clamps.verl_forward_kl_topk(student, log_q[ids], ids, log_prob_min_clamp=low).item()
    Q = float(log_q[ids].exp().sum())
    assert value <= -low * Q * (1 + 1e-12) + 1e-12


@pytest.mark.properties
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 9), lead=st.integers(1, 4),
       scale=st.sampled_from([0.1, 1.0, 4.0, 30.0]), low=st.sampled_from([None, -10.0, -1.0]),
       high=st.sampled_from([None, 10.0, 0.05]), half=st.booleans())
def test_values_gradients_and_masks_on_random_reports(seed, V, lead, scale, low, high, half):
    """verl's formula at every masked-in position (float64 sums of Python floats), 0 with zero
    gradient at the masked-out ones (which hold -inf, NaN or nothing), never NaN, in [0, M]."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, V + 1, (1,), generator=g))
    student = scale * torch.randn(lead, V, generator=g, dtype=F64)
    log_q = torch.log_softmax(scale * torch.randn(lead, V, generator=g, dtype=F64), -1)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(lead)])
    report = log_q.gather(-1, ids)
    mask = torch.randint(0, 2, (lead,), generator=g)
    bad = mask == 0
    student[bad] = torch.tensor([-math.inf, math.nan])[torch.randint(0, 2, (1,), generator=g)]
    report[bad] = -math.inf
    dtype = torch.bfloat16 if half else F64
    z = student.to(dtype).requires_grad_(True)
    value = clamps.verl_forward_kl_topk(z, report.to(dtype), ids, mask, log_prob_min_clamp=low,
                                        loss_max_clamp=high)
    assert value.dtype == (torch.float32 if half else F64)
    value.sum().backward()
    assert bool(torch.isfinite(z.grad.double()).all())
    for i in range(lead):
        if bad[i]:
            assert value[i].item() == 0.0 and bool((z.grad[i] == 0).all())
            continue
        t = report[i].to(dtype).double()
        want = _plain(z[i].detach().double(), t, ids[i], low, high)
        # the size of the terms before they cancel: float32 rounds each log-probability
        s_i = torch.log_softmax(z[i].detach().double(), -1)[ids[i]]
        size = 1.0 + float((t.exp() * (t.abs() + s_i.abs())).sum())
        tol = (1e-6 if half else 1e-13) * size
        assert value[i].item() == pytest.approx(want, rel=0, abs=tol)
        # the cap as the compute dtype holds it (0.05 is 0.0500000007 in float32)
        cap = math.inf if high is None else torch.tensor(high, dtype=value.dtype).item()
        assert 0 <= value[i].item() <= cap


# ---------------------------------------------------------------------------------------------
# The defaults as the package and the chapter state them (verl itself: test_verl_config.py)
# ---------------------------------------------------------------------------------------------


def test_the_topk_module_and_the_chapter_state_the_composed_and_the_dataclass_defaults():
    import pathlib

    from opd_literate.large_vocab import topk

    page = (pathlib.Path(__file__).parents[2] / "docs" / "large_vocab.md").read_text()
    doc = " ".join(topk.__doc__.split())
    assert (f"top-{clamps.VERL_TOPK} and no log-probability clamp in the config its trainer "
            f"composes, top-{clamps.DATACLASS_TOPK} and a clamp at "
            f"${clamps.DATACLASS_LOG_PROB_MIN_CLAMP:g}$ in the ``DistillationLossConfig`` "
            "dataclass") in doc
    flat = " ".join(page.split())
    assert (f"(`topk: {clamps.VERL_TOPK}` in the config its trainer composes from "
            f"`distillation.yaml`; {clamps.DATACLASS_TOPK} in the `DistillationLossConfig` "
            "dataclass)") in flat
    assert (f"(`null` in the composed config; ${clamps.DATACLASS_LOG_PROB_MIN_CLAMP:g}$ and "
            f"{clamps.DATACLASS_LOSS_MAX_CLAMP:g} in the dataclass)") in flat
    assert (f"| verl `forward_kl_topk` | the teacher's top-$k$ ({clamps.VERL_TOPK} in the "
            f"composed config, {clamps.DATACLASS_TOPK} in the dataclass) |") in page
    assert "defaults to 128" not in flat and "(default $-10$)" not in flat
