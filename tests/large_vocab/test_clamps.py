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


# ---------------------------------------------------------------------------------------------
# Rounding: what the studies count as a clamp, as P > Q and as a position without gradient
# ---------------------------------------------------------------------------------------------


def _float32_against_float64(seed, V, k, scale, near, low):
    """The noises of the module docstring's "Rounding" against the float64 computation of the
    same float32 logits (whose own rounding, 1e-16, is far below float32's)."""
    g = torch.Generator().manual_seed(seed)
    student = (scale * torch.randn(V, generator=g, dtype=F64)).float()
    noise = 1e-6 if near else scale
    teacher = (student.double() + noise * torch.randn(V, generator=g, dtype=F64)).float()
    log_q32 = torch.log_softmax(teacher, -1)
    report, ids = log_q32.topk(k, -1)
    s32, t32, s_bar32, t_bar32 = clamps._clamped_terms(student, report, ids, low)
    raw32 = clamps._value(student, report, ids, low, None)[1]
    t64 = torch.log_softmax(teacher.double(), -1)[ids]
    s64, _, s_bar64, t_bar64 = clamps._clamped_terms(student.double(), t64, ids, low)
    raw64 = clamps._token_terms(s_bar64, t_bar64).sum(-1)
    g32 = torch.softmax(student, -1) - log_q32.exp()
    g64 = torch.softmax(student.double(), -1) - torch.log_softmax(teacher.double(), -1).exp()
    return dict(
        value=(abs(raw32.item() - raw64.item()), clamps._value_noise(s_bar32, t_bar32, V).item()),
        mass=(abs((s32.exp().sum() - t32.exp().sum()).item()
                  - (s64.exp().sum() - t64.exp().sum()).item()),
              clamps._mass_noise(s32, t32, V).item()),
        gradient=((g32.double() - g64).norm().item(), clamps._gradient_noise(V, torch.float32)))


@settings(deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(1, 400), k_share=st.floats(0.0, 1.0),
       scale=st.sampled_from([0.01, 1.0, 5.0, 30.0]), near=st.booleans(),
       low=st.sampled_from([None, -10.0]))
def test_the_rounding_bounds_hold_against_float64(seed, V, k_share, scale, near, low):
    k = max(1, round(k_share * V))
    for name, (error, bound) in _float32_against_float64(seed, V, k, scale, near, low).items():
        assert error <= bound, (name, error, bound)


def test_the_rounding_bounds_are_not_vacuous():
    # the bounds are a few hundred epsilons: far below a clamp the study is meant to count
    measured = _float32_against_float64(0, 256, 32, 1.0, False, None)
    eps = torch.finfo(torch.float32).eps
    assert measured["gradient"][1] == pytest.approx(6 * eps * 17)
    assert measured["value"][1] < 1e-3 and measured["mass"][1] < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_student_equal_to_the_teacher_is_exact_at_k_equal_to_v(dtype):
    """p = q: the true gradient is 0 and (c) at k = V is the KL itself (value and gradient 0);
    (b) is a KL of the coarse-grained p and q, also 0 with gradient 0, at every k; (c) at
    k < V sends Q p - q 1_S, not 0, where the truth sends nothing: no finite relative error."""
    s = torch.randn(4, 50, generator=torch.Generator().manual_seed(1), dtype=dtype)
    one, full = clamps.weighted_clamp_study(s, s.clone(), torch.ones(4, dtype=dtype), ks=[1, 50])
    for row in (one, full):
        assert (row["clamped"], row["capped"], row["p_above_q"], row["lost"]) == (0, 0, 0, 0)
        assert row["b_grad_error"] == 0.0
    assert full["c_grad_error"] == 0.0
    # Q p - q 1_S at k = 1, its norm computed apart: far from 0, so the error is +inf
    p = torch.softmax(s.double(), -1)
    top = p.argmax(-1, keepdim=True)
    q_top = p.gather(-1, top)
    grad = q_top * p - torch.zeros_like(p).scatter(-1, top, q_top)
    assert bool((grad.norm(dim=-1) > 1e-3).all()) and one["c_grad_error"] == math.inf


def test_the_study_of_a_student_that_is_its_teacher():
    rows = clamps.clamp_study(V=256, temperatures=(1.0,), noises=(0.0,), positions=4,
                              ks=(1, 8, 256))
    assert [r["c_grad_error"] for r in rows] == [math.inf, math.inf, 0.0]
    assert all(r["b_grad_error"] == 0.0 and r["clamped"] == 0.0 and r["lost"] == 0.0
               and r["p_above_q"] == 0.0 for r in rows)


def test_a_near_tie_in_float32_is_no_clamp_at_k_equal_to_v():
    """At k = V (c) is the KL, >= 0: a float32 value of -1e-7 there is rounding, not a clamp."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 50, generator=g)
    t = s + 1e-6 * torch.randn(4, 50, generator=g)
    [row] = clamps.weighted_clamp_study(s, t, torch.ones(4), ks=[50])
    assert (row["clamped"], row["lost"], row["p_above_q"]) == (0.0, 0.0, 0.0)
    # a real clamp is still counted: the docstring's P = 0.9 > Q = 0.75, value -0.0059
    student = torch.log(torch.tensor([[0.8, 0.1, 0.1]]))
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    [row] = clamps.weighted_clamp_study(student, teacher, torch.ones(1), ks=[2])
    assert row["clamped"] == 1.0 and row["p_above_q"] == 1.0


def test_a_state_of_weight_zero_does_not_count_even_with_an_infinite_error():
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(2, 6, generator=g, dtype=F64), torch.randn(2, 6, generator=g, dtype=F64)
    t[1] = s[1]  # the second state: p = q, (c) at k = 1 has no finite relative error there
    both = clamps.weighted_clamp_study(s, t, torch.tensor([1.0, 0.0], dtype=F64), ks=[1])
    alone = clamps.weighted_clamp_study(s[:1], t[:1], torch.ones(1, dtype=F64), ks=[1])
    assert both == alone and math.isfinite(both[0]["c_grad_error"])


def test_weights_whose_sum_overflows_give_the_same_means():
    """The means are invariant to scaling the weights: 3e38 each is 1 each."""
    g = torch.Generator().manual_seed(4)
    s, t = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    huge = clamps.weighted_clamp_study(s, t, torch.tensor([3e38, 3e38]), ks=[1, 2])
    unit = clamps.weighted_clamp_study(s, t, torch.ones(2), ks=[1, 2])
    assert huge == unit and all(r["c_grad_error"] > 0.1 for r in unit)


def test_integer_report_sizes_of_numpy_and_torch_are_accepted_bools_are_not():
    import numpy as np

    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    w = torch.ones(2, dtype=F64)
    plain = clamps.weighted_clamp_study(s, t, w, ks=[1, 2])
    assert clamps.weighted_clamp_study(s, t, w, ks=[np.int64(1), torch.tensor(2)]) == plain
    assert clamps.weighted_clamp_study(s, t, w, ks=torch.tensor([1, 2])) == plain
    assert [r["k"] for r in plain] == [1, 2] and type(plain[0]["k"]) is int
    for bad in (True, np.bool_(True), 1.0, torch.tensor([1]), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"every k must be an integer in \[1, V\] = \[1, 3\]"):
            clamps.weighted_clamp_study(s, t, w, ks=[bad])
    rows = clamps.clamp_study(V=16, temperatures=(1.0,), noises=(1.0,), ks=(np.int64(2),),
                              positions=np.int64(2), seed=np.int32(0))
    assert rows == clamps.clamp_study(V=16, temperatures=(1.0,), noises=(1.0,), ks=(2,),
                                      positions=2, seed=0)
    with pytest.raises(ValueError, match="positions must be an integer >= 1, got True"):
        clamps.clamp_study(V=16, positions=True)


# ---------------------------------------------------------------------------------------------
# Reports beyond one distribution, overflowing logits, diagnostics without a mask
# ---------------------------------------------------------------------------------------------


def test_a_report_that_sums_to_more_than_one_is_refused_where_it_counts():
    """The bound (c) <= -c Q <= 10 needs Q <= 1: a report of Q = 2 made the value 20, capped."""
    student, ids = torch.tensor([0.0, 0.0, 20.0]), torch.tensor([0, 1])
    for call in (lambda r, m=None: clamps.verl_forward_kl_topk(
            student.expand(2, 3) if m is not None else student, r, ids.expand(2, 2)
            if m is not None else ids, m, log_prob_min_clamp=-10.0, loss_max_clamp=10.0),
                 lambda r, m=None: clamps.topk_diagnostics(
            student.expand(2, 3) if m is not None else student, r, ids.expand(2, 2)
            if m is not None else ids, m)):
        with pytest.raises(ValueError, match="reported probabilities sum to 2 at position .*"
                                             "must sum to at most 1"):
            call(torch.zeros(2))
        # masked out, the same report counts for nothing
        call(torch.tensor([[0.0, 0.0], [math.log(0.5), math.log(0.25)]]), torch.tensor([0, 1]))
        # within rounding of 1 it is a report of one distribution
        call(torch.log(torch.tensor([0.5, 0.5 + 1e-5])))
    value = clamps.verl_forward_kl_topk(student.expand(2, 3), torch.tensor(
        [[0.0, 0.0], [math.log(0.5), math.log(0.25)]]), ids.expand(2, 2), torch.tensor([0, 1]))
    assert value[0].item() == 0.0 and value[1].item() > 0


def test_logits_whose_spread_overflows_are_refused_as_by_topk_kl():
    student = torch.tensor([3e38, -3e38, 0.0])
    report, ids = torch.log(torch.tensor([0.5, 0.25])), torch.tensor([0, 1])
    message = "student_logits span more than the range of torch.float32 within a position"
    with pytest.raises(ValueError, match=message):
        topk_kl(student, report, ids, "ignore", "forward")
    with pytest.raises(ValueError, match=message):
        clamps.verl_forward_kl_topk(student, report, ids)
    with pytest.raises(ValueError, match=message):
        clamps.topk_diagnostics(student, report, ids)
    # in float64 the spread fits, and the value is finite: 0.25 (log 0.25 - log p_1) ~ 1.5e38
    value = clamps.verl_forward_kl_topk(student.double(), report.double(), ids)
    assert value.item() == pytest.approx(0.25 * 6e38, rel=1e-6)
    # masked out, the row is never computed
    rows = torch.stack([student, torch.zeros(3)])
    out = clamps.verl_forward_kl_topk(rows, report.expand(2, 2), ids.expand(2, 2),
                                      torch.tensor([0, 1]))
    assert out[0].item() == 0.0


def test_diagnostics_without_a_mask_count_every_position():
    g = torch.Generator().manual_seed(6)
    student = torch.randn(3, 7, generator=g, dtype=F64)
    report, ids = torch.log_softmax(torch.randn(3, 7, generator=g, dtype=F64), -1).topk(3, -1)
    free = clamps.topk_diagnostics(student, report, ids)
    full = clamps.topk_diagnostics(student, report, ids, torch.ones(3))
    for name in ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
        assert torch.equal(free[name], full[name]), name
    assert free["metrics"] == full["metrics"]


def test_an_impossible_token_in_the_students_top_k_is_not_in_the_overlap():
    """z = (-inf, 0), k = 2: torch.topk names both tokens; token 0 has p = 0 < q = 0.5, whose
    advantage -q log(q / 0) is -inf. The overlap is token 1 alone: -0.5 log(0.5 / 1)."""
    z = torch.tensor([-math.inf, 0.0], dtype=F64, requires_grad=True)
    d = clamps.topk_diagnostics(z, torch.log(torch.tensor([0.5, 0.5], dtype=F64)),
                                torch.tensor([0, 1]))
    assert d["overlap_count"].item() == 1
    assert d["overlap_token_advantage"].item() == pytest.approx(0.5 * math.log(2), rel=1e-15)
    assert all(math.isfinite(v) for v in d["metrics"].values())
    assert d["metrics"]["overlap_ratio"] == 0.5
    d["overlap_token_advantage"].backward()
    assert bool(torch.isfinite(z.grad).all())


def test_the_chapter_gives_the_dataclasss_defaults_with_its_policy_gradient():
    """docs/large_vocab.md, "Which clamps a verl run gets": the dataclass's defaults the page
    lists are the constants tests/integration/test_verl_config.py reads from verl 0.9.1."""
    import pathlib

    from opd_literate.mismatch import task_rewards

    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "large_vocab.md").read_text()
                    .split())
    assert ("The `DistillationLossConfig` dataclass has other defaults, $k = 128$, $c = -10$, "
            "$M = 10$ and `use_policy_gradient: true`") in page
    assert (clamps.DATACLASS_TOPK, clamps.DATACLASS_LOG_PROB_MIN_CLAMP,
            clamps.DATACLASS_LOSS_MAX_CLAMP) == (128, -10.0, 10.0)
    assert task_rewards.DATACLASS_DISTILLATION["use_policy_gradient"] is True
    assert task_rewards.VERL_DISTILLATION["use_policy_gradient"] is False
    assert ("the dataclass's clamps switched on, the loss still backpropagated as the composed "
            "config has it") in page
